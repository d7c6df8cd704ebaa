"""Test harness for the P/D proxy: fake P/D servers (``hybridpd.launch.proxy.fakes``) + a proxy, on 127.0.0.1 ephemeral
ports, in one event loop. Tests are plain functions that call ``run(coro)``: no pytest asyncio plugin needed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from multidict import CIMultiDict

from hybridpd.launch.proxy import ProxyConfig, ProxyState, build_app, proxy_state
from hybridpd.launch.proxy.fakes import FakeDecode, FakePrefill, KVLedger, RunningServer, start_server
from hybridpd.launch.proxy.server import make_runner, make_site

T = TypeVar("T")

#: Upper bound for one test's event loop; a hang fails the test instead of the whole run.
TEST_TIMEOUT_S = 90.0


def run(coro: Coroutine[Any, Any, T], timeout: float = TEST_TIMEOUT_S) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, step: float = 0.02) -> None:
    """Wait until ``predicate()`` holds (a condition, not a timing assertion: ``timeout`` only bounds a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s: {predicate}")
        await asyncio.sleep(step)


def parse_sse(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        lines = [ln[len("data:"):].strip() for ln in block.split("\n") if ln.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events


def stream_text(events: list[str], chat: bool = False) -> str:
    out = []
    for ev in events:
        if ev == "[DONE]":
            continue
        obj = json.loads(ev)
        for choice in obj.get("choices", []):
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(out)


@dataclass
class Harness:
    ledger: KVLedger
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    url: str
    state: ProxyState
    client: aiohttp.ClientSession
    servers: list[RunningServer] = field(default_factory=list)
    p_servers: list[RunningServer] = field(default_factory=list)
    d_servers: list[RunningServer] = field(default_factory=list)

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, CIMultiDict[str], bytes]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, CIMultiDict(r.headers), await r.read()

    async def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        async with self.client.get(self.url + path, **kw) as r:
            return r.status, await r.read()

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    @property
    def p(self) -> FakePrefill:
        return self.prefills[0]

    @property
    def d(self) -> FakeDecode:
        return self.decodes[0]


@asynccontextmanager
async def harness(
    n_prefill: int = 1,
    n_decode: int = 1,
    *,
    extra_prefill_urls: tuple[str, ...] = (),
    extra_decode_urls: tuple[str, ...] = (),
    prefill_kw: dict[str, Any] | None = None,
    decode_kw: dict[str, Any] | None = None,
    proxy_handler_cancellation: bool = True,
    guarded: bool = True,
    **config_kw: Any,
) -> AsyncIterator[Harness]:
    """Fakes + proxy. ``extra_*_urls`` come FIRST in the proxy's lists (e.g. a URL nobody listens on).

    Health probes run once at proxy start-up, then every 600 s (i.e. not during a test) unless
    ``health_interval_s`` is given. ``guarded`` (default) serves the proxy as ``serve_proxy`` does, behind
    ``make_site``'s connection guard; ``guarded=False`` uses a plain site (``proxy_handler_cancellation`` applies).
    """
    ledger = KVLedger()
    prefills = [FakePrefill(ledger, **(prefill_kw or {})) for _ in range(n_prefill)]
    decodes = [FakeDecode(ledger, **(decode_kw or {})) for _ in range(n_decode)]
    servers = [await start_server(f.make_app()) for f in (*prefills, *decodes)]
    config_kw.setdefault("health_interval_s", 600.0)
    config_kw.setdefault("port", 0)
    config = ProxyConfig(
        prefill_urls=(*extra_prefill_urls, *(s.url for s in servers[:n_prefill])),
        decode_urls=(*extra_decode_urls, *(s.url for s in servers[n_prefill:])),
        **config_kw,
    )
    app = build_app(config)
    if guarded:  # as ``serve_proxy`` serves it: the client-connection guard in front
        runner = make_runner(app)
        await runner.setup()
        site = make_site(runner)
        await site.start()
        host, port = runner.addresses[0][:2]
        proxy = RunningServer(runner, f"http://{host}:{port}")
    else:
        proxy = await start_server(app, handler_cancellation=proxy_handler_cancellation)
    servers.append(proxy)
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        yield Harness(ledger, prefills, decodes, proxy.url, proxy_state(app), client, servers,
                      servers[:n_prefill], servers[n_prefill:n_prefill + n_decode])
    finally:
        await client.close()
        for f in decodes:
            f.release.set()
        for s in reversed(servers):
            await s.close()
