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

A client disconnect cancels the handler (``handler_cancellation=True``, set by ``serve_proxy``; aiohttp's test
server does the same) and closes the upstream D connection, which makes vLLM abort the request. Embedders that
run ``build_app`` on their own runner should pass ``handler_cancellation=True`` too; without it the upstream is
still closed, but only at the next chunk written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.errors import (
    AUTHENTICATION,
    INTERNAL,
    INVALID_REQUEST,
    NOT_FOUND,
    UNAVAILABLE,
    UPSTREAM,
    UPSTREAM_TIMEOUT,
    ProxyError,
    UpstreamReply,
    bad_request,
    error_body,
    sse_error_event,
)
from hybridpd.launch.proxy.health import HealthProbes
from hybridpd.launch.proxy.kvwatch import Handover, LeaseWatch
from hybridpd.launch.proxy.metrics import ProxyMetrics
from hybridpd.launch.proxy.pool import Backend, BackendPool
from hybridpd.launch.proxy.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    SSEError,
    SSEFramer,
    decode_request,
    fields_to_restore,
    is_streaming,
    kv_transfer_params_from_prefill,
    prefill_request,
    validate_client_request,
)

log = logging.getLogger("hybridpd.launch.proxy")
T = TypeVar("T")

_REQUEST_ID_RE: Final = re.compile(r"[\x21-\x7e]{1,256}")
_FORWARDED_HEADERS: Final = ("traceparent", "tracestate")
_MODELS_TIMEOUT_S: Final = 30.0
_TOKENIZER_ROUTES: Final = frozenset({"/tokenize", "/detokenize"})
_CONNECT_ERRORS: Final[tuple[type[BaseException], ...]] = (aiohttp.ClientConnectorError,) + (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    # ASCII escapes: error bodies may quote client input, which can hold lone surrogates
    body = json.dumps(payload, separators=(",", ":")).encode()
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _error_response(exc: ProxyError) -> web.Response:
    response = _json_response(exc.status, exc.to_dict(), headers=exc.headers or None)
    if exc.status == 408 or exc.headers.get("Connection") == "close":
        response.force_close()  # the rest of the body may still be on its way: do not parse it as a request
    return response


def _encode(body: Any) -> bytes:
    """A request body for a backend; a client string that cannot be UTF-8 (a lone surrogate such as
    ``"\\ud800"``, valid JSON but not valid Unicode) is the client's error."""
    try:
        return _dumps(body)
    except UnicodeEncodeError as exc:
        raise bad_request(f"request body holds a string that is not valid Unicode ({exc.reason})",
                          code="invalid_unicode") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def _snippet(raw: bytes, limit: int = 300) -> str:
    """The upstream's error message (vLLM JSON error shapes), else the start of its body."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:limit]
        if isinstance(parsed.get("message"), str):
            return str(parsed["message"])[:limit]
    text = raw.decode("utf-8", "replace").strip()
    return (text[:limit] + "...") if len(text) > limit else (text or "<empty body>")


def _client_request_id(request: web.Request) -> str | None:
    """The client's ``X-Request-Id`` if it is a plausible id (printable ASCII, <= 256 chars), else None."""
    given = request.headers.get("X-Request-Id")
    return given if given is not None and _REQUEST_ID_RE.fullmatch(given) else None


def _id_headers(pairing_id: str, client_id: str | None) -> dict[str, str]:
    return {"X-Request-Id": client_id or pairing_id, "X-HybridPD-Pairing-Id": pairing_id}


if sys.version_info >= (3, 11):

    async def _until(aw: Awaitable[T], deadline: float) -> T:
        """``await aw`` until loop time ``deadline``, else ``TimeoutError`` (no extra task, unlike wait_for)."""
        async with asyncio.timeout_at(deadline):
            return await aw

else:  # pragma: no cover

    async def _until(aw: Awaitable[T], deadline: float) -> T:
        return await asyncio.wait_for(aw, max(deadline - asyncio.get_running_loop().time(), 0.001))


def _client_note(ids: dict[str, str]) -> str:
    client = ids["X-Request-Id"]
    return "" if client == ids["X-HybridPD-Pairing-Id"] else f" (client id {client})"


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class ProxyState(HealthProbes):
    """Everything one proxy app owns: config, backend pools, metrics, the upstream HTTP session, the health task."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = BackendPool(
            "prefill",
            config.prefill_urls,
            config.policy,
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
        )
        self.decode = BackendPool(
            "decode",
            config.decode_urls,
            config.policy,
            unhealthy_after=config.unhealthy_after,
            healthy_after=config.healthy_after,
        )
        self.metrics = ProxyMetrics((self.prefill, self.decode))
        self.leases = LeaseWatch()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._probe_round: asyncio.Task[None] | None = None
        self._last_probe = -math.inf
        #: Client requests in flight on /v1/* (and tokenizer routes); D responses of streams being relayed.
        self.in_flight = 0
        self._streams: set[aiohttp.ClientResponse] = set()
        self.shutting_down = False

    # ----------------------------------------------------------------- lifecycle

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy app is not started (use an AppRunner / TestServer)")
        return self._session

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_upstream_connections,
            limit_per_host=0,
            keepalive_timeout=self.config.upstream_keepalive_s,
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        await self.probe_all()  # know who is up before the first request (bounded by health_timeout_s)
        self._health_task = asyncio.create_task(self._health_loop(), name="hybridpd-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ----------------------------------------------------------------- helpers

    def _auth_headers(self) -> dict[str, str]:
        key = self.config.backend_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **self._auth_headers()}
        for name in _FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def _upstream_error(self, status: int, public: str, detail: str, *, type: str, code: str) -> ProxyError:
        """A ProxyError whose client message is ``public``; ``detail`` (backend URL, backend text) is logged by
        the handler and appended to the client message only with ``expose_backend_errors``."""
        message = f"{public} ({detail})" if self.config.expose_backend_errors else public
        return ProxyError(status, message, type=type, code=code, detail=detail)

    def check_auth(self, request: web.Request, key: str | None = None) -> None:
        key = self.config.api_key if key is None else key
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

    async def _read_json(self, request: web.Request) -> object:
        limit = self.config.max_request_bytes
        too_large = ProxyError(
            413,
            f"request body exceeds the proxy's limit of {limit} bytes",
            type=INVALID_REQUEST,
            code="request_too_large",
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            raw = await asyncio.wait_for(request.read(), self.config.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except asyncio.TimeoutError:
            raise ProxyError(
                408,
                f"request body not received within body_timeout_s={self.config.body_timeout_s}",
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

    async def _open(
        self,
        pool: BackendPool,
        path: str,
        data: bytes,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        deadline: float | None,
    ) -> tuple[Backend, aiohttp.ClientResponse]:
        """POST to a backend chosen by the pool's policy; refused connections eject and move to the next one.

        On return the backend is acquired (outstanding + 1): the caller must ``pool.release`` it and close the
        response. ``deadline`` (loop time) bounds the wait for the response headers.
        """
        leg = pool.role
        tried: list[Backend] = []
        last: str | None = None
        while True:
            backend = pool.select(exclude=tried)
            if backend is None:
                if last is None:
                    raise ProxyError(
                        503, f"no healthy {leg} backend available", type=UNAVAILABLE, code=f"no_healthy_{leg}_backend"
                    )
                raise self._upstream_error(
                    502,
                    f"could not connect to any {leg} backend ({len(tried)} tried)",
                    f"last: {last}",
                    type=UPSTREAM,
                    code=f"{leg}_unreachable",
                )
            pool.acquire(backend)
            try:
                ctx = self.session.post(backend.url + path, data=data, headers=headers, timeout=timeout)
                if deadline is None:
                    resp = await ctx
                else:
                    resp = await _until(ctx, deadline)
            except _CONNECT_ERRORS as exc:
                pool.release(backend)
                last = f"{backend.url}: {exc}"
                self.metrics.upstream_errors.labels(leg, "connect").inc()
                self._eject(pool, backend, f"connect failed: {exc}")
                tried.append(backend)
                continue
            except asyncio.TimeoutError:
                pool.release(backend)
                raise self._timeout_error(leg, backend, first_byte=deadline is not None) from None
            except aiohttp.ClientError as exc:
                pool.release(backend)
                self.metrics.upstream_errors.labels(leg, "disconnect").inc()
                raise self._upstream_error(
                    502,
                    f"{leg} backend failed before answering",
                    f"{backend.url}: {type(exc).__name__}: {exc}",
                    type=UPSTREAM,
                    code=f"{leg}_connection_error",
                ) from None
            except BaseException:
                pool.release(backend)
                raise
            return backend, resp

    def _timeout_error(self, leg: str, backend: Backend, *, first_byte: bool) -> ProxyError:
        cfg = self.config
        self.metrics.upstream_errors.labels(leg, "timeout").inc()
        if leg == "prefill":
            what = f"did not answer within prefill_timeout_s={cfg.prefill_timeout_s}"
        elif first_byte:
            what = f"sent no data within decode_first_byte_timeout_s={cfg.decode_first_byte_timeout_s}"
        else:
            what = f"did not finish within decode_timeout_s={cfg.decode_timeout_s}"
        return self._upstream_error(504, f"{leg} backend {what}", backend.url, type=UPSTREAM_TIMEOUT,
                                    code=f"{leg}_timeout")

    async def _check_status(self, backend: Backend, resp: aiohttp.ClientResponse) -> None:
        """Turn a backend's error status into the proxy's answer (5xx/401/403 -> 502, other 4xx passed through)."""
        if resp.status < 400:
            return
        leg = backend.role
        raw = await resp.read()
        if resp.status >= 500 or resp.status in (401, 403, 407):
            kind = "http_5xx" if resp.status >= 500 else "http_auth"
            self.metrics.upstream_errors.labels(leg, kind).inc()
            raise self._upstream_error(
                502,
                f"{leg} backend returned HTTP {resp.status}",
                f"{backend.url}: {_snippet(raw)}",
                type=UPSTREAM,
                code=f"{leg}_upstream_error",
            )
        self.metrics.upstream_errors.labels(leg, "http_4xx").inc()
        raise UpstreamReply(resp.status, raw, resp.headers.get("Content-Type", "application/json"))

    # ----------------------------------------------------------------- legs

    async def _unary_leg(
        self, pool: BackendPool, leg: str, path: str, body: bytes, headers: dict[str, str], total_s: float
    ) -> tuple[Backend, aiohttp.ClientResponse, bytes]:
        """One non-streamed upstream call: pick a backend, check the status, read the whole body, time it."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=self.config.connect_timeout_s)
        backend, resp = await self._open(pool, path, body, headers, timeout, None)
        try:
            await self._check_status(backend, resp)
            raw = await resp.read()
        except asyncio.TimeoutError:
            raise self._timeout_error(leg, backend, first_byte=False) from None
        except aiohttp.ClientError as exc:
            self.metrics.upstream_errors.labels(leg, "disconnect").inc()
            raise self._upstream_error(
                502,
                f"{leg} backend connection failed mid-answer",
                f"{backend.url}: {type(exc).__name__}: {exc}",
                type=UPSTREAM,
                code=f"{leg}_connection_error",
            ) from None
        finally:
            resp.release()
            pool.release(backend)
        self.metrics.child(self.metrics.leg_duration, leg, backend.url).observe(loop.time() - t0)
        return backend, resp, raw

    async def _prefill(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[Backend, dict[str, Any]]:
        backend, resp, raw = await self._unary_leg(
            self.prefill, "prefill", path, body, headers, self.config.prefill_timeout_s
        )
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            self.metrics.upstream_errors.labels("prefill", "invalid_json").inc()
            raise self._upstream_error(
                502,
                f"prefill backend answered HTTP {resp.status} with a non-JSON body",
                f"{backend.url}: {_snippet(raw)}",
                type=UPSTREAM,
                code="prefill_invalid_response",
            ) from None
        try:
            return backend, kv_transfer_params_from_prefill(parsed)
        except ProxyError as exc:
            self.metrics.upstream_errors.labels("prefill", "invalid_kv").inc()
            exc.detail = f"prefill backend {backend.url}"
            raise

    async def _decode_unary(self, path: str, body: bytes, headers: dict[str, str], ids: dict[str, str]) -> web.Response:
        backend, resp, raw = await self._unary_leg(
            self.decode, "decode", path, body, headers, self.config.decode_timeout_s
        )
        try:
            ok = isinstance(json.loads(raw), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            self.metrics.upstream_errors.labels("decode", "invalid_json").inc()
            raise self._upstream_error(
                502,
                f"decode backend answered HTTP {resp.status} with a body that is not a JSON object",
                f"{backend.url}: {_snippet(raw)}",
                type=UPSTREAM,
                code="decode_invalid_response",
            )
        return web.Response(status=resp.status, body=raw, headers={"Content-Type": "application/json", **ids})

    async def _decode_stream(
        self, request: web.Request, path: str, body: bytes, headers: dict[str, str], ids: dict[str, str],
        handover: tuple[float, Backend] | None = None,
    ) -> web.StreamResponse:
        cfg = self.config
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + cfg.decode_first_byte_timeout_s
        timeout = aiohttp.ClientTimeout(
            total=cfg.decode_timeout_s, sock_connect=cfg.connect_timeout_s, sock_read=cfg.decode_idle_timeout_s
        )
        backend, resp = await self._open(self.decode, path, body, headers, timeout, deadline)
        clean = False
        request_id = ids["X-HybridPD-Pairing-Id"]
        self._streams.add(resp)
        try:
            try:
                await self._check_status(backend, resp)
                if resp.content_type != "text/event-stream":
                    self.metrics.upstream_errors.labels("decode", "protocol").inc()
                    raise self._upstream_error(
                        502,
                        f"decode backend answered a streaming request with Content-Type {resp.content_type!r}, "
                        f"not text/event-stream",
                        backend.url,
                        type=UPSTREAM,
                        code="decode_invalid_response",
                    )
                first = await _until(resp.content.readany(), deadline)
            except asyncio.TimeoutError:
                raise self._timeout_error("decode", backend, first_byte=True) from None
            except aiohttp.ClientError as exc:
                self.metrics.upstream_errors.labels("decode", "disconnect").inc()
                raise self._upstream_error(
                    502,
                    "decode backend failed before its first byte",
                    f"{backend.url}: {type(exc).__name__}: {exc}",
                    type=UPSTREAM,
                    code="decode_connection_error",
                ) from None
            now = loop.time()
            self.metrics.child(self.metrics.leg_duration, "decode_first_byte", backend.url).observe(now - t0)
            if handover is not None:
                self._note_handover(handover, now, ids)

            out = web.StreamResponse(
                status=resp.status,
                headers={
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    **ids,
                },
            )
            await out.prepare(request)
            framer = SSEFramer(cfg.max_sse_event_bytes)
            error: str | None = None
            detail = ""
            kind = ""
            chunk = first
            while chunk:
                try:
                    data = framer.feed(chunk)
                except SSEError as exc:
                    kind, error, detail = "protocol", "decode backend broke the SSE protocol", f"{backend.url}: {exc}"
                    break
                if data:
                    try:
                        await out.write(data)
                    except ConnectionResetError:  # the client went away: abort D (finally) and stop
                        log.info("client disconnected from stream %s", request_id)
                        return out
                try:
                    chunk = await resp.content.readany()
                except asyncio.TimeoutError:
                    kind = "timeout"
                    error = (
                        f"decode backend stalled: no data for decode_idle_timeout_s="
                        f"{cfg.decode_idle_timeout_s} or decode_timeout_s={cfg.decode_timeout_s} reached"
                    )
                    detail = backend.url
                    break
                except aiohttp.ClientError as exc:
                    kind = "disconnect"
                    error = "decode backend connection lost mid-stream"
                    detail = f"{backend.url}: {type(exc).__name__}: {exc}"
                    break
            else:
                if not framer.saw_done:
                    kind = "truncated"
                    error = "decode backend ended the stream without 'data: [DONE]'"
                    detail = backend.url
                else:
                    clean = True
            if self.shutting_down and not clean:  # interrupt_streams() closed D under us
                kind, error, detail = "shutdown", "the proxy is shutting down; the stream was ended", backend.url
            if error is not None:
                self.metrics.upstream_errors.labels("decode", kind).inc()
                log.warning("stream %s%s interrupted: %s (%s)", request_id, _client_note(ids), error, detail)
                public = f"{error} ({detail})" if cfg.expose_backend_errors else error
                with contextlib.suppress(ConnectionResetError):
                    await out.write(sse_error_event(public))
            with contextlib.suppress(ConnectionResetError):
                await out.write_eof()
            return out
        finally:
            self._streams.discard(resp)
            if clean:
                resp.release()
            else:
                resp.close()  # drops the D connection: vLLM aborts the request
            self.decode.release(backend)
            self.metrics.child(self.metrics.leg_duration, "decode", backend.url).observe(loop.time() - t0)

    def interrupt_streams(self) -> int:
        """End every stream being relayed: D's connection is closed, and each stream's handler sends its client
        one SSE error event ("the proxy is shutting down") and ends. Returns how many were open."""
        self.shutting_down = True
        streams = list(self._streams)
        for resp in streams:
            resp.close()
        return len(streams)

    def _note_handover(self, handover: tuple[float, Backend], now: float, ids: dict[str, str]) -> None:
        p_done, p_backend = handover
        seconds = now - p_done
        self.metrics.child(self.metrics.kv_handover, p_backend.url).observe(seconds)
        client = ids["X-Request-Id"]
        pairing = ids["X-HybridPD-Pairing-Id"]
        self.leases.note(Handover(pairing, client if client != pairing else None, p_backend.url, seconds))

    # ----------------------------------------------------------------- handlers

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT_COMPLETIONS)

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        pairing_id = str(uuid.uuid4())
        ids = _id_headers(pairing_id, _client_request_id(request))
        try:
            body = validate_client_request(await self._read_json(request), route)
            p_body = _encode(prefill_request(body))  # also catches what cannot be encoded before any backend call
            if self.decode.healthy_count == 0:  # fail before P does work (and holds KV blocks) for nobody
                raise ProxyError(
                    503, "no healthy decode backend available", type=UNAVAILABLE, code="no_healthy_decode_backend"
                )
            headers = self._upstream_headers(request, pairing_id)
            p_backend, kv = await self._prefill(route, p_body, headers)
            p_done = asyncio.get_running_loop().time()
            d_body = _encode(decode_request(body, kv, fields_to_restore(body)))
            if is_streaming(body):
                return await self._decode_stream(request, route, d_body, headers, ids, (p_done, p_backend))
            response = await self._decode_unary(route, d_body, headers, ids)
            self._note_handover((p_done, p_backend), asyncio.get_running_loop().time(), ids)
            return response
        except ProxyError as exc:
            for name, value in ids.items():
                exc.headers.setdefault(name, value)
            log.log(logging.WARNING if exc.status >= 500 else logging.INFO,
                    "request %s%s failed: %s %s%s", pairing_id, _client_note(ids), exc.status, exc.message,
                    f" [{exc.detail}]" if exc.detail and not self.config.expose_backend_errors else "")
            raise
        except UpstreamReply as exc:
            return web.Response(status=exc.status, body=exc.body, headers={"Content-Type": exc.content_type, **ids})

    async def handle_tokenizer(self, request: web.Request) -> web.Response:
        """``/tokenize`` and ``/detokenize`` (vLLM's routes; ``vllm bench serve`` uses them): the body is passed
        to the first healthy D that answers, else P (both serve the same tokenizer)."""
        return await self._first_answer("POST", request.path, _encode(await self._read_json(request)))

    async def handle_models(self, request: web.Request) -> web.Response:
        """``/v1/models`` from the first healthy D backend that answers, else from P."""
        return await self._first_answer("GET", "/v1/models", None)

    async def _first_answer(self, method: str, path: str, data: bytes | None) -> web.Response:
        timeout = aiohttp.ClientTimeout(total=_MODELS_TIMEOUT_S, sock_connect=self.config.connect_timeout_s)
        headers = {**self._auth_headers(), **({"Content-Type": "application/json"} if data is not None else {})}
        errors: list[str] = []
        for pool in (self.decode, self.prefill):
            for backend in pool.healthy():
                try:
                    async with self.session.request(method, backend.url + path, data=data, headers=headers,
                                                    timeout=timeout) as resp:
                        raw = await resp.read()
                except _CONNECT_ERRORS as exc:
                    self._eject(pool, backend, f"connect failed: {exc}")
                    errors.append(f"{backend.url}: {exc}")
                    continue
                except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                    errors.append(f"{backend.url}: {type(exc).__name__}: {exc}")
                    continue
                if resp.status >= 500 or resp.status in (401, 403):
                    errors.append(f"{backend.url}: HTTP {resp.status}: {_snippet(raw)}")
                    continue
                return web.Response(status=resp.status, body=raw,
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        if errors:
            log.warning("%s %s failed on every backend: %s", method, path, "; ".join(errors))
            raise self._upstream_error(502, f"no backend answered {path}", "; ".join(errors), type=UPSTREAM,
                                       code="models_unavailable" if path == "/v1/models" else "tokenizer_unavailable")
        raise ProxyError(503, "no healthy backend available", type=UNAVAILABLE, code="no_healthy_backend")

    async def handle_health(self, request: web.Request) -> web.Response:
        """200 when at least one P and one D are in rotation, else 503. Counts only (no backend URLs).

        If the last probe round is older than ``health_max_age_s``, this request runs one first (shared with
        concurrent callers), so a backend that died is reported within one /health call, not one interval."""
        if asyncio.get_running_loop().time() - self._last_probe > self.config.health_max_age_s:
            await self.probe_health()
        p, d = self.prefill.healthy_count, self.decode.healthy_count
        ok = p > 0 and d > 0
        payload = {
            "status": "ok" if ok else "unavailable",
            "prefill": {"healthy": p, "total": len(self.prefill.backends)},
            "decode": {"healthy": d, "total": len(self.decode.backends)},
        }
        return _json_response(200 if ok else 503, payload)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text; behind ``metrics_api_key`` if set, else behind ``api_key`` if set (it names backends)."""
        self.check_auth(request, self.config.metrics_api_key)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


STATE: Final = web.AppKey("hybridpd_proxy_state", ProxyState)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
            state.check_auth(request)
        response = await handler(request)
        status = response.status
        return response
    except ProxyError as exc:
        status = exc.status
        return _error_response(exc)
    except web.HTTPException as exc:
        status = exc.status
        if status < 400:
            raise
        kind, code = (NOT_FOUND, "not_found") if status == 404 else (INVALID_REQUEST, f"http_{status}")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow",)}
        return _json_response(status, error_body(f"{exc.reason}: {request.method} {request.path}", type=kind, code=code),
                              headers=headers or None)
    except asyncio.CancelledError:
        status = 499
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json_response(500, error_body("internal proxy error", type=INTERNAL, code="internal_error"))
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
    state = ProxyState(config)
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[_middleware])
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post(COMPLETIONS, state.handle_completions)
    app.router.add_post(CHAT_COMPLETIONS, state.handle_chat_completions)
    app.router.add_get("/v1/models", state.handle_models)
    app.router.add_post("/tokenize", state.handle_tokenizer)
    app.router.add_post("/detokenize", state.handle_tokenizer)
    app.router.add_get("/health", state.handle_health)
    app.router.add_get("/metrics", state.handle_metrics)
    return app


def proxy_state(app: web.Application) -> ProxyState:
    """The state behind an app built by ``build_app`` (pools, metrics), for tests and embedding."""
    return app[STATE]
