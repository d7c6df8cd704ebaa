"""Bench-only NIXL code shared by bench_rehearsal.py and bench_gpu.py (importable because bench/ is the
script's folder; the spawned rank processes get the same sys.path).

* ``variants``: a ``run_nixl(bench=...)`` hook.  Inside each D rank process, after the rehearsal's READ was
  checked, it times interleaved rounds of: the rehearsal's READ (vLLM's per-request work), the same
  descriptors as one ``initialize_xfer`` READ re-posted ("bare"), that with descriptors contiguous on both
  sides coalesced, and on DRAM a numpy copy of the same number of bytes ("memcpy") and a raw
  ``process_vm_readv`` of the request's descriptors from the P process ("vm_readv": what the kernel's cma
  copy costs without NIXL/UCX).  Bare and coalesced must first leave D byte-identical to the rehearsal.
* ``read_sweep``: bare NIXL READ times for equal-size descriptors, the points a calibration is fitted to.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hybridpd.verify.nixl_agent import BenchContext, Peer, RankProcesses, check_devices, connect, pin, serve, ucx_report
from hybridpd.verify.nixl_wrap import Memory, Placement, Reader, import_nixl, make_agent, nx3, post_and_wait, set_env, wait
from hybridpd.verify.rehearsal import D_INIT

WARM_S = 0.3


def warm(step: Callable[[], Any], seconds: float = WARM_S) -> None:
    """Repeat ``step`` for ``seconds`` (at least once) before timing: registration caches and IPC mappings
    fill on first use, and an idle GPU's clocks take a moment to ramp (per-descriptor cost was seen bimodal,
    ~5.5 vs ~8 us on an H200, when timing started cold)."""
    end = time.perf_counter() + seconds
    step()
    while time.perf_counter() < end:
        step()


def coalesce(local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge descriptors that are contiguous on BOTH sides (in local-address order): the what-if of a
    connector that registers x|B|C|SSM of a DS Mamba page (homogeneous TP) as one range."""
    if local_addr.size == 0:
        return local_addr, remote_addr, length
    order = np.argsort(local_addr, kind="stable")
    la, ra, ln = local_addr[order], remote_addr[order], length[order]
    joined = (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
    starts = np.flatnonzero(np.concatenate([[True], ~joined]))
    return la[starts], ra[starts], np.add.reduceat(ln, starts).astype(ln.dtype)


def _request(ctx: BenchContext, coalesced: bool) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Per source P rank: (p_rank, local addrs, remote addrs, lengths) of the request's descriptors."""
    out = []
    for v in ctx.reader.views:
        la, ra, ln = v.local.addr[v.local_ids], v.remote.addr[v.remote_ids], v.remote.length[v.remote_ids]
        if coalesced:
            la, ra, ln = coalesce(la, ra, ln)
        out.append((v.p_rank, la, ra, ln))
    return out


def _bare_handles(ctx: BenchContext, coalesced: bool) -> tuple[list[Any], int]:
    r = ctx.reader
    handles, n = [], 0
    for p_rank, la, ra, ln in _request(ctx, coalesced):
        ld = r.agent.get_xfer_descs(nx3(la, ln, r.local_dev), r.local_mem)
        rd = r.agent.get_xfer_descs(nx3(ra, ln, r.remote_dev), r.remote_mem)
        handles.append(r.agent.initialize_xfer("READ", ld, rd, r.names[p_rank], b""))
        n += len(ln)
    return handles, n


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_readv(ctx: BenchContext) -> Callable[[], None] | None:
    """A raw process_vm_readv of the request's descriptors (1024 per call, the kernel's IOV_MAX)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    calls = []
    for p_rank, la, ra, ln in _request(ctx, coalesced=False):
        for k in range(0, len(ln), 1024):
            sl = slice(k, k + 1024)
            n = len(ln[sl])
            liov = (_Iovec * n)(*[_Iovec(int(a), int(b)) for a, b in zip(la[sl], ln[sl], strict=True)])
            riov = (_Iovec * n)(*[_Iovec(int(a), int(b)) for a, b in zip(ra[sl], ln[sl], strict=True)])
            calls.append((ctx.peers[p_rank].pid, liov, riov, n, int(ln[sl].sum())))

    def step() -> None:
        for pid, liov, riov, n, nbytes in calls:
            got = fn(pid, liov, ctypes.c_ulong(n), riov, ctypes.c_ulong(n), ctypes.c_ulong(0))
            if got != nbytes:
                raise OSError(ctypes.get_errno(), f"process_vm_readv moved {got} of {nbytes} B")

    try:
        step()
    except OSError:
        return None  # e.g. ptrace restrictions: the variant is left out
    return step


def _memcpy_descs(ctx: BenchContext) -> Callable[[], None]:
    """memmove of the request's descriptors inside the D process: from a local shadow of each P tensor (same
    offsets) to D's own addresses -- the same scatter/gather pattern as the READ, without a second process."""
    calls = []
    for p_rank, la, ra, ln in _request(ctx, coalesced=False):
        bases = np.array(sorted(ctx.peers[p_rank].bases), dtype=np.uint64)
        j = np.searchsorted(bases, ra, side="right") - 1
        off = ra - bases[j]
        shadow = {int(k): np.full(int((off[j == k] + ln[j == k]).max()), 1, dtype=np.uint8) for k in np.unique(j)}
        src = np.array([shadow[int(k)].ctypes.data for k in j], dtype=np.uint64) + off
        calls.append((la.astype(np.int64).tolist(), src.astype(np.int64).tolist(), ln.astype(np.int64).tolist(), shadow))

    def step() -> None:
        for dst, src, ln, _ in calls:
            for d, s, n in zip(dst, src, ln, strict=True):
                ctypes.memmove(d, s, n)

    return step


def _alt_reader(ctx: BenchContext, env: dict[str, str]) -> tuple[Reader, Any]:
    """A second D agent, created under other UCX settings (UCX reads them when an agent's context is made),
    over the same memory and descriptor lists: the rehearsal's READ under both settings, interleaved."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        agent = make_agent(f"{ctx.reader.agent.name}-alt")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    reg = ctx.memory.register(agent)
    r = ctx.reader
    alt = Reader(agent=agent, names={pr: agent.add_remote_agent(p.metadata) for pr, p in ctx.peers.items()},
                 views=r.views, local_mem=r.local_mem, local_dev=r.local_dev, remote_mem=r.remote_mem,
                 remote_dev=r.remote_dev)
    alt.prep()
    return alt, reg


def _identical(memory: Memory, reference: list[np.ndarray]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(memory.host(), reference, strict=True))


def variants(ctx: BenchContext, alt_ucx: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``run_nixl(bench=variants)`` hook: see the module docstring.  Returns, per variant, the timed
    rounds (``read_times_s``, all the same length, round i of every variant run back to back).  With
    ``alt_ucx`` (bind it with functools.partial) the rehearsal's READ is also timed from a second agent made
    under those UCX settings (``rehearsal_alt``)."""
    r, memory = ctx.reader, ctx.memory
    out: dict[str, Any] = {}
    handles = {name: _bare_handles(ctx, c) for name, c in (("bare", False), ("coalesced", True))}
    for name, (hs, n) in handles.items():
        memory.fill(D_INIT)
        post_and_wait(r.agent, hs)
        out[name] = {"descriptors": n, "read_times_s": [], "identical": _identical(memory, ctx.reference)}
    steps: dict[str, Callable[[], Any]] = {"rehearsal": r.read}
    alt = None
    if alt_ucx:
        alt, alt_reg = _alt_reader(ctx, alt_ucx)
        memory.fill(D_INIT)
        alt.read()
        out["rehearsal_alt"] = {"ucx": alt_ucx, "read_times_s": [], "identical": _identical(memory, ctx.reference)}
        steps["rehearsal_alt"] = alt.read
    steps.update({name: (lambda hs=hs: post_and_wait(r.agent, hs)) for name, (hs, _) in handles.items()})
    if memory.dev == "cpu":
        nbytes = int(sum(int(ln.sum()) for *_, ln in _request(ctx, coalesced=False)))
        src = np.full(nbytes, 1, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        steps["memcpy"] = lambda: np.copyto(dst, src)
        out["memcpy"] = {"bytes": nbytes, "read_times_s": []}
        steps["memcpy_descs"] = _memcpy_descs(ctx)
        out["memcpy_descs"] = {"read_times_s": []}
        raw = _vm_readv(ctx)
        if raw is not None:
            steps["vm_readv"] = raw
            out["vm_readv"] = {"read_times_s": []}
    out.setdefault("rehearsal", {"read_times_s": []})
    warm(lambda: [f() for f in steps.values()])
    for _ in range(ctx.repeat):
        for name, f in steps.items():
            t0 = time.perf_counter()
            got = f()
            call = time.perf_counter() - t0
            if isinstance(got, tuple):  # Reader.read: its own READ time (first make_prepped_xfer .. last DONE)
                out[name]["read_times_s"].append(got[0])
                out[name].setdefault("call_times_s", []).append(call)  # + telemetry and handle release
            else:
                out[name]["read_times_s"].append(call)
    for hs, _ in handles.values():
        for h in hs:
            r.agent.release_xfer_handle(h)
    if alt is not None:
        alt.close()
        alt.agent.deregister_memory(alt_reg)
    return out


# ---------------------------------------------------------------------------------- calibration sweep


def sweep_target(size: int, total: int, max_descs: int) -> int:
    return max(4, min(max_descs, total // size))


def sweep_region_bytes(sizes: list[int], total: int, max_descs: int, regions: int, gap: int) -> int:
    """Bytes of each of ``regions`` allocations: descriptor i of a size lives in region i % regions."""
    return max(gap * s * -(-sweep_target(s, total, max_descs) // regions) for s in sizes)


def sweep_addrs(bases: list[int], n: int, size: int, gap: int) -> np.ndarray:
    """Addresses of n descriptors round-robin over the regions, each followed by (gap - 1) x size unused."""
    i = np.arange(n, dtype=np.uint64)
    k = np.uint64(len(bases))
    return np.asarray(bases, dtype=np.uint64)[(i % k).astype(np.int64)] + (i // k) * np.uint64(gap * size)


def _sweep_prefill(conn: Any, dev: str, sizes: list[int], total: int, max_descs: int, regions: int) -> None:
    """Holds the source ranges (each followed by a gap of its size) in ``regions`` separate allocations."""
    import traceback

    try:
        set_env(dev != "cpu")
        pin(0)
        nbytes = sweep_region_bytes(sizes, total, max_descs, regions, 2)
        rng = np.random.default_rng(7)
        serve(conn, "sweep-p", Memory([rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(regions)], dev))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def _sweep_decode(conn: Any, pl: Placement, sizes: list[int], total: int, max_descs: int, repeat: int,
                  regions: int, ucx_log: str) -> None:
    """For each size: n descriptors READ from P's strided ranges into D's packed ranges, both spread over
    ``regions`` allocations (a KV cache is one allocation per layer-slot tensor)."""
    import traceback

    try:
        set_env(pl.on_gpu, ucx_log)
        pin(8)
        nbytes = sweep_region_bytes(sizes, total, max_descs, regions, 1)
        mem = Memory([np.zeros(nbytes, dtype=np.uint8) for _ in range(regions)], pl.d)
        agent, reg, peers, names = connect(conn, "sweep-d", mem)
        p_bases, name = peers[0].bases, names[0]
        rows = []
        for size in sizes:
            n = sweep_target(size, total, max_descs)
            ln = np.full(n, size, dtype=np.uint64)
            ld = agent.get_xfer_descs(nx3(sweep_addrs(mem.bases, n, size, 1), ln, mem.dev_id), mem.mem)
            rd = agent.get_xfer_descs(nx3(sweep_addrs(p_bases, n, size, 2), ln, Placement.index(pl.p)),
                                      Placement.mem(pl.p))
            h = agent.initialize_xfer("READ", ld, rd, name, b"")
            warm(lambda h=h: wait(agent, h, agent.transfer(h)))
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                wait(agent, h, agent.transfer(h))
                times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
            rows.append({"descriptor_bytes": size, "descriptors": n, "bytes": n * size, "times_s": times})
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
        conn.send(("result", rows))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def read_sweep(device: Placement, sizes: list[int], *, total: int = 256 << 20, max_descs: int = 4096,
               repeat: int = 5, regions: int = 1) -> dict[str, Any]:
    """Bare NIXL READ times between two processes for equal-size descriptors: the points a calibration
    (``n_desc * c + bytes / bw``) is fitted to.  ``rows``: descriptor size, count, bytes, times per size;
    ``ucx``: the transports UCX chose for the READs."""
    import_nixl()
    check_devices(device)
    with RankProcesses() as rp:
        pc = rp.start(_sweep_prefill, device.p, sizes, total, max_descs, regions)
        dc = rp.start(_sweep_decode, device, sizes, total, max_descs, repeat, regions, rp.log("sweep-d"))
        peer: Peer = rp.recv(pc, "sweep prefill")[1]
        rp.recv(dc, "sweep decode")
        dc.send(("peers", {0: peer}))
        rows: list[dict[str, Any]] = rp.recv(dc, "sweep decode")[1]
        pc.send("stop")
        rp.recv(pc, "sweep prefill")
        rp.join()
        return {"rows": rows, "ucx": ucx_report(rp.log("sweep-d")).as_dict()}
