"""The upstream legs of one P/D request: prefill on P (JSON, ``kv_transfer_params`` out), then decode on D,
either unary (D's JSON relayed) or streamed (D's SSE relayed event by event, errors as a final error event).

The request bodies are built by ``protocol``; the calls go through ``upstream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.errors import UPSTREAM, ProxyError, sse_error_event
from hybridpd.launch.proxy.kvwatch import Handover, LeaseWatch
from hybridpd.launch.proxy.metrics import ProxyMetrics
from hybridpd.launch.proxy.pool import Backend, BackendPool
from hybridpd.launch.proxy.protocol import SSEError, SSEFramer, kv_transfer_params_from_prefill
from hybridpd.launch.proxy.upstream import Upstream, snippet, until

log = logging.getLogger("hybridpd.launch.proxy")

#: P's answer: (loop time it was read, the P backend), for the KV-handover histogram.
PrefillDone = tuple[float, Backend]


def client_note(ids: dict[str, str]) -> str:
    """`` (client id X)`` for log lines when the client sent its own ``X-Request-Id``, else empty."""
    client = ids["X-Request-Id"]
    return "" if client == ids["X-HybridPD-Pairing-Id"] else f" (client id {client})"


class RequestLegs:
    """Prefill and decode legs on the pools of one proxy; tracks the D streams being relayed (for shutdown)."""

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool, leases: LeaseWatch) -> None:
        self.upstream = upstream
        self.config: ProxyConfig = upstream.config
        self.metrics: ProxyMetrics = upstream.metrics
        self.prefill_pool, self.decode_pool = prefill, decode
        self.leases = leases
        self._streams: set[aiohttp.ClientResponse] = set()
        self.shutting_down = False

    async def prefill(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[Backend, dict[str, Any]]:
        """P's answer to the rewritten request -> (the P backend, its ``kv_transfer_params``)."""
        up = self.upstream
        backend, resp, raw = await up.unary(self.prefill_pool, path, body, headers, self.config.prefill_timeout_s)
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            self.metrics.upstream_errors.labels("prefill", "invalid_json").inc()
            raise up.error(502, f"prefill backend answered HTTP {resp.status} with a non-JSON body",
                           f"{backend.url}: {snippet(raw)}", type=UPSTREAM, code="prefill_invalid_response") from None
        try:
            return backend, kv_transfer_params_from_prefill(parsed)
        except ProxyError as exc:
            self.metrics.upstream_errors.labels("prefill", "invalid_kv").inc()
            exc.detail = f"prefill backend {backend.url}"
            raise

    async def decode_unary(self, path: str, body: bytes, headers: dict[str, str], ids: dict[str, str]) -> web.Response:
        up = self.upstream
        backend, resp, raw = await up.unary(self.decode_pool, path, body, headers, self.config.decode_timeout_s)
        try:
            ok = isinstance(json.loads(raw), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            self.metrics.upstream_errors.labels("decode", "invalid_json").inc()
            raise up.error(502, f"decode backend answered HTTP {resp.status} with a body that is not a JSON object",
                           f"{backend.url}: {snippet(raw)}", type=UPSTREAM, code="decode_invalid_response")
        return web.Response(status=resp.status, body=raw, headers={"Content-Type": "application/json", **ids})

    async def decode_stream(
        self, request: web.Request, path: str, body: bytes, headers: dict[str, str], ids: dict[str, str],
        handover: PrefillDone | None = None,
    ) -> web.StreamResponse:
        cfg = self.config
        up = self.upstream
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + cfg.decode_first_byte_timeout_s
        timeout = aiohttp.ClientTimeout(
            total=cfg.decode_timeout_s, sock_connect=cfg.connect_timeout_s, sock_read=cfg.decode_idle_timeout_s
        )
        backend, resp = await up.open(self.decode_pool, path, body, headers, timeout, deadline)
        clean = False
        request_id = ids["X-HybridPD-Pairing-Id"]
        self._streams.add(resp)
        try:
            try:
                await up.check_status(backend, resp)
                if resp.content_type != "text/event-stream":
                    self.metrics.upstream_errors.labels("decode", "protocol").inc()
                    raise up.error(
                        502,
                        f"decode backend answered a streaming request with Content-Type {resp.content_type!r}, "
                        f"not text/event-stream",
                        backend.url,
                        type=UPSTREAM,
                        code="decode_invalid_response",
                    )
                first = await until(resp.content.readany(), deadline)
            except asyncio.TimeoutError:
                raise up.timeout_error("decode", backend, first_byte=True) from None
            except aiohttp.ClientError as exc:
                raise up.disconnect_error("decode", backend, "failed before its first byte", exc) from None
            now = loop.time()
            self.metrics.child(self.metrics.leg_duration, "decode_first_byte", backend.url).observe(now - t0)
            if handover is not None:
                self.note_handover(handover, now, ids)

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
                log.warning("stream %s%s interrupted: %s (%s)", request_id, client_note(ids), error, detail)
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
            self.decode_pool.release(backend)
            self.metrics.child(self.metrics.leg_duration, "decode", backend.url).observe(loop.time() - t0)

    def interrupt_streams(self) -> int:
        """End every stream being relayed: D's connection is closed, and each stream's handler sends its client
        one SSE error event ("the proxy is shutting down") and ends. Returns how many were open."""
        self.shutting_down = True
        streams = list(self._streams)
        for resp in streams:
            resp.close()
        return len(streams)

    def note_handover(self, handover: PrefillDone, now: float, ids: dict[str, str]) -> None:
        """P's answer -> D's first byte (or D's whole answer): the KV-handover histogram and the lease watch."""
        p_done, p_backend = handover
        seconds = now - p_done
        self.metrics.child(self.metrics.kv_handover, p_backend.url).observe(seconds)
        client = ids["X-Request-Id"]
        pairing = ids["X-HybridPD-Pairing-Id"]
        self.leases.note(Handover(pairing, client if client != pairing else None, p_backend.url, seconds))
