"""Backend health probes and P's KV-lease counters: the periodic part of a proxy (``ProxyState.health``).

Every ``health_interval_s`` (and from ``GET /health`` when the last round is older than ``health_max_age_s``)
each backend gets ``GET /health``: a refused connection ejects at once (the process is gone), other failures
after ``unhealthy_after`` in a row. The periodic round also scrapes each P's ``/metrics`` (see ``kvwatch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import aiohttp

from hybridpd.launch.proxy.config import ProxyConfig
from hybridpd.launch.proxy.kvwatch import KV_LEASE_COUNTERS, LeaseWatch, parse_counters
from hybridpd.launch.proxy.metrics import ProxyMetrics
from hybridpd.launch.proxy.pool import Backend, BackendPool
from hybridpd.launch.proxy.upstream import Upstream

log = logging.getLogger("hybridpd.launch.proxy")


class HealthProbes:
    """The health task of one proxy (``start`` / ``stop``) and the probe rounds, on the upstream session."""

    def __init__(self, upstream: Upstream, prefill: BackendPool, decode: BackendPool, leases: LeaseWatch) -> None:
        self.upstream = upstream
        self.config: ProxyConfig = upstream.config
        self.metrics: ProxyMetrics = upstream.metrics
        self.prefill, self.decode = prefill, decode
        self.leases = leases
        self._task: asyncio.Task[None] | None = None
        self._probe_round: asyncio.Task[None] | None = None
        #: Loop time at which the last completed ``GET /health`` round started.
        self.last_probe = -math.inf

    async def start(self) -> None:
        """One round first (bounded by ``health_timeout_s``: know who is up before the first request), then one
        every ``health_interval_s``."""
        await self.probe_all()
        self._task = asyncio.create_task(self._health_loop(), name="hybridpd-proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.probe_all()
            except Exception:  # never let the loop die; a broken probe must not stop later ones
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        """One round of ``GET /health`` on every backend and, with ``watch_kv_leases``, of P's KV-lease
        counters (the periodic round)."""
        jobs = [self.probe_health()]
        if self.config.watch_kv_leases:
            jobs += [self._scrape_leases(b) for b in self.prefill.backends]
        await asyncio.gather(*jobs)

    async def probe_health(self) -> None:
        """One round of ``GET /health`` on every backend, concurrently; concurrent callers share one round."""
        task = self._probe_round
        if task is None or task.done():
            task = self._probe_round = asyncio.ensure_future(self._probe_health_round())
        await asyncio.shield(task)

    async def _probe_health_round(self) -> None:
        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(self._probe(pool, b) for pool in (self.prefill, self.decode) for b in pool.backends))
        self.last_probe = started

    async def _scrape_leases(self, backend: Backend) -> None:
        """P's KV-lease counters -> proxy counter + a warning on increase (see ``kvwatch``)."""
        if not backend.healthy:
            return
        cfg = self.config
        timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s,
                                        sock_connect=min(cfg.connect_timeout_s, cfg.health_timeout_s))
        try:
            async with self.upstream.session.get(backend.url + "/metrics", headers=self.upstream.auth_headers(),
                                                 timeout=timeout) as r:
                if r.status != 200:
                    return
                text = (await r.read()).decode("utf-8", "replace")
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
            return
        deltas = self.leases.update(backend.url, parse_counters(text))
        if not deltas:
            if backend.url in self.leases.last:
                self.leases.forget_recent(backend.url)
            return
        for name, delta in deltas.items():
            self.metrics.kv_lease_expired.labels(backend.url, KV_LEASE_COUNTERS[name]).inc(delta)
        candidates = self.leases.take_candidates(backend.url)
        named = ", ".join(
            f"{h.pairing_id}" + (f" (client id {h.client_id})" if h.client_id else "") + f" {h.seconds:.2f} s"
            for h in candidates
        )
        log.warning(
            "KV lease expired on prefill backend %s: %s. Decode may have read KV blocks P had already freed "
            "(HTTP 200, possibly wrong output). Slowest handovers since the last check: %s. Raise "
            "kv_lease_duration in kv_connector_extra_config or find out why decode reads late.",
            backend.url,
            "; ".join(f"{name} +{delta:g}" for name, delta in deltas.items()),
            named or "none seen by this proxy",
        )

    async def _probe(self, pool: BackendPool, backend: Backend) -> None:
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=cfg.health_timeout_s, sock_connect=min(cfg.connect_timeout_s, cfg.health_timeout_s)
        )
        error: str | None = None
        refused = False
        try:
            async with self.upstream.session.get(backend.url + "/health", headers=self.upstream.auth_headers(),
                                                 timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    error = f"health probe: HTTP {r.status}"
        except asyncio.TimeoutError:
            error = f"health probe timed out after {cfg.health_timeout_s} s"
        except aiohttp.ClientConnectorError as exc:  # nothing listens: the process is gone, no hysteresis
            error = f"health probe: {type(exc).__name__}: {exc}"
            refused = True
        except (aiohttp.ClientError, OSError) as exc:
            error = f"health probe: {type(exc).__name__}: {exc}"
        if refused:
            if pool.eject(backend, error or "connection refused"):
                self.metrics.ejections.labels(pool.role, backend.url, "health").inc()
            pool.record_probe(backend, False, error)
        elif pool.record_probe(backend, error is None, error) == "ejected":
            self.metrics.ejections.labels(pool.role, backend.url, "health").inc()
