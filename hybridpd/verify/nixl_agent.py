"""The rehearsal over real NIXL: one agent per rank, each in its own process (multiprocessing spawn).

With ``--device cuda`` every rank process holds its KV tensors on a GPU (one GPU can host several emulated
ranks, each a separate process and allocation; ``cuda:N,M`` puts P ranks on GPU N and D ranks on GPU M) and
registers them with NIXL as VRAM. Prefill ranks fill their KV-cache tensors, register them and serve (polling
notifications: agents run without a progress thread, see nixl-notes gotchas 1-2). Decode ranks register
theirs, add the P agents' metadata, prep the descriptor views exactly as vLLM does (``prep_xfer_dlist`` over
the full tables, ``make_prepped_xfer`` with the request's desc ids, one READ per source P rank) and check the
result in-process (``verdict.rank_result``). The parent only relays metadata and collects verdicts.

The NIXL calls themselves live in ``hybridpd.verify.nixl_wrap``; ``RankProcesses``, ``serve`` and ``connect`` are
the process plumbing the bench scripts reuse (``bench/_nixl_bench.py``: the calibration sweep and the
timed READ variants, hooked into ``run_nixl`` with ``bench=``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from hybridpd.errors import ExternalToolError
from hybridpd.verify import ucx_info
from hybridpd.verify.nixl_wrap import (
    Memory,
    Placement,
    Reader,
    check_devices,
    import_nixl,
    make_agent,
    nixl_available,
    parse_device,
    set_env,
)
from hybridpd.verify.rehearsal import Setup
from hybridpd.verify.verdict import RankResult, UcxReport

__all__ = ["TIMEOUT_S", "BenchContext", "Peer", "Placement", "RankProcesses", "check_devices", "connect", "nixl_available",
           "parse_device", "pin", "run_nixl", "serve", "ucx_report"]

TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Peer:
    """What a P rank tells the D ranks that read from it."""

    metadata: bytes
    bases: list[int]
    pid: int


@dataclass(frozen=True)
class BenchContext:
    """Handed to a ``run_nixl(bench=...)`` hook inside a D rank process, after its READ was checked."""

    reader: Reader
    memory: Memory
    reference: list[np.ndarray]  # D's tensors after the checked READ
    repeat: int
    peers: dict[int, Peer]


BenchHook = Callable[[BenchContext], dict[str, Any]]


def pin(slot: int) -> None:
    """With ``HYBRIDPD_PIN=1`` each rank process runs on its own CPU (every other one: skips SMT siblings on
    the usual numbering); slot = P rank, or 8 + D rank.  An experiment knob for the benchmark."""
    if os.environ.get("HYBRIDPD_PIN") == "1" and hasattr(os, "sched_setaffinity"):
        n = os.cpu_count() or 1
        os.sched_setaffinity(0, {(2 * slot) % n})


# ------------------------------------------------------------------------------ process plumbing


class RankProcesses:
    """Rank processes started with spawn, each with its own pipe; one deadline for every answer; each
    process's UCX log (protocol report on) in a folder: a temporary one, or ``$HYBRIDPD_UCX_LOG_DIR``
    (kept).  Use as a context manager: the processes are always reaped and the temporary folder removed."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self._ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._keep = os.environ.get("HYBRIDPD_UCX_LOG_DIR")
        self.logs = Path(self._keep) if self._keep else Path(tempfile.mkdtemp(prefix="hybridpd-ucx-"))
        self.logs.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for pr in self.procs:
            pr.join(timeout=10 if exc_type is None else 0.5)  # after a failure nobody will answer them
            if pr.is_alive():
                pr.terminate()
                pr.join(timeout=5)
        if not self._keep:
            shutil.rmtree(self.logs, ignore_errors=True)

    def log(self, name: str) -> str:
        return str(self.logs / f"{name}.log")

    def start(self, target: Callable[..., None], *args: Any) -> Connection:
        """Start ``target(conn, *args)`` in a new process; returns the parent's end of its pipe."""
        a, b = self._ctx.Pipe()
        pr = self._ctx.Process(target=target, args=(b, *args), daemon=True)
        pr.start()
        self.procs.append(pr)
        return a

    def recv(self, conn: Connection, who: str) -> tuple[Any, ...]:
        left = self.deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise ExternalToolError(f"{who} did not answer within {self.timeout_s:.0f} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise ExternalToolError(f"{who} failed:\n{msg[1]}")
        return tuple(msg)

    def join(self) -> None:
        for pr in self.procs:
            pr.join(timeout=10)


def ucx_report(path: str | Path) -> UcxReport:
    """The transports and operations UCX chose for READs, and its warnings, from a rank's UCX log."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        text = ""
    return UcxReport(read_transports=tuple(ucx_info.read_transports(text)),
                     read_operations=tuple(ucx_info.read_operations(text)), warnings=tuple(ucx_info.warnings(text)))


def serve(conn: Connection, name: str, memory: Memory, timeout_s: float = TIMEOUT_S) -> None:
    """A P rank: register ``memory``, send ("ready", Peer), poll notifications (which also progresses UCX's
    wire-up) until the parent says stop, then send ("done", notifications)."""
    agent = make_agent(name)
    reg = memory.register(agent)
    conn.send(("ready", Peer(agent.get_agent_metadata(), memory.bases, os.getpid())))
    notifs: list[tuple[str, bytes]] = []
    t0 = time.monotonic()
    while True:
        for k, msgs in agent.get_new_notifs().items():
            notifs.extend((str(k), m) for m in msgs)
        if conn.poll():
            conn.recv()
            break
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.0002)
    agent.deregister_memory(reg)
    conn.send(("done", [(k, m.decode(errors="replace")) for k, m in notifs]))


def connect(conn: Connection, name: str, memory: Memory) -> tuple[Any, Any, dict[int, Peer], dict[int, Any]]:
    """A D rank: register ``memory``, send ("ready", None), receive ("peers", {p_rank: Peer}) and add them.
    Returns (agent, registration, peers, NIXL names of the peers)."""
    agent = make_agent(name)
    reg = memory.register(agent)
    conn.send(("ready", None))
    kind, peers = conn.recv()
    if kind != "peers":
        raise RuntimeError(f"expected the peers' metadata, got {kind!r}")
    return agent, reg, peers, {pr: agent.add_remote_agent(p.metadata) for pr, p in peers.items()}


# ------------------------------------------------------------------------------- the rehearsal


def _prefill_main(conn: Connection, setup: Setup, rank: int, dev: str, ucx_log: str) -> None:
    try:
        set_env(dev != "cpu", ucx_log)
        pin(rank)
        from hybridpd.verify.rehearsal import fill_prefill

        serve(conn, f"p{rank}", Memory(fill_prefill(setup, rank), dev))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def _decode_main(conn: Connection, setup: Setup, rank: int, repeat: int, pl: Placement, ucx_log: str,
                 bench: BenchHook | None) -> None:
    try:
        set_env(pl.on_gpu, ucx_log)
        pin(8 + rank)
        from hybridpd.verify.rehearsal import init_decode, transfer_views
        from hybridpd.verify.verdict import rank_result

        memory = Memory(init_decode(setup), pl.d)
        agent, reg, peers, names = connect(conn, f"d{rank}", memory)
        p_bases = {pr: p.bases for pr, p in peers.items()}
        views = transfer_views(setup, rank, p_bases, memory.bases)
        reader = Reader(agent=agent, names=names, views=views, local_mem=memory.mem, local_dev=memory.dev_id,
                        remote_mem=Placement.mem(pl.p), remote_dev=Placement.index(pl.p))
        reader.prep()
        n = max(1, repeat)
        times, tel = [], None
        for it in range(n):
            elapsed, tel = reader.read(f"d{rank}-done".encode() if it == n - 1 else b"")
            times.append(elapsed)
        after = memory.host()
        res = replace(rank_result(setup, rank, views, after, p_bases, telemetry=tel, elapsed_s=times[-1]),
                      first_elapsed_s=times[0], read_times_s=tuple(times), memory=memory.mem)
        if bench is not None:
            # timed one D rank at a time (the parent says when): in production each D rank has its own GPU
            # (or cores), while here several share them
            conn.send(("verified", None))
            conn.recv()
            res = replace(res, bench=bench(BenchContext(reader=reader, memory=memory, reference=after, repeat=n,
                                                        peers=peers)))
        reader.close()
        agent.deregister_memory(reg)
        conn.send(("result", res))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def run_nixl(setup: Setup, *, repeat: int = 1, device: Placement | None = None,
             bench: BenchHook | None = None) -> list[RankResult]:
    """Spawn P and D rank processes, run the READs, return the per-D-rank verdicts.

    Each D rank reads ``repeat`` times (the last READ is the one checked). Every verdict gets ``ucx`` (the
    transports UCX chose for the READs, and its warnings). With ``bench`` (a picklable function), each D rank
    then calls it, one D rank at a time, and its answer lands in the verdict's ``bench``."""
    device = device or Placement()
    import_nixl()  # fail early, in the parent, with the install hint
    check_devices(device)
    set_env()
    assert setup.plan.routes is not None
    with RankProcesses() as rp:
        p_conns = {r: rp.start(_prefill_main, setup, r, device.p, rp.log(f"p{r}")) for r in range(setup.p.tp)}
        d_conns = {r: rp.start(_decode_main, setup, r, repeat, device, rp.log(f"d{r}"), bench)
                   for r in range(setup.d.tp)}
        peers: dict[int, Peer] = {r: rp.recv(c, f"prefill rank {r}")[1] for r, c in p_conns.items()}
        for r, c in d_conns.items():
            rp.recv(c, f"decode rank {r}")
        for r, c in d_conns.items():
            c.send(("peers", {s.p_rank: peers[s.p_rank] for s in setup.plan.routes[r].sources}))
        if bench is not None:
            for r, c in d_conns.items():
                rp.recv(c, f"decode rank {r}")
            results: list[RankResult] = []
            for r, c in d_conns.items():
                c.send("go")
                results.append(rp.recv(c, f"decode rank {r}")[1])
        else:
            results = [rp.recv(c, f"decode rank {r}")[1] for r, c in d_conns.items()]
        for c in p_conns.values():
            c.send("stop")
        for r, c in p_conns.items():
            rp.recv(c, f"prefill rank {r}")
        rp.join()
        return [replace(res, ucx=ucx_report(rp.log(f"d{r}"))) for r, res in enumerate(results)]
