"""Run a LaunchPlan: start P and D, wait for /health, start the proxy, watch them, stop them in order.

Nothing outlives the supervisor. Every child runs under a keeper (``hybridpd.launch.keeper``) that holds the read end
of a watchdog pipe: when the supervisor dies by any signal, SIGKILL included, the kernel closes the write end
and each keeper stops its child's whole tree within a few seconds. Keepers are child subreapers, so a
descendant that double-forks or calls ``setsid`` is still found (by parent links, not process groups). The
supervisor is a subreaper too: if a keeper itself is killed, its orphans come to the supervisor, which kills
the ones carrying this deployment's token in their environment.

Liveness is by /health, not only by exit: a child that stops answering for ``liveness_timeout_s`` (a hung or
SIGSTOP'd process) is killed and treated as failed. A failed child stops everything (``restart="no"``, fail
fast) or is restarted with exponential backoff up to ``restart_limit`` times (``restart="on-failure"``; the
count resets after ``restart_reset_s`` of health).

Stopping drains: the proxy first (it stops accepting, lets in-flight streams finish or ends them with an error
event within its shutdown grace), then D, then P; each stage has ``grace_s`` before its keeper SIGKILLs what is
left and unlinks the ``/dev/shm`` segments the killed processes leaked.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from hybridpd.errors import HybridPDError, UsageError
from hybridpd.launch import keeper as _keeper
from hybridpd.launch.commands import LaunchPlan, ProcessSpec, env_for

RESTART_POLICIES = ("no", "on-failure")
TOKEN_ENV = "HYBRIDPD_DEPLOYMENT_TOKEN"
STOP_ORDER = ("proxy", "decode", "prefill")
PORT_WAIT_S = 30.0  # a restart waits this long at most for the failed process's ports to be released


class ChildFailed(HybridPDError):
    """A supervised process exited, stopped answering, or never became healthy (and was not restarted)."""


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: threading.Thread | None = None
    healthy: bool = False
    state: str = "starting"  # starting | healthy | backoff | stopped
    started: float = field(default_factory=time.monotonic)
    last_ok: float = 0.0
    healthy_since: float = 0.0
    next_probe: float = 0.0
    restarts: int = 0
    restart_at: float = 0.0
    due_at: float = 0.0  # when the pending restart first became due
    report: dict[str, Any] | None = None  # the keeper's last line
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url, None when nothing answered within ``timeout``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (local URLs from the plan)
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    status = http_status(url, timeout)
    return status is not None and 200 <= status < 300


def alive_answer(role: str, status: int | None) -> bool:
    """Liveness: a vLLM server must answer /health with 2xx (503 = its engine is dead); the proxy only has to
    answer at all (its /health is 503 while a backend is down, which is not the proxy's failure)."""
    if status is None:
        return False
    return True if role == "proxy" else 200 <= status < 300


class HealthProgress(Protocol):
    """Where the wait for /health is shown (the CLI passes a rich display; None logs status lines)."""

    def waiting(self, name: str, url: str) -> None: ...

    def healthy(self, name: str, seconds: float) -> None: ...

    def close(self) -> None: ...


def _proc_environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _direct_children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _keeper._stat(int(name))
            if st is not None and int(st[1]) == pid and st[0] != "Z":
                out.append(int(name))
    return out


class Supervisor:
    def __init__(self, plan: LaunchPlan, *, out: IO[str] | None = None, grace_s: float = 15.0,
                 health_timeout_s: float = 900.0, poll_s: float = 0.5, tail_lines: int = 40,
                 progress: HealthProgress | None = None, on_ready: Callable[[Supervisor], None] | None = None,
                 restart: str = "no", restart_limit: int = 5, backoff_s: float = 2.0, backoff_max_s: float = 60.0,
                 restart_reset_s: float = 600.0, health_interval_s: float = 5.0, liveness_timeout_s: float = 30.0,
                 probe_timeout_s: float = 3.0, subreaper: bool = True,
                 on_change: Callable[[Supervisor, str], None] | None = None) -> None:
        if restart not in RESTART_POLICIES:
            raise UsageError(f"unknown policy {restart!r}", field="--restart", fix="use no or on-failure")
        self.plan = plan
        self.out = out or sys.stdout
        self.grace_s = grace_s
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.tail_lines = tail_lines
        self.progress = progress
        self.on_ready = on_ready
        self.on_change = on_change
        self.restart = restart
        self.restart_limit = restart_limit
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.restart_reset_s = restart_reset_s
        self.health_interval_s = health_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.subreaper = subreaper
        self.children: list[Child] = []
        self.token = uuid.uuid4().hex
        self.ready = False
        self.stop_summary: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._watch_r: int | None = None
        self._watch_w: int | None = None
        self._next_orphan_sweep = 0.0

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

    def _pump(self, child: Child, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"[{child.spec.name}] "
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(_keeper.MARKER):
                try:
                    child.report = json.loads(line[len(_keeper.MARKER):])
                except ValueError:
                    pass
                continue
            child.tail.append(line)
            self._write(prefix + line)
            if child.spec.role == "proxy" and "KV lease expired" in line:
                # the proxy saw P's lease counters rise: D may have read freed blocks; tell the operator too
                self.status(f"warning: {line.strip()}")
        proc.stdout.close()

    # -- lifecycle ------------------------------------------------------------------------------------
    def _pipe(self) -> int:
        if self._watch_r is None:
            self._watch_r, self._watch_w = os.pipe()  # both ends close-on-exec; the read end is passed on
        return self._watch_r

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen[bytes]:
        r = self._pipe()
        env = env_for(spec)
        env[TOKEN_ENV] = self.token
        argv = [sys.executable, "-m", "hybridpd.launch.keeper", "--watch-fd", str(r), "--grace", f"{self.grace_s:g}",
                "--", *spec.argv]
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(r,))

    def _attach(self, child: Child) -> None:
        child.reader = threading.Thread(target=self._pump, args=(child, child.proc), name=f"log-{child.spec.name}",
                                        daemon=True)
        child.reader.start()

    def start(self, spec: ProcessSpec) -> Child:
        child = Child(spec=spec, proc=self._spawn(spec), tail=collections.deque(maxlen=self.tail_lines))
        self._attach(child)
        self.children.append(child)
        self.status(f"started {spec.name} pid {child.pid} on {spec.url}")
        if self.progress is not None and not self.ready:
            self.progress.waiting(spec.name, spec.health_url)
        return child

    def _restart(self, child: Child) -> None:
        if child.reader is not None:
            child.reader.join(timeout=2)
        child.proc = self._spawn(child.spec)
        child.report = None
        child.state, child.healthy, child.started = "starting", False, time.monotonic()
        self._attach(child)
        self.status(f"restarted {child.spec.name} (restart {child.restarts} of {self.restart_limit}) "
                    f"pid {child.pid}")
        self._changed("restart")

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
        self._stop.set()

    def _changed(self, what: str) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self, what)
            except Exception as e:  # noqa: BLE001 - a record that cannot be written must not stop serving
                self.status(f"could not record the deployment ({what}): {e}")

    def _failure(self, child: Child, what: str) -> ChildFailed:
        if child.reader is not None:
            child.reader.join(timeout=2)
        tail = "\n".join(f"  [{child.spec.name}] {line}" for line in child.tail) or "  (no output)"
        return ChildFailed(f"{child.spec.name} {what}; its last log lines:\n{tail}",
                           fix=f"read the lines above; rerun `{child.spec.shell()}` by hand to debug")

    def _kill_now(self, child: Child) -> None:
        """Tell the keeper to SIGKILL the child's tree now; SIGKILL the keeper too if it does not obey."""
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _killpg(child.pid, signal.SIGKILL)
            child.proc.wait(timeout=5)

    def _on_death(self, child: Child, what: str) -> None:
        now = time.monotonic()
        exit_code = (child.report or {}).get("exit", child.proc.returncode)
        child.history.append({"what": what, "exit": exit_code, "at": time.time()})
        child.state, child.healthy = "backoff", False
        if self.restart == "on-failure" and child.restarts < self.restart_limit:
            child.restarts += 1
            delay = min(self.backoff_max_s, self.backoff_s * 2 ** (child.restarts - 1))
            child.restart_at = child.due_at = now + delay
            self.status(f"{child.spec.name} {what}; restarting in {delay:.1f} s "
                        f"(restart {child.restarts} of {self.restart_limit})")
            self._changed("failed")
            return
        if self.restart == "on-failure":
            what += f" (restart limit {self.restart_limit} reached)"
        raise self._failure(child, what)

    def _probe(self, child: Child, now: float) -> None:
        if child.state == "starting":
            if http_ok(child.spec.health_url, timeout=self.probe_timeout_s):
                child.state, child.healthy = "healthy", True
                child.last_ok = child.healthy_since = now
                child.next_probe = now + self.health_interval_s
                dt = now - child.started
                if self.progress is not None and not self.ready:
                    self.progress.healthy(child.spec.name, dt)
                else:
                    self.status(f"{child.spec.name} healthy after {dt:.1f} s")
                if self.ready:
                    self._changed("healthy")
            elif now - child.started > self.health_timeout_s:
                self._kill_now(child)
                self._on_death(child, f"not healthy after {self.health_timeout_s:.0f} s")
        elif child.state == "healthy" and now >= child.next_probe:
            child.next_probe = now + self.health_interval_s
            if alive_answer(child.spec.role, http_status(child.spec.health_url, timeout=self.probe_timeout_s)):
                child.last_ok = now
                if child.restarts and now - child.healthy_since > self.restart_reset_s:
                    child.restarts = 0
            elif time.monotonic() - child.last_ok > self.liveness_timeout_s:
                silent = time.monotonic() - child.last_ok
                self._kill_now(child)
                self._on_death(child, f"stopped answering {child.spec.health_url} for {silent:.0f} s (hung): killed")

    def _busy_ports(self, child: Child) -> list[int]:
        from hybridpd.launch.probes import port_in_use

        spec = child.spec
        out = [spec.port] if port_in_use(spec.host if spec.host not in ("", "0.0.0.0") else "127.0.0.1",
                                         spec.port) else []
        if spec.side_channel_port is not None and port_in_use(self.plan.side_channel_host, spec.side_channel_port):
            out.append(spec.side_channel_port)
        return out

    def _sweep_orphans(self) -> list[int]:
        """Kill processes of this deployment that were re-parented to the supervisor (their keeper died)."""
        keepers = {c.pid for c in self.children}
        needle = f"{TOKEN_ENV}={self.token}".encode()
        killed = []
        for pid in _direct_children(os.getpid()):
            if pid not in keepers and _proc_environ_has(pid, needle):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        for pid in killed:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        return killed

    def _loop(self) -> None:
        px = self.plan.proxy
        proxy_started = px is None
        while not self._stop.is_set():
            now = time.monotonic()
            for c in list(self.children):
                if self._stop.is_set():
                    break
                if c.state == "backoff":
                    if now >= c.restart_at:
                        busy = self._busy_ports(c)
                        if busy and now - c.due_at < PORT_WAIT_S:  # the old tree's sockets may linger
                            if c.restart_at == c.due_at:
                                self.status(f"{c.spec.name}: port(s) {', '.join(map(str, busy))} still in use; "
                                            f"waiting up to {PORT_WAIT_S:.0f} s before the restart")
                            c.restart_at = now + 1.0
                            continue
                        self._restart(c)
                    continue
                if c.proc.poll() is not None:
                    if c.reader is not None:
                        c.reader.join(timeout=2)
                    code = (c.report or {}).get("exit", c.proc.returncode)
                    self._on_death(c, f"exited with code {code}")
                    continue
                self._probe(c, now)
            servers = [c for c in self.children if c.spec.role != "proxy"]
            if not proxy_started and all(c.state == "healthy" for c in servers) and px is not None \
                    and not self._stop.is_set():
                self.start(px)
                proxy_started = True
            if not self.ready and proxy_started and all(c.state == "healthy" for c in self.children):
                self.ready = True
                if self.progress is not None:
                    self.progress.close()
                self.status("all healthy: " + ", ".join(f"{c.spec.name} {c.spec.url}" for c in self.children)
                            + (f"; send requests to {px.url}" if px is not None else ""))
                self._changed("ready")
                if self.on_ready is not None:
                    self.on_ready(self)
            if self.subreaper and now >= self._next_orphan_sweep:
                self._next_orphan_sweep = now + 2.0
                for pid in self._sweep_orphans():
                    self.status(f"killed orphaned process {pid} of this deployment (its keeper had died)")
            self._stop.wait(self.poll_s)

    def stop_all(self) -> None:
        """Proxy, then D, then P: SIGTERM each stage's keepers and wait; a keeper SIGKILLs what outlives
        ``grace_s`` and unlinks the shared-memory segments of what it killed."""
        t0 = time.monotonic()
        sigkilled: dict[str, list[int]] = {}
        shm: list[str] = []
        roles = [r for r in STOP_ORDER] + sorted({c.spec.role for c in self.children} - set(STOP_ORDER))
        for role in roles:
            stage = [c for c in self.children if c.spec.role == role and c.proc.poll() is None]
            for c in stage:
                try:
                    os.kill(c.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for c in stage:
                try:
                    c.proc.wait(timeout=self.grace_s + 10)
                except subprocess.TimeoutExpired:  # the keeper itself is stuck: last resort
                    self.status(f"{c.spec.name}: its keeper did not stop: SIGKILL")
                    _killpg(c.pid, signal.SIGKILL)
                    c.proc.wait(timeout=5)
                    sigkilled.setdefault(c.spec.name, []).append(c.pid)
        for c in self.children:
            if c.reader is not None:
                c.reader.join(timeout=2)
            rep = c.report or {}
            if rep.get("killed"):
                sigkilled.setdefault(c.spec.name, []).extend(rep["killed"])
            shm += rep.get("shm_removed", [])
            c.state, c.healthy = "stopped", False
        if self.subreaper:
            self._sweep_orphans()
        if self._watch_w is not None:
            os.close(self._watch_w)
            self._watch_w = None
        if self._watch_r is not None:
            os.close(self._watch_r)
            self._watch_r = None
        dt = time.monotonic() - t0
        self.stop_summary = {"seconds": round(dt, 2), "sigkilled": sigkilled, "shm_removed": shm}
        if self.children:
            what = ("SIGKILL needed for " + ", ".join(f"{n} ({len(p)} process(es))" for n, p in sigkilled.items())
                    if sigkilled else "no SIGKILL needed")
            self.status(f"stopped {len(self.children)} process tree(s) in {dt:.1f} s; {what}"
                        + (f"; removed {len(shm)} leaked /dev/shm segment(s)" if shm else ""))

    def run(self, *, install_signals: bool = True) -> int:
        """Start the plan and supervise until a signal or an unrecovered failure. Returns the exit code."""
        old: dict[int, Any] = {}
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, lambda s, f: self.request_stop(signal.Signals(s).name))
        if self.subreaper:
            _keeper.prctl(_keeper.PR_SET_CHILD_SUBREAPER, 1)
        code = 0
        try:
            for s in self.plan.servers:
                self.start(s)
            self._loop()
            self.status(f"{self._stop_reason}: stopping {len(self.children)} process tree(s): proxy, then D, then P")
            code = 130 if self._stop_reason == "SIGINT" else 0
        except ChildFailed as e:
            self.status(str(e))
            code = 1
        finally:
            if self.progress is not None and not self.ready:
                self.progress.close()
            self.stop_all()
            self._changed("stopped")
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

