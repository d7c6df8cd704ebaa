"""The per-child keeper: ``python -m hybridpd.launch.keeper --watch-fd N --grace S -- ARGV...``.

`hybridpd serve` starts every vLLM server and the proxy through one keeper each. The keeper makes sure that
nothing of the child outlives the supervisor, by whatever signal the supervisor dies:

* **Watchdog pipe.** The supervisor holds the write end of a pipe; each keeper holds the read end (``--watch-fd``).
  When the supervisor dies, SIGKILL included, the kernel closes the write end and the keeper reads EOF at once.
  Unlike ``PR_SET_PDEATHSIG`` this does not fire when the *thread* that forked exits, has no race with a parent
  that died before the child called prctl, and needs no signal handler in the child.
* **Child subreaper.** The keeper sets ``PR_SET_CHILD_SUBREAPER``, so descendants whose parent dies (vLLM's
  EngineCore, its workers, resource trackers, a child that double-forks or calls ``setsid``) are re-parented to
  the keeper, never to PID 1. The keeper therefore finds every descendant by walking parent links in ``/proc``;
  process groups and sessions (which a child can leave) are not used for tracking.
* **Shared memory.** While the child runs, the keeper notes the ``/dev/shm`` segments its descendants map or hold
  open. After the tree is gone it unlinks those still present: a process killed by SIGKILL cannot unlink its
  ``psm_*`` segments, and vLLM's resource tracker dies with it.

Signals from the supervisor: SIGTERM = stop gracefully (SIGTERM to the child, ``--grace`` seconds for the whole
tree, then SIGKILL); SIGUSR1 = kill now (the child stopped answering /health). SIGINT is ignored: the supervisor
decides the order. The keeper exits with the child's status (128 + signal when it died by a signal) and prints
one last line ``@@hybridpd-keeper {json}`` (killed pids, removed segments) that the supervisor reads.

Standard library only, and nothing heavy imported: the keeper starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MARKER = "@@hybridpd-keeper "
SHM_DIR = "/dev/shm/"
ORPHAN_GRACE_S = 3.0  # the supervisor is gone: nobody waits for a long drain
SCAN_INTERVAL_S = 5.0


def prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode("utf-8", "replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, found by parent links (not process groups or sessions)."""
    children: dict[int, list[int]] = {}
    state: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None:
            continue
        state[int(name)] = st[0]
        children.setdefault(int(st[1]), []).append(int(name))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if state.get(pid) != "Z":
            out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def shm_segments(pids: Iterable[int]) -> set[str]:
    """``/dev/shm`` paths the processes map or hold open."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    i = line.find(b" " + SHM_DIR.encode())
                    if i >= 0:
                        found.add(line[i + 1:].decode("utf-8", "replace").strip().removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(SHM_DIR) and not target.endswith(" (deleted)"):
                    found.add(target)
        except OSError:
            pass
    return {p for p in found if p.startswith(SHM_DIR) and "/" not in p[len(SHM_DIR):]}


def say(line: str) -> None:
    """Print to the supervisor's log pipe; once the supervisor is gone the pipe is broken: say nothing."""
    try:
        print(line, flush=True)
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - replaces the broken stream for good
        except OSError:
            pass


def _kill(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Keeper:
    def __init__(self, argv: Sequence[str], *, watch_fd: int | None, grace_s: float) -> None:
        self.argv = list(argv)
        self.watch_fd = watch_fd
        self.grace_s = grace_s
        self.me = os.getpid()
        self.segments: set[str] = set()
        self.killed: list[int] = []
        self.reason = "exited"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._signals: list[int] = []

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _reap(self) -> None:
        """Reap every exited child (as a subreaper the keeper inherits orphans and must wait for them)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child.pid:
                self.child.returncode = os.waitstatus_to_exitcode(status)

    def _scan(self) -> None:
        self.segments |= shm_segments(descendants(self.me))

    def stop_tree(self, grace_s: float) -> None:
        """SIGTERM the child (vLLM stops its own engine), wait ``grace_s`` for the whole tree, SIGKILL the rest.
        Once the child is gone its remaining descendants get a SIGTERM too (they lost their manager)."""
        if self.child.returncode is None and grace_s > 0:
            _kill([self.child.pid], signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        termed_rest = False
        while True:
            self._reap()
            left = descendants(self.me)
            if not left:
                return
            if self.child.returncode is not None and not termed_rest:
                _kill(left, signal.SIGTERM)
                termed_rest = True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self._scan()  # last look at the segments of what is about to be killed
        for _ in range(50):  # SIGKILL until nothing is left (a process can fork while we kill)
            left = descendants(self.me)
            if not left:
                break
            self.killed += [p for p in left if p not in self.killed]
            _kill(left, signal.SIGKILL)
            time.sleep(0.02)
            self._reap()

    def cleanup_shm(self) -> list[str]:
        removed = []
        for path in sorted(self.segments):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError:
                pass
        return removed

    def run(self) -> int:
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            self.child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, close_fds=True,
                                          preexec_fn=_child_setup)
        except OSError as e:
            say(f"hybridpd-keeper: cannot start {self.argv[0]}: {e}")
            return 127
        fds = [self._wake_r] + ([self.watch_fd] if self.watch_fd is not None else [])
        next_scan = time.monotonic() + 1.0
        while True:
            self._reap()
            if self.child.returncode is not None:
                self.reason = "exited"
                self.stop_tree(min(self.grace_s, ORPHAN_GRACE_S))
                break
            now = time.monotonic()
            if now >= next_scan:
                self._scan()
                next_scan = now + SCAN_INTERVAL_S
            try:
                ready, _, _ = select.select(fds, [], [], max(0.0, min(1.0, next_scan - now)))
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                ready = []
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 512)
                except BlockingIOError:
                    pass
            sigs, self._signals = self._signals, []
            if signal.SIGUSR1 in sigs:
                self.reason = "killed (not answering /health)"
                self.stop_tree(0.0)
                break
            if signal.SIGTERM in sigs or signal.SIGHUP in sigs:
                self.reason = "stopped"
                self.stop_tree(self.grace_s)
                break
            if self.watch_fd is not None and self.watch_fd in ready:
                try:
                    data = os.read(self.watch_fd, 512)
                except OSError:
                    data = b""
                if not data:  # EOF: the supervisor is gone
                    self.reason = "supervisor gone"
                    say("hybridpd-keeper: the supervisor died; stopping the child")
                    self.stop_tree(min(self.grace_s, ORPHAN_GRACE_S))
                    break
        self._reap()
        removed = self.cleanup_shm()
        code = self.child.returncode
        if code is None:  # pragma: no cover - stop_tree killed it and it was reaped as an orphan
            code = -signal.SIGKILL
        say(MARKER + json.dumps({"reason": self.reason, "exit": code, "killed": self.killed,
                                 "shm_removed": removed}))
        return 128 - code if code < 0 else code


def _child_setup() -> None:
    # an ignored signal stays ignored across exec (handled ones are reset): give the child SIGINT back
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    watch_fd: int | None = None
    grace = 15.0
    while args and args[0] != "--":
        opt = args.pop(0)
        if opt == "--watch-fd" and args:
            watch_fd = int(args.pop(0))
        elif opt == "--grace" and args:
            grace = float(args.pop(0))
        else:
            print(f"hybridpd-keeper: unknown option {opt!r}", file=sys.stderr)
            return 2
    if not args or args[0] != "--" or len(args) < 2:
        print("usage: python -m hybridpd.launch.keeper [--watch-fd N] [--grace S] -- ARGV...", file=sys.stderr)
        return 2
    return Keeper(args[1:], watch_fd=watch_fd, grace_s=grace).run()


if __name__ == "__main__":
    sys.exit(main())
