"""``ProxyState``: what one proxy app owns, and its start and stop.

The parts: the P and D ``BackendPool``s, the metrics registry, the KV-lease watch, the upstream session
(``upstream``), the health task (``health``) and the request legs (``legs``). ``build_app`` (``app``) stores one
under ``STATE``; the handlers (``handlers``) find it there.
"""

from __future__ import annotations

from typing import Final

import aiohttp
from aiohttp import web

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.health import HealthProbes
from hybridpd.launch.proxy.kvwatch import LeaseWatch
from hybridpd.launch.proxy.legs import RequestLegs
from hybridpd.launch.proxy.metrics import ProxyMetrics
from hybridpd.launch.proxy.pool import BackendPool, Role
from hybridpd.launch.proxy.upstream import Upstream


class ProxyState:
    """Everything one proxy app owns: config, backend pools, metrics, the upstream HTTP session, the health task."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config

        def pool(role: Role, urls: tuple[str, ...]) -> BackendPool:
            return BackendPool(role, urls, config.policy, unhealthy_after=config.unhealthy_after,
                               healthy_after=config.healthy_after)

        self.prefill = pool("prefill", config.prefill_urls)
        self.decode = pool("decode", config.decode_urls)
        self.metrics = ProxyMetrics((self.prefill, self.decode))
        self.leases = LeaseWatch()
        self.upstream = Upstream(config, self.metrics)
        self.health = HealthProbes(self.upstream, self.prefill, self.decode, self.leases)
        self.legs = RequestLegs(self.upstream, self.prefill, self.decode, self.leases)
        #: Client requests in flight on /v1/* (and tokenizer routes); counted by the app's middleware.
        self.in_flight = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.upstream.session

    @property
    def shutting_down(self) -> bool:
        return self.legs.shutting_down

    async def start(self) -> None:
        await self.upstream.start()
        await self.health.start()  # know who is up before the first request (bounded by health_timeout_s)

    async def stop(self) -> None:
        await self.health.stop()
        await self.upstream.close()

    async def probe_all(self) -> None:
        """One health round now (``GET /health`` on every backend, P's KV-lease counters)."""
        await self.health.probe_all()

    def interrupt_streams(self) -> int:
        """End every stream being relayed with an SSE error event (shutdown); returns how many were open."""
        return self.legs.interrupt_streams()


STATE: Final = web.AppKey("hybridpd_proxy_state", ProxyState)
