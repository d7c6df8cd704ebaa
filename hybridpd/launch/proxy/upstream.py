"""The proxy's HTTP client towards its backends: one pooled session, backend auth, the choice of a backend with
a move to the next one on a refused connection, and the mapping of backend failures to ``ProxyError``.

Nothing here knows the P/D protocol (see ``legs`` for the prefill and decode legs built on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Mapping, Sequence
from typing import Final, TypeVar

import aiohttp
from aiohttp import web

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.errors import UNAVAILABLE, UPSTREAM, UPSTREAM_TIMEOUT, ProxyError, UpstreamReply
from hybridpd.launch.proxy.metrics import ProxyMetrics
from hybridpd.launch.proxy.pool import Backend, BackendPool

log = logging.getLogger("hybridpd.launch.proxy")
T = TypeVar("T")

_FORWARDED_HEADERS: Final = ("traceparent", "tracestate")
_FIRST_ANSWER_TIMEOUT_S: Final = 30.0
CONNECT_ERRORS: Final[tuple[type[BaseException], ...]] = (aiohttp.ClientConnectorError,) + (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)


def snippet(raw: bytes, limit: int = 300) -> str:
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


if sys.version_info >= (3, 11):

    async def until(aw: Awaitable[T], deadline: float) -> T:
        """``await aw`` until loop time ``deadline``, else ``TimeoutError`` (no extra task, unlike wait_for)."""
        async with asyncio.timeout_at(deadline):
            return await aw

else:  # pragma: no cover

    async def until(aw: Awaitable[T], deadline: float) -> T:
        return await asyncio.wait_for(aw, max(deadline - asyncio.get_running_loop().time(), 0.001))


class Upstream:
    """The session to the backends (created by ``start``, closed by ``close``) and the calls made through it."""

    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None

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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def auth_headers(self) -> dict[str, str]:
        key = self.config.backend_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def request_headers(self, client_headers: Mapping[str, str], request_id: str) -> dict[str, str]:
        """Headers of a generation request to P or D: JSON, the pairing id, backend auth, the client's trace
        context (never its ``Authorization``)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **self.auth_headers()}
        for name in _FORWARDED_HEADERS:
            value = client_headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def error(self, status: int, public: str, detail: str, *, type: str, code: str) -> ProxyError:
        """A ProxyError whose client message is ``public``; ``detail`` (backend URL, backend text) is logged by
        the handler and appended to the client message only with ``expose_backend_errors``."""
        message = f"{public} ({detail})" if self.config.expose_backend_errors else public
        return ProxyError(status, message, type=type, code=code, detail=detail)

    def eject(self, pool: BackendPool, backend: Backend, reason: str) -> None:
        """Take a backend whose connection was refused out of rotation (counted once per ejection)."""
        if pool.eject(backend, reason):
            self.metrics.ejections.labels(pool.role, backend.url, "connect").inc()

    def timeout_error(self, leg: str, backend: Backend, *, first_byte: bool) -> ProxyError:
        cfg = self.config
        self.metrics.upstream_errors.labels(leg, "timeout").inc()
        if leg == "prefill":
            what = f"did not answer within prefill_timeout_s={cfg.prefill_timeout_s}"
        elif first_byte:
            what = f"sent no data within decode_first_byte_timeout_s={cfg.decode_first_byte_timeout_s}"
        else:
            what = f"did not finish within decode_timeout_s={cfg.decode_timeout_s}"
        return self.error(504, f"{leg} backend {what}", backend.url, type=UPSTREAM_TIMEOUT, code=f"{leg}_timeout")

    def disconnect_error(self, leg: str, backend: Backend, when: str, exc: BaseException) -> ProxyError:
        """502 for a backend connection that failed ``when`` ("before answering", "mid-answer", ...)."""
        self.metrics.upstream_errors.labels(leg, "disconnect").inc()
        return self.error(502, f"{leg} backend {when}", f"{backend.url}: {type(exc).__name__}: {exc}",
                          type=UPSTREAM, code=f"{leg}_connection_error")

    async def open(
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
                raise self.error(502, f"could not connect to any {leg} backend ({len(tried)} tried)",
                                 f"last: {last}", type=UPSTREAM, code=f"{leg}_unreachable")
            pool.acquire(backend)
            try:
                ctx = self.session.post(backend.url + path, data=data, headers=headers, timeout=timeout)
                if deadline is None:
                    resp = await ctx
                else:
                    resp = await until(ctx, deadline)
            except CONNECT_ERRORS as exc:
                pool.release(backend)
                last = f"{backend.url}: {exc}"
                self.metrics.upstream_errors.labels(leg, "connect").inc()
                self.eject(pool, backend, f"connect failed: {exc}")
                tried.append(backend)
                continue
            except asyncio.TimeoutError:
                pool.release(backend)
                raise self.timeout_error(leg, backend, first_byte=deadline is not None) from None
            except aiohttp.ClientError as exc:
                pool.release(backend)
                raise self.disconnect_error(leg, backend, "failed before answering", exc) from None
            except BaseException:
                pool.release(backend)
                raise
            return backend, resp

    async def check_status(self, backend: Backend, resp: aiohttp.ClientResponse) -> None:
        """Turn a backend's error status into the proxy's answer (5xx/401/403 -> 502, other 4xx passed through)."""
        if resp.status < 400:
            return
        leg = backend.role
        raw = await resp.read()
        if resp.status >= 500 or resp.status in (401, 403, 407):
            kind = "http_5xx" if resp.status >= 500 else "http_auth"
            self.metrics.upstream_errors.labels(leg, kind).inc()
            raise self.error(502, f"{leg} backend returned HTTP {resp.status}", f"{backend.url}: {snippet(raw)}",
                             type=UPSTREAM, code=f"{leg}_upstream_error")
        self.metrics.upstream_errors.labels(leg, "http_4xx").inc()
        raise UpstreamReply(resp.status, raw, resp.headers.get("Content-Type", "application/json"))

    async def unary(
        self, pool: BackendPool, path: str, body: bytes, headers: dict[str, str], total_s: float
    ) -> tuple[Backend, aiohttp.ClientResponse, bytes]:
        """One non-streamed call: pick a backend, check the status, read the whole body, time it as the leg
        named by the pool's role."""
        leg = pool.role
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=self.config.connect_timeout_s)
        backend, resp = await self.open(pool, path, body, headers, timeout, None)
        try:
            await self.check_status(backend, resp)
            raw = await resp.read()
        except asyncio.TimeoutError:
            raise self.timeout_error(leg, backend, first_byte=False) from None
        except aiohttp.ClientError as exc:
            raise self.disconnect_error(leg, backend, "connection failed mid-answer", exc) from None
        finally:
            resp.release()
            pool.release(backend)
        self.metrics.child(self.metrics.leg_duration, leg, backend.url).observe(loop.time() - t0)
        return backend, resp, raw

    async def first_answer(
        self, pools: Sequence[BackendPool], method: str, path: str, data: bytes | None
    ) -> web.Response:
        """``method path`` on each healthy backend of ``pools`` in turn; the first answer that is not a 5xx or an
        auth refusal is relayed (the routes every backend serves alike: models, tokenizer)."""
        timeout = aiohttp.ClientTimeout(total=_FIRST_ANSWER_TIMEOUT_S, sock_connect=self.config.connect_timeout_s)
        headers = {**self.auth_headers(), **({"Content-Type": "application/json"} if data is not None else {})}
        errors: list[str] = []
        for pool in pools:
            for backend in pool.healthy():
                try:
                    async with self.session.request(method, backend.url + path, data=data, headers=headers,
                                                    timeout=timeout) as resp:
                        raw = await resp.read()
                except CONNECT_ERRORS as exc:
                    self.eject(pool, backend, f"connect failed: {exc}")
                    errors.append(f"{backend.url}: {exc}")
                    continue
                except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                    errors.append(f"{backend.url}: {type(exc).__name__}: {exc}")
                    continue
                if resp.status >= 500 or resp.status in (401, 403):
                    errors.append(f"{backend.url}: HTTP {resp.status}: {snippet(raw)}")
                    continue
                return web.Response(status=resp.status, body=raw,
                                    headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
        if errors:
            log.warning("%s %s failed on every backend: %s", method, path, "; ".join(errors))
            raise self.error(502, f"no backend answered {path}", "; ".join(errors), type=UPSTREAM,
                             code="models_unavailable" if path == "/v1/models" else "tokenizer_unavailable")
        raise ProxyError(503, "no healthy backend available", type=UNAVAILABLE, code="no_healthy_backend")
