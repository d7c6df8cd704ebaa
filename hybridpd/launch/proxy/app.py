"""The P/D routing proxy: an aiohttp application in front of vLLM prefill (P) and decode (D) instances.

Why aiohttp: one dependency provides both the HTTP server and the HTTP client, both stream natively
(``StreamResponse.write`` towards the client, ``ClientResponse.content`` from D, with back-pressure in both
directions), and it needs no separate ASGI server. The reference design (FastAPI + httpx + uvicorn) needs three.

Request flow (see ``protocol``): validate -> P leg (JSON, ``max_tokens=1``) -> check P's ``kv_transfer_params``
-> D leg with them -> D's answer relayed (SSE streamed event by event, or the JSON body).

Error mapping (OpenAI-style body ``{"error": {"message", "type", "code", "param"}}``):

* 400 bad JSON / not an object / refused field (``n``>1, several prompts...); 401 missing or wrong API key;
  413 body larger than ``max_request_bytes``; 404/405 unknown route or method.
* 503 no healthy P (or D) backend; 502 connection refused by every backend tried (each one is ejected at once
  and the request moves to the next healthy one: nothing reached it, so retrying is safe), backend 5xx (upstream
  status quoted in the message), backend 401/403 (proxy misconfigured, not the client's fault), unreadable or
  invalid P answer (no usable ``kv_transfer_params``), connection lost before the answer.
* 504 P slower than ``prefill_timeout_s``; D sent no byte within ``decode_first_byte_timeout_s`` (streams) or did
  not finish within ``decode_timeout_s`` (non-streaming).
* A backend's own 4xx (bad model name, prompt too long...) is passed through unchanged: it is the client's fault.
* Client errors never quote backend URLs or backend error text (those go to the log, with the request's ids);
  ``expose_backend_errors`` appends them for debugging. An answer that breaks the protocol (non-JSON from D,
  a non-SSE body for a stream, a ``data:`` line that is not JSON) is 502 / an error event, never relayed.
* Request ids: every request gets a proxy-generated pairing id, sent to P and D as ``X-Request-Id`` (it ties
  P's KV to D's read, so it must be unique in flight). A client's valid ``X-Request-Id`` is kept for
  correlation: echoed in the response's ``X-Request-Id`` and logged next to the pairing id, which the response
  carries as ``X-HybridPD-Pairing-Id``.
* Once a stream has started the status cannot change: if D dies, stalls or ends without ``data: [DONE]``, the
  client gets the complete events relayed so far, then one ``data: {"error": {...}}`` event, and the stream ends
  WITHOUT ``data: [DONE]`` (OpenAI SDKs raise on the error event; others see a truncated stream).

Modules: ``state`` (what one app owns, start/stop), ``handlers`` (the routes), ``legs`` (the P and D legs),
``upstream`` (the session to the backends, retry on refused connections), ``health`` (probes, KV-lease watch).

A client disconnect cancels the handler (``handler_cancellation=True``, set by ``serve_proxy``; aiohttp's test
server does the same) and closes the upstream D connection, which makes vLLM abort the request. Embedders that
run ``build_app`` on their own runner should pass ``handler_cancellation=True`` too; without it the upstream is
still closed, but only at the next chunk written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.errors import INTERNAL, INVALID_REQUEST, NOT_FOUND, ProxyError, error_body
from hybridpd.launch.proxy.handlers import (
    check_auth,
    error_response,
    handle_chat_completions,
    handle_completions,
    handle_health,
    handle_metrics,
    handle_models,
    handle_tokenizer,
    json_response,
)
from hybridpd.launch.proxy.protocol import CHAT_COMPLETIONS, COMPLETIONS
from hybridpd.launch.proxy.state import STATE, ProxyState

__all__ = ["STATE", "ProxyState", "build_app", "proxy_state"]

log = logging.getLogger("hybridpd.launch.proxy")

_TOKENIZER_ROUTES: Final = frozenset({"/tokenize", "/detokenize"})
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Auth on /v1/*, errors -> OpenAI-style JSON, request metrics (status 499 = client went away)."""
    state = request.app[STATE]
    metrics = state.metrics
    route = _route_label(request)
    api = request.path.startswith("/v1/") or request.path in _TOKENIZER_ROUTES
    started = time.perf_counter()
    status = 500
    if api:
        metrics.outstanding.inc()
        state.in_flight += 1
    try:
        if api:
            check_auth(request, state.config.api_key)
        response = await handler(request)
        status = response.status
        return response
    except ProxyError as exc:
        status = exc.status
        return error_response(exc)
    except web.HTTPException as exc:
        status = exc.status
        if status < 400:
            raise
        kind, code = (NOT_FOUND, "not_found") if status == 404 else (INVALID_REQUEST, f"http_{status}")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow",)}
        return json_response(status, error_body(f"{exc.reason}: {request.method} {request.path}", type=kind, code=code),
                             headers=headers or None)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(500, error_body("internal proxy error", type=INTERNAL, code="internal_error"))
    finally:
        if api:
            metrics.outstanding.dec()
            state.in_flight -= 1
        metrics.child(metrics.requests, route, str(status)).inc()
        metrics.child(metrics.request_duration, route).observe(time.perf_counter() - started)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.start()
    yield
    await state.stop()


def build_app(config: ProxyConfig) -> web.Application:
    """A fresh proxy application (own pools, metrics registry and HTTP session; nothing shared between apps)."""
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[_middleware])
    app[STATE] = ProxyState(config)
    app.cleanup_ctx.append(_lifecycle)
    app.add_routes([
        web.post(COMPLETIONS, handle_completions),
        web.post(CHAT_COMPLETIONS, handle_chat_completions),
        web.get("/v1/models", handle_models),
        web.post("/tokenize", handle_tokenizer),
        web.post("/detokenize", handle_tokenizer),
        web.get("/health", handle_health),
        web.get("/metrics", handle_metrics),
    ])
    return app


def proxy_state(app: web.Application) -> ProxyState:
    """The state behind an app built by ``build_app`` (pools, metrics), for tests and embedding."""
    return app[STATE]
