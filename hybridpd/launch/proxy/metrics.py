"""Prometheus metrics of one proxy app, in its own ``CollectorRegistry`` (several apps can share a process)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridpd.launch.proxy.pool import BackendPool

# Seconds; covers a warm CPU prefill (~10 ms) up to a cold first request of a new shape (4-24 s) and beyond.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class _PoolCollector(Collector):
    """Backend health and outstanding counts, read from the pools at scrape time (never stale)."""

    def __init__(self, pools: Sequence[BackendPool]) -> None:
        self._pools = tuple(pools)

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily(
            "hybridpd_proxy_backend_healthy", "1 if the backend is in rotation, 0 if ejected", labels=["role", "backend"]
        )
        outstanding = GaugeMetricFamily(
            "hybridpd_proxy_backend_outstanding",
            "Requests currently open on the backend",
            labels=["role", "backend"],
        )
        count = GaugeMetricFamily("hybridpd_proxy_healthy_backends", "Healthy backends per role", labels=["role"])
        for pool in self._pools:
            for b in pool.backends:
                healthy.add_metric([pool.role, b.url], 1.0 if b.healthy else 0.0)
                outstanding.add_metric([pool.role, b.url], float(b.outstanding))
            count.add_metric([pool.role], float(pool.healthy_count))
        return [healthy, outstanding, count]


class ProxyMetrics:
    """All series of one proxy. ``render()`` gives the Prometheus text exposition."""

    def __init__(self, pools: Sequence[BackendPool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "hybridpd_proxy_requests", "Client requests by route and final HTTP status", ["route", "status"], registry=r
        )

        def latency(name: str, documentation: str, labels: list[str]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=LATENCY_BUCKETS, registry=r)

        self.request_duration = latency(
            "hybridpd_proxy_request_duration_seconds", "Client request duration (streams: until the last byte)",
            ["route"],
        )
        self.leg_duration = latency(
            "hybridpd_proxy_leg_duration_seconds",
            "Upstream leg latency: prefill (whole P request), decode_first_byte, decode (whole D request)",
            ["leg", "backend"],
        )
        self.upstream_errors = Counter(
            "hybridpd_proxy_upstream_errors",
            "Upstream failures by leg and kind (connect, timeout, http_5xx, disconnect, invalid_kv, ...)",
            ["leg", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "hybridpd_proxy_backend_ejections",
            "Backends taken out of rotation, by reason (connect, health)",
            ["role", "backend", "reason"],
            registry=r,
        )
        self.outstanding = Gauge(
            "hybridpd_proxy_outstanding_requests", "Client requests in flight on /v1/* routes", registry=r
        )
        self.kv_lease_expired = Counter(
            "hybridpd_proxy_kv_lease_expired",
            "KV leases a prefill backend reported expired (kind=expired: P freed blocks decode had not read; "
            "kind=read_after_expiry: decode read blocks after P's lease ran out, output may be wrong), from P's "
            "vllm:nixl_num_kv_expired_reqs / vllm:nixl_num_notifications_after_expiry",
            ["backend", "kind"],
            registry=r,
        )
        self.kv_handover = latency(
            "hybridpd_proxy_kv_handover_seconds",
            "P's answer -> D's first byte (streams; KV pull + first token), per prefill backend: compare with "
            "the NixlConnector kv_lease_duration",
            ["backend"],
        )
        self.connections_closed = Counter(
            "hybridpd_proxy_client_connections_closed",
            "Client connections closed or refused by the proxy (evicted, refused, header_timeout, idle_timeout)",
            ["reason"],
            registry=r,
        )
        r.register(_PoolCollector(pools))

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoized: the hot path calls this several times per request, and
        prometheus_client's ``labels`` validates and locks on every call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
