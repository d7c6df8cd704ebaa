"""Backend pools: health state, outstanding-request counts, and the selection policies. No I/O here."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hybridpd.launch.proxy.config import POLICIES, Policy

Role = Literal["prefill", "decode"]

log = logging.getLogger("hybridpd.launch.proxy")


@dataclass(eq=False)
class Backend:
    """One vLLM instance. Mutable state, owned by its ``BackendPool`` (single event loop, no locking needed)."""

    url: str
    role: Role
    healthy: bool = True
    outstanding: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0
    last_error: str | None = None
    #: Requests sent to this backend (selection count), for tests and /health details.
    selected: int = field(default=0)
    #: False until the first health probe: that one decides the state on its own (a backend that is down when
    #: the proxy starts is out of rotation at once, not after ``unhealthy_after`` rounds).
    probed: bool = False

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "last_error": self.last_error,
        }


class BackendPool:
    """The P or D backends of one proxy, with a selection policy.

    Backends start healthy; the proxy probes them all before it accepts requests, and a failed FIRST probe ejects
    at once. After that, ``record_probe`` ejects a backend after ``unhealthy_after`` consecutive failed probes and
    re-admits it after ``healthy_after`` consecutive successes; ``eject`` (a refused connection) takes it out at
    once.
    """

    def __init__(
        self,
        role: Role,
        urls: Sequence[str],
        policy: Policy = "round_robin",
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        if not urls:
            raise ValueError(f"{role}: no backends")
        self.role: Role = role
        self.policy: Policy = policy
        self.backends: tuple[Backend, ...] = tuple(Backend(url=u, role=role) for u in urls)
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self._counter = 0

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    @property
    def healthy_count(self) -> int:
        return sum(1 for b in self.backends if b.healthy)

    def select(self, exclude: Collection[Backend] = ()) -> Backend | None:
        """The next healthy backend not in ``exclude`` by the pool's policy, or None."""
        candidates = [b for b in self.backends if b.healthy and b not in exclude]
        if not candidates:
            return None
        turn = self._counter
        self._counter += 1
        if self.policy == "least_outstanding":
            low = min(b.outstanding for b in candidates)
            candidates = [b for b in candidates if b.outstanding == low]  # ties rotate round-robin
        chosen = candidates[turn % len(candidates)]
        chosen.selected += 1
        return chosen

    def acquire(self, backend: Backend) -> None:
        backend.outstanding += 1

    def release(self, backend: Backend) -> None:
        backend.outstanding -= 1

    def eject(self, backend: Backend, reason: str) -> bool:
        """Take ``backend`` out of rotation now. Returns True if it was healthy before."""
        backend.last_error = reason
        backend.consecutive_successes = 0
        backend.consecutive_failures = max(backend.consecutive_failures, 1)
        if not backend.healthy:
            return False
        backend.healthy = False
        backend.ejections += 1
        log.warning("ejected %s backend %s: %s", self.role, backend.url, reason)
        return True

    def record_probe(self, backend: Backend, ok: bool, error: str | None = None) -> str | None:
        """Apply one health-probe result. Returns "ejected", "readmitted" or None (no change)."""
        first = not backend.probed
        backend.probed = True
        if ok:
            backend.consecutive_failures = 0
            backend.consecutive_successes += 1
            if not backend.healthy and backend.consecutive_successes >= self.healthy_after:
                backend.healthy = True
                backend.last_error = None
                log.info("re-admitted %s backend %s", self.role, backend.url)
                return "readmitted"
            return None
        backend.consecutive_successes = 0
        backend.consecutive_failures += 1
        backend.last_error = error
        if backend.healthy and (first or backend.consecutive_failures >= self.unhealthy_after):
            backend.healthy = False
            backend.ejections += 1
            log.warning(
                "ejected %s backend %s after %d failed health probes: %s",
                self.role,
                backend.url,
                backend.consecutive_failures,
                error,
            )
            return "ejected"
        return None
