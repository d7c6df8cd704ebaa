"""The proxy's route handlers and what they share with the middleware: client auth, reading the request body,
JSON answers. Each handler finds its ``ProxyState`` under ``request.app[STATE]`` (no module globals).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from typing import Any, Final

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.errors import (
    AUTHENTICATION,
    INVALID_REQUEST,
    UNAVAILABLE,
    ProxyError,
    UpstreamReply,
    bad_request,
)
from hybridpd.launch.proxy.legs import client_note
from hybridpd.launch.proxy.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    decode_request,
    fields_to_restore,
    is_streaming,
    prefill_request,
    validate_client_request,
)
from hybridpd.launch.proxy.state import STATE

log = logging.getLogger("hybridpd.launch.proxy")

_REQUEST_ID_RE: Final = re.compile(r"[\x21-\x7e]{1,256}")


def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    # ASCII escapes: error bodies may quote client input, which can hold lone surrogates
    body = json.dumps(payload, separators=(",", ":")).encode()
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def error_response(exc: ProxyError) -> web.Response:
    response = json_response(exc.status, exc.to_dict(), headers=exc.headers or None)
    if exc.status == 408 or exc.headers.get("Connection") == "close":
        response.force_close()  # the rest of the body may still be on its way: do not parse it as a request
    return response


def encode(body: Any) -> bytes:
    """A request body for a backend; a client string that cannot be UTF-8 (a lone surrogate such as
    ``"\\ud800"``, valid JSON but not valid Unicode) is the client's error."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise bad_request(f"request body holds a string that is not valid Unicode ({exc.reason})",
                          code="invalid_unicode") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def check_auth(request: web.Request, key: str | None) -> None:
    """Nothing when ``key`` is None or the request carries ``Authorization: Bearer <key>``, else 401."""
    if key is None:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ProxyError(
            401,
            "missing or invalid API key (send 'Authorization: Bearer <key>')",
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def read_json(request: web.Request, config: ProxyConfig) -> object:
    """The request body as JSON, within ``max_request_bytes`` (413) and ``body_timeout_s`` (408); else 400."""
    limit = config.max_request_bytes
    too_large = ProxyError(
        413,
        f"request body exceeds the proxy's limit of {limit} bytes",
        type=INVALID_REQUEST,
        code="request_too_large",
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        raw = await asyncio.wait_for(request.read(), config.body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except asyncio.TimeoutError:
        raise ProxyError(
            408,
            f"request body not received within body_timeout_s={config.body_timeout_s}",
            type=INVALID_REQUEST,
            code="body_timeout",
        ) from None
    except (web.RequestPayloadError, aiohttp.ClientPayloadError) as exc:
        # e.g. Content-Encoding: gzip on a body that is not gzip. aiohttp's parser is dead for this
        # connection: mark the body consumed (else aiohttp re-reads it after our answer and logs the same
        # error with a traceback) and close the connection after the answer.
        request.content.feed_eof()
        error = bad_request(f"request body could not be decoded ({str(exc).strip() or type(exc).__name__})",
                            code="invalid_body_encoding")
        error.headers["Connection"] = "close"
        raise error from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def _client_request_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id`` if it is a plausible id (printable ASCII, <= 256 chars), else None."""
    given = request.headers.get("X-Request-Id")
    return given if given is not None and _REQUEST_ID_RE.fullmatch(given) else None


def _id_headers(pairing_id: str, client_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": client_id or pairing_id, "X-HybridPD-Pairing-Id": pairing_id}


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, COMPLETIONS)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CHAT_COMPLETIONS)


async def _generate(request: web.Request, route: str) -> web.StreamResponse:
    state = request.app[STATE]
    legs = state.legs
    pairing_id = str(uuid.uuid4())
    ids = _id_headers(pairing_id, _client_request_id(request))
    try:
        body = validate_client_request(await read_json(request, state.config), route)
        p_body = encode(prefill_request(body))  # also catches what cannot be encoded before any backend call
        if state.decode.healthy_count == 0:  # fail before P does work (and holds KV blocks) for nobody
            raise ProxyError(
                503, "no healthy decode backend available", type=UNAVAILABLE, code="no_healthy_decode_backend"
            )
        headers = state.upstream.request_headers(request.headers, pairing_id)
        p_backend, kv = await legs.prefill(route, p_body, headers)
        p_done = asyncio.get_running_loop().time()
        d_body = encode(decode_request(body, kv, fields_to_restore(body)))
        if is_streaming(body):
            return await legs.decode_stream(request, route, d_body, headers, ids, (p_done, p_backend))
        response = await legs.decode_unary(route, d_body, headers, ids)
        legs.note_handover((p_done, p_backend), asyncio.get_running_loop().time(), ids)
        return response
    except ProxyError as exc:
        for name, value in ids.items():
            exc.headers.setdefault(name, value)
        log.log(logging.WARNING if exc.status >= 500 else logging.INFO,
                "request %s%s failed: %s %s%s", pairing_id, client_note(ids), exc.status, exc.message,
                f" [{exc.detail}]" if exc.detail and not state.config.expose_backend_errors else "")
        raise
    except UpstreamReply as exc:
        return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type, **ids})


async def handle_tokenizer(request: web.Request) -> web.Response:
    """``/tokenize`` and ``/detokenize`` (vLLM's routes; ``vllm bench serve`` uses them): the body is passed
    to the first healthy D that answers, else P (both serve the same tokenizer)."""
    state = request.app[STATE]
    data = encode(await read_json(request, state.config))
    return await state.upstream.first_answer((state.decode, state.prefill), "POST", request.path, data)


async def handle_models(request: web.Request) -> web.Response:
    """``/v1/models`` from the first healthy D backend that answers, else from P."""
    state = request.app[STATE]
    return await state.upstream.first_answer((state.decode, state.prefill), "GET", "/v1/models", None)


async def handle_health(request: web.Request) -> web.Response:
    """200 when at least one P and one D are in rotation, else 503. Counts only (no backend URLs).

    If the last probe round is older than ``health_max_age_s``, this request runs one first (shared with
    concurrent callers), so a backend that died is reported within one /health call, not one interval."""
    state = request.app[STATE]
    if asyncio.get_running_loop().time() - state.health.last_probe > state.config.health_max_age_s:
        await state.health.probe_health()
    p, d = state.prefill.healthy_count, state.decode.healthy_count
    ok = p > 0 and d > 0
    payload = {
        "status": "ok" if ok else "unavailable",
        "prefill": {"healthy": p, "total": len(state.prefill.backends)},
        "decode": {"healthy": d, "total": len(state.decode.backends)},
    }
    return json_response(200 if ok else 503, payload)


async def handle_metrics(request: web.Request) -> web.Response:
    """Prometheus text; behind ``metrics_api_key`` if set, else behind ``api_key`` if set (it names backends)."""
    state = request.app[STATE]
    cfg = state.config
    check_auth(request, cfg.api_key if cfg.metrics_api_key is None else cfg.metrics_api_key)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
