"""Client-connection limits for the proxy's aiohttp server: header and idle timeouts and a connection cap.

aiohttp's server has no request-header timeout (its keep-alive timer, 3630 s by default under ``AppRunner``, is
the only bound on a client that trickles a request line one byte a second) and no connection cap (past the
open-file limit every ``accept`` fails and asyncio logs "Too many open files" in a loop). ``ConnectionGuard``
wraps the server's protocol factory:

* every connection is tracked; once ``max_connections`` are open, a newcomer evicts the connection that has
  waited longest WITHOUT a request in progress (idle keep-alive, or headers still trickling in); only when
  every open connection is serving a request is the newcomer answered 503 and closed. A flood of idle or slow
  connections therefore cannot lock out real clients.
* a sweep every ``sweep_s`` closes connections whose request headers are not complete ``header_timeout_s``
  after their first byte, and connections that have had no request in progress and received nothing for
  ``idle_timeout_s``.

Body-read timeouts are the app's (``body_timeout_s`` around ``request.read()``): once headers are in, the
request is aiohttp's and the handler owns the deadline.

"Request in progress" and "headers complete" are read from aiohttp's ``RequestHandler`` (``_request_in_progress``
and ``_request_count``, present since aiohttp 3.9); ``GUARD_SUPPORTED`` is False if a future aiohttp drops them,
and then only the cap is enforced (tests/test_proxy_hostile.py fails loudly in that case).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from collections.abc import Callable
from typing import Any, Final, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("hybridpd.launch.proxy")

GUARD_SUPPORTED: Final = {"_request_in_progress", "_request_count"} <= set(
    getattr(RequestHandler, "__slots__", ())
)

_REFUSAL_BODY: Final = json.dumps(
    {"error": {"message": "too many connections to the proxy; retry later", "type": "service_unavailable_error",
               "code": "too_many_connections", "param": None}}
).encode()
_REFUSAL: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


def default_max_connections() -> int:
    """Half the open-file soft limit less a reserve (each client connection may hold one upstream socket)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 65536
    return max(16, (soft - 100) // 2)


class _Conn(asyncio.Protocol):
    """One client connection: an aiohttp ``RequestHandler`` plus the timestamps the guard needs."""

    __slots__ = ("guard", "inner", "transport", "opened", "idle_since", "pending_since")

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: RequestHandler | None = None
        self.transport: asyncio.Transport | None = None
        now = guard.loop.time()
        self.opened = now
        self.idle_since = now
        #: When the first byte of a request whose headers are not complete yet arrived (None: none pending).
        self.pending_since: float | None = None

    def busy(self) -> bool:
        inner = self.inner
        return inner is not None and bool(getattr(inner, "_request_in_progress", False))

    def waited_since(self) -> float:
        return self.pending_since if self.pending_since is not None else self.idle_since

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        if not self.guard.admit(self):
            with contextlib.suppress(Exception):
                self.transport.write(_REFUSAL)
            self.transport.close()
            return
        self.inner = self.guard.server()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        inner = self.inner
        if inner is None:
            return
        before = getattr(inner, "_request_count", 0)
        inner.data_received(data)
        if getattr(inner, "_request_count", 0) != before:
            self.pending_since = None  # a request's headers are complete
        elif self.pending_since is None and not self.busy():
            self.pending_since = self.guard.loop.time()

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            self.inner.eof_received()
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def close(self, reason: str) -> None:
        self.guard.closed[reason] = self.guard.closed.get(reason, 0) + 1
        if self.transport is not None:
            self.transport.abort() if reason == "header_timeout" else self.transport.close()


class ConnectionGuard:
    """Protocol factory for ``loop.create_server`` around an aiohttp ``web.Server`` (see the module docstring)."""

    def __init__(
        self,
        server: web.Server,
        *,
        max_connections: int,
        header_timeout_s: float,
        idle_timeout_s: float,
        on_close: Callable[[str], None] | None = None,
    ) -> None:
        self.server = server
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.sweep_s = max(0.05, min(1.0, header_timeout_s / 4, idle_timeout_s / 4))
        self.loop = asyncio.get_running_loop()
        self.conns: set[_Conn] = set()
        #: Connections closed by the guard, per reason (evicted, refused, header_timeout, idle_timeout).
        self.closed: dict[str, int] = {}
        self._on_close = on_close
        self._sweeper: asyncio.Task[None] | None = None

    def __call__(self) -> _Conn:
        return _Conn(self)

    def start(self) -> None:
        if self._sweeper is None and GUARD_SUPPORTED:
            self._sweeper = asyncio.create_task(self._sweep_loop(), name="hybridpd-proxy-guard")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    def _count(self, reason: str) -> None:
        if self._on_close is not None:
            self._on_close(reason)

    def admit(self, conn: _Conn) -> bool:
        if len(self.conns) >= self.max_connections:
            idle = [c for c in self.conns if not c.busy()] if GUARD_SUPPORTED else []
            if not idle:
                self.closed["refused"] = self.closed.get("refused", 0) + 1
                self._count("refused")
                return False
            victim = min(idle, key=_Conn.waited_since)
            self.conns.discard(victim)
            victim.close("evicted")
            self._count("evicted")
        self.conns.add(conn)
        return True

    def forget(self, conn: _Conn) -> None:
        self.conns.discard(conn)

    def sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.conns):
            if conn.busy():
                conn.idle_since = now
                conn.pending_since = None
                continue
            if conn.pending_since is not None:
                if now - conn.pending_since > self.header_timeout_s:
                    self.conns.discard(conn)
                    conn.close("header_timeout")
                    self._count("header_timeout")
            elif now - conn.idle_since > self.idle_timeout_s:
                self.conns.discard(conn)
                conn.close("idle_timeout")
                self._count("idle_timeout")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                self.sweep()
            except Exception:  # never let the sweeper die
                log.exception("connection sweep failed")


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through a ``ConnectionGuard`` (``guard`` once started)."""

    __slots__ = ("_guard_kw", "guard")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, backlog: int = 1024,
                 **guard_kw: Any) -> None:
        super().__init__(runner, host, port, backlog=backlog, reuse_address=True)
        self._guard_kw = guard_kw
        self.guard: ConnectionGuard | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        server = self._runner.server
        assert isinstance(server, web.Server)
        self.guard = ConnectionGuard(server, **self._guard_kw)
        self.guard.start()
        self._server = await asyncio.get_running_loop().create_server(
            self.guard, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        if self.guard is not None:
            await self.guard.stop()
        await super().stop()
