"""Serving a proxy app: the runner and the guarded listening site, the draining stop, the event loop.

``serve_proxy`` is what ``hybridpd proxy`` runs; ``make_runner`` / ``make_site`` are the same set-up for
tests and embedders (the client-connection guard of ``hybridpd.launch.proxy.guard`` in front of ``build_app``'s app).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from hybridpd.launch.proxy.app import build_app
from hybridpd.launch.proxy.config import ProxyConfig, ProxyConfigError
from hybridpd.launch.proxy.guard import GuardedSite, default_max_connections
from hybridpd.launch.proxy.state import STATE, ProxyState

log = logging.getLogger("hybridpd.launch.proxy")


def make_runner(app: web.Application) -> web.AppRunner:
    """The ``AppRunner`` for a proxy app: handlers cancelled when their client leaves, aiohttp's keep-alive
    timer a backstop just past ``idle_timeout_s`` (the guard's sweep closes idle connections first)."""
    config = app[STATE].config
    return web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("hybridpd.launch.proxy.access") if config.access_log else None,
        shutdown_timeout=1.0,  # serve_proxy's drain() has given in-flight requests shutdown_grace_s already
        keepalive_timeout=config.idle_timeout_s + 1.0,
        lingering_time=2.0,  # after an early answer (408, 413), read and drop the rest of a body this long
    )


def make_site(runner: web.AppRunner) -> GuardedSite:
    """A listening site for ``runner`` (set up) with the client-connection guard of ``hybridpd.launch.proxy.guard``."""
    state: ProxyState = runner.app[STATE]
    config = state.config
    closed = state.metrics.connections_closed
    return GuardedSite(
        runner,
        config.host,
        config.port,
        max_connections=config.max_connections or default_max_connections(),
        header_timeout_s=config.header_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        on_close=lambda reason: closed.labels(reason).inc(),
    )


async def serve_proxy(
    config: ProxyConfig,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``stop`` is set or SIGINT/SIGTERM arrives, then shut down gracefully.

    In-flight requests get ``shutdown_grace_s`` to finish (``drain``); streams still open then get an SSE error
    event and end; what is left is cancelled, the health task stopped and the upstream session closed.
    ``on_started`` receives the listening URL (useful with ``port=0``).
    """
    stop = stop if stop is not None else asyncio.Event()
    app = build_app(config)
    runner = make_runner(app)
    await runner.setup()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    try:
        await make_site(runner).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signal support
                pass
        host, port = runner.addresses[0][:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info(
            "hybridpd proxy listening on %s (prefill: %s; decode: %s; policy %s; event loop %s)",
            url,
            ", ".join(config.prefill_urls),
            ", ".join(config.decode_urls),
            config.policy,
            type(loop).__module__.split(".")[0],
        )
        if on_started is not None:
            on_started(url)
        await stop.wait()
        await drain(runner)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


async def drain(runner: web.AppRunner) -> None:
    """Graceful stop: close the listening sockets, let requests in flight finish for ``shutdown_grace_s``, then
    end the streams still open with an SSE error event (and give their handlers a moment to send it). Requests
    still running after that are cancelled by ``runner.cleanup()``."""
    state: ProxyState = runner.app[STATE]
    loop = asyncio.get_running_loop()
    log.info("hybridpd proxy shutting down: %d request(s) in flight", state.in_flight)
    for site in list(runner.sites):
        await site.stop()
    deadline = loop.time() + state.config.shutdown_grace_s
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        ended = state.interrupt_streams()
        log.warning("shutdown grace (%g s) over: ending %d stream(s) with an error event; %d request(s) left",
                    state.config.shutdown_grace_s, ended, state.in_flight)
        settle = loop.time() + 1.0
        while state.in_flight and loop.time() < settle:
            await asyncio.sleep(0.02)


def event_loop_runner(choice: str) -> tuple[str, Callable[[Any], Any]]:
    """(name, run function) for ``ProxyConfig.event_loop``: uvloop when asked for or, with "auto", when it is
    importable (bench/bench_proxy.py measures the difference); else asyncio's own loop."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ProxyConfigError("uvloop is not installed", field="event_loop",
                                       fix="pip install uvloop, or use --event-loop asyncio") from None
        else:
            return "uvloop", uvloop.run
    return "asyncio", asyncio.run


def run_proxy(config: ProxyConfig) -> None:
    """Run the proxy in a new event loop until SIGINT/SIGTERM; returns after a clean shutdown."""
    name, runner = event_loop_runner(config.event_loop)
    log.debug("event loop: %s", name)
    runner(serve_proxy(config))
