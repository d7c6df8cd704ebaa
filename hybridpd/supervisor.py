"""Run a LaunchPlan: start P and D, wait for /health, start the proxy, multiplex logs, stop everything.

Each child runs in its own session/process group (start_new_session), so stopping it signals the whole
group (API server, EngineCore, workers). Any child exiting early stops the rest (fail fast) and reports
its last log lines. SIGINT/SIGTERM stop all groups: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from .errors import HybridPDError
from .launch import LaunchPlan, ProcessSpec, env_for


class ChildFailed(HybridPDError):
    """A supervised process exited (or never became healthy)."""


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: threading.Thread | None = None
    healthy: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local URLs from the plan)
            return bool(200 <= r.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class HealthProgress(Protocol):
    """Where the wait for /health is shown (the CLI passes a rich display; None logs status lines)."""

    def waiting(self, name: str, url: str) -> None: ...

    def healthy(self, name: str, seconds: float) -> None: ...

    def close(self) -> None: ...


class Supervisor:
    def __init__(self, plan: LaunchPlan, *, out: IO[str] | None = None, grace_s: float = 15.0,
                 health_timeout_s: float = 900.0, poll_s: float = 0.5, tail_lines: int = 40,
                 progress: HealthProgress | None = None, on_ready: Callable[[Supervisor], None] | None = None) -> None:
        self.plan = plan
        self.out = out or sys.stdout
        self.grace_s = grace_s
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.tail_lines = tail_lines
        self.progress = progress
        self.on_ready = on_ready
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_reason: str | None = None

    # -- logging --------------------------------------------------------------------------------------
    def _write(self, line: str) -> None:
        with self._lock:
            try:
                self.out.write(line + "\n")
                self.out.flush()
            except (ValueError, OSError):
                pass

    def status(self, msg: str) -> None:
        with self._lock:
            print(f"hybridpd: {msg}", file=sys.stderr, flush=True)

    def _pump(self, child: Child) -> None:
        assert child.proc.stdout is not None
        prefix = f"[{child.spec.name}] "
        for raw in iter(child.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            child.tail.append(line)
            self._write(prefix + line)
        child.proc.stdout.close()

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self, spec: ProcessSpec) -> Child:
        proc = subprocess.Popen(list(spec.argv), env=env_for(spec), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(spec=spec, proc=proc, tail=collections.deque(maxlen=self.tail_lines))
        child.reader = threading.Thread(target=self._pump, args=(child,), name=f"log-{spec.name}", daemon=True)
        child.reader.start()
        self.children.append(child)
        self.status(f"started {spec.name} pid {proc.pid} on {spec.url}")
        return child

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
        self._stop.set()

    def _dead(self) -> Child | None:
        for c in self.children:
            if c.proc.poll() is not None:
                return c
        return None

    def _failure(self, child: Child, what: str) -> ChildFailed:
        if child.reader is not None:
            child.reader.join(timeout=2)
        tail = "\n".join(f"  [{child.spec.name}] {line}" for line in child.tail) or "  (no output)"
        return ChildFailed(f"{child.spec.name} {what}; its last log lines:\n{tail}",
                           fix=f"read the lines above; rerun `{child.spec.shell()}` by hand to debug")

    def _wait_healthy(self, children: Sequence[Child]) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        prog = self.progress
        if prog is not None:
            for c in children:
                prog.waiting(c.spec.name, c.spec.health_url)
        try:
            while True:
                if self._stop.is_set():
                    return
                dead = self._dead()
                if dead is not None:
                    raise self._failure(dead, f"exited with code {dead.proc.returncode} before all were healthy")
                for c in children:
                    if not c.healthy and http_ok(c.spec.health_url):
                        c.healthy = True
                        dt = time.monotonic() - c.started
                        if prog is not None:
                            prog.healthy(c.spec.name, dt)
                        else:
                            self.status(f"{c.spec.name} healthy after {dt:.1f} s")
                if all(c.healthy for c in children):
                    return
                if time.monotonic() > deadline:
                    slow = next(c for c in children if not c.healthy)
                    raise self._failure(slow, f"not healthy after {self.health_timeout_s:.0f} s")
                self._stop.wait(self.poll_s)
        finally:
            if prog is not None:
                prog.close()

    def stop_all(self) -> None:
        """SIGTERM every process group, wait grace_s, SIGKILL what is left, reap everything."""
        alive = [c for c in self.children]
        for c in alive:
            _killpg(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for c in alive:
            left = max(0.0, deadline - time.monotonic())
            try:
                c.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.status(f"{c.spec.name} ignored SIGTERM for {self.grace_s:.0f} s: SIGKILL")
        # SIGKILL the groups even when the leader is gone: grandchildren (EngineCore, workers) may remain.
        for c in alive:
            _killpg(c.pid, signal.SIGKILL)
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            if c.reader is not None:
                c.reader.join(timeout=2)

    def run(self, *, install_signals: bool = True) -> int:
        """Start the plan and supervise until a signal or a child exit. Returns the exit code."""
        old: dict[int, Any] = {}
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, lambda s, f: self.request_stop(signal.Signals(s).name))
        code = 0
        try:
            servers = [self.start(s) for s in self.plan.servers]
            if servers:
                self._wait_healthy(servers)
            px = self.plan.proxy
            if px is not None and not self._stop.is_set():
                self._wait_healthy([self.start(px)])
            if not self._stop.is_set():
                self.status("all healthy: " + ", ".join(f"{c.spec.name} {c.spec.url}" for c in self.children)
                            + (f"; send requests to {px.url}" if px is not None else ""))
                if self.on_ready is not None:
                    self.on_ready(self)
            while not self._stop.is_set():
                dead = self._dead()
                if dead is not None:
                    raise self._failure(dead, f"exited with code {dead.proc.returncode}")
                self._stop.wait(self.poll_s)
            self.status(f"{self._stop_reason}: stopping {len(self.children)} process group(s)")
            code = 130 if self._stop_reason == "SIGINT" else 0
        except ChildFailed as e:
            self.status(str(e))
            code = 1
        finally:
            self.stop_all()
            for signum, h in old.items():
                signal.signal(signum, h)
        return code


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(plan: LaunchPlan, **kw: Any) -> int:
    return Supervisor(plan, **kw).run()
