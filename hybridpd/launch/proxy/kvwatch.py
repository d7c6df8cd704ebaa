"""KV leases that ran out before decode read them, as the prefill instances report it.

vLLM's NixlConnector (0.32, ``nixl/base_worker.py``, ``pull_worker.py``, ``stats.py``) pins a finished prefill's
KV blocks for ``kv_lease_duration`` seconds (``kv_connector_extra_config``, default 30; D's heartbeats extend
the lease once D knows the request). When the lease runs out P frees the blocks, logs "Releasing expired KV
blocks for request ..." and counts ``vllm:nixl_num_kv_expired_reqs``; when D's read-completion notification
then arrives for a request P no longer tracks, P logs "Potentially invalid KV blocks for unrecognized request
... They may have expired." and counts ``vllm:nixl_num_notifications_after_expiry`` (one per D rank). Both are
Prometheus counters on P's ``/metrics`` and both are tracked on P only: D answers 200 either way, and the client
never hears of it. Nothing in P's or D's HTTP answers names an expired request.

So the proxy scrapes every P's ``/metrics`` each health round and turns an increase of either counter into its
own counter (``hybridpd_proxy_kv_lease_expired_total{backend, kind}``) and a WARNING naming the requests handed
over by that P since the previous scrape whose handover (P's answer -> D's first byte) took longest: those are
the candidates whose output may come from reused blocks. The functions here are pure; the I/O is in ``app``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

#: vLLM counter name -> the ``kind`` label of the proxy's counter.
KV_LEASE_COUNTERS: Final[Mapping[str, str]] = {
    "vllm:nixl_num_kv_expired_reqs": "expired",
    "vllm:nixl_num_notifications_after_expiry": "read_after_expiry",
}


def parse_counters(text: str, names: Iterable[str] = KV_LEASE_COUNTERS) -> dict[str, float]:
    """Sum of each named counter over all its label sets in a Prometheus text exposition (``_total`` suffix
    accepted); names absent from ``text`` are absent from the result."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if end <= 0:
            continue
        name = line[:end]
        if name.endswith("_total"):
            name = name[: -len("_total")]
        if name not in wanted:
            continue
        try:
            value = float(line.rsplit("}", 1)[1].split()[0] if "}" in line else line.split()[1])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


@dataclass(frozen=True)
class Handover:
    """One request's P -> D handover as the proxy saw it."""

    pairing_id: str
    client_id: str | None
    prefill_url: str
    #: Seconds from P's answer to D's first byte (streams) or to D's whole answer (non-streamed).
    seconds: float


@dataclass
class LeaseWatch:
    """Last counter values per P, and recent handovers per P (bounded), between two scrapes."""

    recent_limit: int = 1000
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    recent: dict[str, deque[Handover]] = field(default_factory=dict)

    def note(self, handover: Handover) -> None:
        self.recent.setdefault(handover.prefill_url, deque(maxlen=self.recent_limit)).append(handover)

    def update(self, backend: str, values: Mapping[str, float]) -> dict[str, float]:
        """Increases since the previous scrape of ``backend`` (the first scrape is the baseline: no increase;
        a counter that went down means P restarted, and its new value is the increase)."""
        previous = self.last.get(backend)
        self.last[backend] = dict(values)
        if previous is None:
            return {}
        deltas: dict[str, float] = {}
        for name, value in values.items():
            before = previous.get(name, 0.0)
            delta = value - before if value >= before else value
            if delta > 0:
                deltas[name] = delta
        return deltas

    def take_candidates(self, backend: str, n: int = 5) -> list[Handover]:
        """The ``n`` slowest handovers from ``backend`` since the previous call; clears the list."""
        pending = self.recent.pop(backend, deque())
        return sorted(pending, key=lambda h: h.seconds, reverse=True)[:n]

    def forget_recent(self, backend: str) -> None:
        self.recent.pop(backend, None)
