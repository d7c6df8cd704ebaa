"""One NIXL agent per rank, each in its own process (multiprocessing spawn); KV tensors in DRAM or VRAM.

With ``--device cuda`` every rank process holds its KV tensors on a GPU (one GPU can host several emulated
ranks, each a separate process and allocation; ``cuda:N,M`` puts P ranks on GPU N and D ranks on GPU M) and
registers them with NIXL as VRAM. Prefill ranks fill their KV-cache tensors, register them and serve (polling
notifications: agents run without a progress thread, see nixl-notes gotchas 1-2). Decode ranks register
theirs, add the P agents' metadata, prep the descriptor views exactly as vLLM does (``prep_xfer_dlist`` over
the full tables, ``make_prepped_xfer`` with the request's desc ids, one READ per source P rank) and check the
result in-process (``rehearsal.rank_result``). The parent only relays metadata and collects verdicts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ucx_info
from .errors import ExternalToolError, UsageError
from .gpus import require_gpu
from .rehearsal import Setup

TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Placement:
    """Where the rehearsal's KV tensors live: ``cpu`` (DRAM) or ``cuda:N`` (VRAM), per side."""

    p: str = "cpu"
    d: str = "cpu"

    @staticmethod
    def mem(dev: str) -> str:
        return "DRAM" if dev == "cpu" else "VRAM"

    @staticmethod
    def index(dev: str) -> int:
        return 0 if dev == "cpu" else int(dev.split(":")[1])

    @property
    def on_gpu(self) -> bool:
        return self.p != "cpu" or self.d != "cpu"

    def describe(self) -> str:
        if not self.on_gpu:
            return "DRAM"
        return f"VRAM (P ranks on {self.p}, D ranks on {self.d})" if self.p != self.d else f"VRAM ({self.p})"


def parse_device(spec: str) -> Placement:
    """``cpu``, ``cuda`` (= cuda:0), ``cuda:N``, or ``cuda:N,M`` (P ranks on GPU N, D ranks on GPU M)."""
    s = spec.strip().lower()
    if s == "cpu":
        return Placement()
    parts = [x.strip() for x in s.split(",")]
    idx: list[int] = []
    for part in parts:
        m = re.fullmatch(r"cuda(?::(\d+))?", part) or re.fullmatch(r"(\d+)", part)
        if m is None or len(parts) > 2:
            raise UsageError(f"unknown device {spec!r}", field="--device",
                             fix="use cpu, cuda, cuda:N, or cuda:N,M (P ranks on GPU N, D ranks on GPU M)")
        idx.append(int(m.group(1) or 0))
    return Placement(p=f"cuda:{idx[0]}", d=f"cuda:{idx[-1]}")


def check_devices(pl: Placement) -> None:
    """Fail in the parent, with one line, when the GPUs asked for are not there."""
    if pl.on_gpu:
        require_gpu(max(Placement.index(pl.p), Placement.index(pl.d)), pl.p if pl.p == pl.d else f"{pl.p},{pl.d}")


def _pin(slot: int) -> None:
    """With ``HYBRIDPD_PIN=1`` each rank process runs on its own CPU (every other one: skips SMT siblings on
    the usual numbering); slot = P rank, or 8 + D rank.  An experiment knob for the benchmark."""
    if os.environ.get("HYBRIDPD_PIN") == "1" and hasattr(os, "sched_setaffinity"):
        n = os.cpu_count() or 1
        os.sched_setaffinity(0, {(2 * slot) % n})


def _env(gpu: bool = False, ucx_log: str | None = None) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    if gpu:
        # without it UCX disables cuda_ipc READs when it sees no NVLink and falls back to TCP through host
        # memory (~0.4 GB/s on an H200; nixl-notes section 5)
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    if ucx_log:
        os.environ["UCX_PROTO_INFO"] = "y"
        os.environ["UCX_LOG_FILE"] = ucx_log


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) without importing torch when possible."""
    _env()
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
        except ImportError as e:
            raise ExternalToolError(f"NIXL is not installed ({e})",
                                    fix="pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1") from None
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    try:
        import_nixl()
    except ExternalToolError:
        return False
    return True


def _agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = import_nixl()
    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, capture_telemetry=True,
                            backends=["UCX"])
    return nixl_agent(name, cfg)


class _Memory:
    """One rank's KV tensors: numpy arrays in DRAM, or uint8 torch tensors on one GPU."""

    def __init__(self, arrays: list[Any], dev: str) -> None:
        self.dev = dev
        self.mem = Placement.mem(dev)
        self.dev_id = Placement.index(dev)
        if dev == "cpu":
            self.tensors = arrays
            self.bases = [a.ctypes.data for a in arrays]
        else:
            import torch

            torch.cuda.set_device(self.dev_id)
            self.tensors = [torch.from_numpy(a).to(dev) for a in arrays]
            torch.cuda.synchronize(dev)
            self.bases = [t.data_ptr() for t in self.tensors]

    def register(self, agent: Any) -> Any:
        sizes = [a.nbytes if self.dev == "cpu" else a.numel() for a in self.tensors]
        return agent.register_memory([(b, n, self.dev_id, "") for b, n in zip(self.bases, sizes, strict=True)],
                                     self.mem)

    def host(self) -> list[Any]:
        if self.dev == "cpu":
            return self.tensors
        import torch

        torch.cuda.synchronize(self.dev)
        return [t.cpu().numpy() for t in self.tensors]

    def fill(self, value: int) -> None:
        for t in self.tensors:
            t.fill(value) if self.dev == "cpu" else t.fill_(value)
        if self.dev != "cpu":
            import torch

            torch.cuda.synchronize(self.dev)  # UCX copies on its own streams: the fill must land first


def _prefill_main(setup: Setup, rank: int, conn: Any, dev: str = "cpu", ucx_log: str | None = None) -> None:
    try:
        _env(dev != "cpu", ucx_log)
        _pin(rank)
        from .rehearsal import fill_prefill

        memory = _Memory(fill_prefill(setup, rank), dev)
        agent = _agent(f"p{rank}")
        reg = memory.register(agent)
        conn.send(("ready", agent.get_agent_metadata(), memory.bases))
        notifs: list[tuple[str, bytes]] = []
        t0 = time.monotonic()
        while True:
            for k, msgs in agent.get_new_notifs().items():
                notifs.extend((str(k), m) for m in msgs)
            if conn.poll():
                conn.recv()
                break
            if time.monotonic() - t0 > TIMEOUT_S:
                break
            time.sleep(0.0002)
        agent.deregister_memory(reg)
        conn.send(("done", [(k, m.decode(errors="replace")) for k, m in notifs]))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", traceback.format_exc()))


def _telemetry(agent: Any, handle: Any) -> dict[str, int] | None:
    try:
        t = agent.get_xfer_telemetry(handle)
        return {"bytes": int(t.totalBytes), "descriptors": int(t.descCount), "xfer_us": int(t.xferDuration)}
    except Exception:  # noqa: BLE001 - telemetry is optional
        return None


def _nx3(addr: Any, length: Any, dev_id: int) -> Any:
    import numpy as np

    a = np.zeros((len(addr), 3), dtype=np.uint64)
    a[:, 0], a[:, 1], a[:, 2] = addr, length, dev_id
    return a


@dataclass
class _Reader:
    """A D rank's NIXL side: the agent, its peers, and the descriptor lists prepped once (as vLLM does at
    handshake).  ``read`` is vLLM's per-request work: make_prepped_xfer per source P rank, post, wait."""

    agent: Any
    names: dict[int, Any]
    views: list[Any]
    local_mem: str
    local_dev: int
    remote_mem: str
    remote_dev: int
    prepped: list[tuple[Any, Any]] = field(default_factory=list)

    def prep(self) -> None:
        for v in self.views:
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _nx3(v.local.addr, v.local.length, self.local_dev),
                                            self.local_mem)
            rh = self.agent.prep_xfer_dlist(self.names[v.p_rank], _nx3(v.remote.addr, v.remote.length,
                                                                       self.remote_dev), self.remote_mem)
            self.prepped.append((lh, rh))

    def read(self, notif: bytes = b"") -> tuple[float, dict[str, int] | None]:
        import numpy as np

        t0 = time.perf_counter()
        handles = []
        for v, (lh, rh) in zip(self.views, self.prepped, strict=True):
            h = self.agent.make_prepped_xfer("READ", lh, v.local_ids.astype(np.int32), rh,
                                             v.remote_ids.astype(np.int32), notif)
            handles.append((h, self.agent.transfer(h)))
        for h, st in handles:
            _wait(self.agent, h, st)
        elapsed = time.perf_counter() - t0
        tel: dict[str, int] | None = {"bytes": 0, "descriptors": 0, "xfer_us": 0}
        for h, _ in handles:
            t = _telemetry(self.agent, h)
            if t is None or tel is None:
                tel = None
            else:
                tel = {k: tel[k] + t[k] for k in tel}
            self.agent.release_xfer_handle(h)
        return elapsed, tel

    def bare_handles(self, coalesced: bool) -> list[Any]:
        """Plain ``initialize_xfer`` READs over the request's descriptors (optionally coalesced)."""
        from .rehearsal import coalesce

        out = []
        for v in self.views:
            la, ra, ln = (v.local.addr[v.local_ids], v.remote.addr[v.remote_ids], v.remote.length[v.remote_ids])
            if coalesced:
                la, ra, ln = coalesce(la, ra, ln)
            ld = self.agent.get_xfer_descs(_nx3(la, ln, self.local_dev), self.local_mem)
            rd = self.agent.get_xfer_descs(_nx3(ra, ln, self.remote_dev), self.remote_mem)
            out.append((self.agent.initialize_xfer("READ", ld, rd, self.names[v.p_rank], b""), len(ln)))
        return out

    def post(self, handles: list[Any]) -> float:
        t0 = time.perf_counter()
        states = [(h, self.agent.transfer(h)) for h, _ in handles]
        for h, st in states:
            _wait(self.agent, h, st)
        return time.perf_counter() - t0

    def close(self) -> None:
        for lh, rh in self.prepped:
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
        for n in self.names.values():
            self.agent.remove_remote_agent(n)


def _wait(agent: Any, h: Any, st: str) -> None:
    t1 = time.monotonic()
    while st == "PROC":
        st = agent.check_xfer_state(h)
        if time.monotonic() - t1 > 60:
            raise TimeoutError("NIXL READ still in progress after 60 s")
    if st != "DONE":
        raise RuntimeError(f"NIXL READ ended in state {st}")


def _decode_main(setup: Setup, rank: int, conn: Any, repeat: int = 1, pl: Placement = Placement(),
                 ucx_log: str | None = None, bench: bool = False) -> None:
    try:
        _env(pl.on_gpu, ucx_log)
        _pin(8 + rank)
        from .rehearsal import init_decode, rank_result, transfer_views

        memory = _Memory(init_decode(setup), pl.d)
        agent = _agent(f"d{rank}")
        reg = memory.register(agent)
        conn.send(("ready", None, memory.bases))
        kind, p_info = conn.recv()
        assert kind == "peers"
        names = {pr: agent.add_remote_agent(md) for pr, (md, _) in p_info.items()}
        p_bases = {pr: bases for pr, (_, bases) in p_info.items()}
        views = transfer_views(setup, rank, p_bases, memory.bases)
        reader = _Reader(agent=agent, names=names, views=views, local_mem=memory.mem, local_dev=memory.dev_id,
                         remote_mem=Placement.mem(pl.p), remote_dev=Placement.index(pl.p))
        reader.prep()
        n = max(1, repeat)
        times, tel = [], None
        for it in range(n):
            elapsed, tel = reader.read(f"d{rank}-done".encode() if it == n - 1 else b"")
            times.append(elapsed)
        after = memory.host()
        res = rank_result(setup, rank, views, after, p_bases, telemetry=tel, elapsed_s=times[-1])
        res["first_elapsed_s"] = times[0]
        res["read_times_s"] = times
        res["memory"] = memory.mem
        if bench:
            # timed one D rank at a time (the parent says when): in production each D rank has its own GPU,
            # while here several may share one
            conn.send(("verified", None))
            conn.recv()
            res["bench"] = _bench_variants(reader, memory, after, n)
        reader.close()
        agent.deregister_memory(reg)
        conn.send(("result", res))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


WARM_S = 0.3


def _warm(step: Any, seconds: float = WARM_S) -> None:
    """Repeat ``step`` for ``seconds`` (at least once) before timing: registration caches and IPC mappings
    fill on first use, and an idle GPU's clocks take a moment to ramp (per-descriptor cost was seen bimodal,
    ~5.5 vs ~8 us on an H200, when timing started cold)."""
    end = time.perf_counter() + seconds
    step()
    while time.perf_counter() < end:
        step()


def _bench_variants(reader: _Reader, memory: _Memory, reference: list[Any], n: int) -> dict[str, Any]:
    """The same request as bare NIXL READs (same descriptors, ``initialize_xfer`` once, then re-posted),
    and with descriptors contiguous on both sides coalesced.  Each variant first re-reads into a reset D
    buffer that must end byte-identical to the rehearsal's; then the three are timed interleaved
    (rehearsal, bare, coalesced, n rounds) so they share whatever else the GPU is doing."""
    import numpy as np

    from .rehearsal import D_INIT

    out: dict[str, Any] = {}
    handles = {name: reader.bare_handles(c) for name, c in (("bare", False), ("coalesced", True))}
    for name, hs in handles.items():
        memory.fill(D_INIT)
        reader.post(hs)
        out[name] = {"descriptors": sum(k for _, k in hs), "read_times_s": [],
                     "identical": all(np.array_equal(a, b) for a, b in zip(memory.host(), reference, strict=True))}
    out["rehearsal"] = {"read_times_s": []}
    _warm(lambda: (reader.read(), *(reader.post(hs) for hs in handles.values())))
    for _ in range(n):
        out["rehearsal"]["read_times_s"].append(reader.read()[0])
        for name, hs in handles.items():
            out[name]["read_times_s"].append(reader.post(hs))
    for hs in handles.values():
        for h, _ in hs:
            reader.agent.release_xfer_handle(h)
    return out


def _recv(conn: Any, who: str, deadline: float) -> tuple[Any, ...]:
    left = deadline - time.monotonic()
    if left <= 0 or not conn.poll(left):
        raise ExternalToolError(f"{who} did not answer within {TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise ExternalToolError(f"{who} failed:\n{msg[1]}")
    return msg


def run_nixl(setup: Setup, *, repeat: int = 1, device: Placement = Placement(),
             bench: bool = False) -> list[dict[str, Any]]:
    """Spawn P and D rank processes, run the READs, return the per-D-rank verdicts.

    Each rank's UCX log goes to a file with UCX's protocol report switched on (a temporary folder, or
    ``$HYBRIDPD_UCX_LOG_DIR``, which is kept); every D rank's verdict gets ``ucx`` (the transports UCX chose
    for the READs, and its warnings)."""
    import multiprocessing as mp

    import_nixl()  # fail early, in the parent, with the install hint
    check_devices(device)
    _env()
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    p_conns, d_conns = {}, {}
    deadline = time.monotonic() + TIMEOUT_S
    keep = os.environ.get("HYBRIDPD_UCX_LOG_DIR")
    logs = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="hybridpd-ucx-"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for r in range(setup.p.tp):
            a, b = ctx.Pipe()
            pr = ctx.Process(target=_prefill_main, args=(setup, r, b, device.p, str(logs / f"p{r}.log")), daemon=True)
            pr.start()
            procs.append(pr)
            p_conns[r] = a
        for r in range(setup.d.tp):
            a, b = ctx.Pipe()
            pr = ctx.Process(target=_decode_main, args=(setup, r, b, repeat, device, str(logs / f"d{r}.log"), bench),
                             daemon=True)
            pr.start()
            procs.append(pr)
            d_conns[r] = a
        p_info = {}
        for r, c in p_conns.items():
            _, md, bases = _recv(c, f"prefill rank {r}", deadline)
            p_info[r] = (md, bases)
        for r, c in d_conns.items():
            _recv(c, f"decode rank {r}", deadline)
        assert setup.plan.routes is not None
        for r, c in d_conns.items():
            need = {s.p_rank for s in setup.plan.routes[r].sources}
            c.send(("peers", {pr: p_info[pr] for pr in need}))
        if bench:
            for r, c in d_conns.items():
                _recv(c, f"decode rank {r}", deadline)
            results = []
            for r, c in d_conns.items():
                c.send("go")
                results.append(_recv(c, f"decode rank {r}", deadline)[1])
        else:
            results = [_recv(c, f"decode rank {r}", deadline)[1] for r, c in d_conns.items()]
        for c in p_conns.values():
            c.send("stop")
        for r, c in p_conns.items():
            _recv(c, f"prefill rank {r}", deadline)
        for pr in procs:
            pr.join(timeout=10)
        for r, res in enumerate(results):
            res["ucx"] = _ucx_report(logs / f"d{r}.log")
        return results
    finally:
        _reap(procs)
        if not keep:
            shutil.rmtree(logs, ignore_errors=True)


def _reap(procs: list[Any]) -> None:
    for pr in procs:
        pr.join(timeout=10)
        if pr.is_alive():
            pr.terminate()
            pr.join(timeout=5)


def _ucx_report(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    return {"read_transports": ucx_info.read_transports(text), "read_operations": ucx_info.read_operations(text),
            "warnings": ucx_info.warnings(text)}


# ---------------------------------------------------------------------------------- calibration sweep


def _sweep_target(size: int, total: int, max_descs: int) -> int:
    return max(4, min(max_descs, total // size))


def _sweep_region_bytes(sizes: list[int], total: int, max_descs: int, regions: int, gap: int) -> int:
    """Bytes of each of ``regions`` allocations: descriptor i of a size lives in region i % regions."""
    return max(gap * s * -(-_sweep_target(s, total, max_descs) // regions) for s in sizes)


def _sweep_addrs(bases: list[int], n: int, size: int, gap: int) -> Any:
    """Addresses of n descriptors round-robin over the regions, each followed by (gap - 1) x size unused."""
    import numpy as np

    i = np.arange(n, dtype=np.uint64)
    k = np.uint64(len(bases))
    return np.asarray(bases, dtype=np.uint64)[(i % k).astype(np.int64)] + (i // k) * np.uint64(gap * size)


def _sweep_prefill(conn: Any, dev: str, sizes: list[int], total: int, max_descs: int, regions: int) -> None:
    """Holds the source ranges (each followed by a gap of its size) in ``regions`` separate allocations."""
    try:
        import numpy as np

        _env(dev != "cpu")
        _pin(0)
        nbytes = _sweep_region_bytes(sizes, total, max_descs, regions, 2)
        rng = np.random.default_rng(7)
        mem = _Memory([rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(regions)], dev)
        agent = _agent("sweep-p")
        reg = mem.register(agent)
        conn.send(("ready", agent.get_agent_metadata(), mem.bases))
        while not conn.poll(0.001):
            agent.get_new_notifs()
        conn.recv()
        agent.deregister_memory(reg)
        conn.send(("done",))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


def _sweep_decode(conn: Any, pl: Placement, sizes: list[int], total: int, max_descs: int, repeat: int,
                  regions: int, ucx_log: str) -> None:
    """For each size: n descriptors READ from P's strided ranges into D's packed ranges, both spread over
    ``regions`` allocations (a KV cache is one allocation per layer-slot tensor)."""
    try:
        import numpy as np

        _env(pl.on_gpu, ucx_log)
        _pin(8)
        nbytes = _sweep_region_bytes(sizes, total, max_descs, regions, 1)
        mem = _Memory([np.zeros(nbytes, dtype=np.uint8) for _ in range(regions)], pl.d)
        agent = _agent("sweep-d")
        reg = mem.register(agent)
        conn.send(("ready", None, mem.bases))
        _, (md, p_bases) = conn.recv()
        name = agent.add_remote_agent(md)
        rows = []
        for size in sizes:
            n = _sweep_target(size, total, max_descs)
            ln = np.full(n, size, dtype=np.uint64)
            ld = agent.get_xfer_descs(_nx3(_sweep_addrs(mem.bases, n, size, 1), ln, mem.dev_id), mem.mem)
            rd = agent.get_xfer_descs(_nx3(_sweep_addrs(p_bases, n, size, 2), ln, Placement.index(pl.p)),
                                      Placement.mem(pl.p))
            h = agent.initialize_xfer("READ", ld, rd, name, b"")
            _warm(lambda h=h: _wait(agent, h, agent.transfer(h)))
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                _wait(agent, h, agent.transfer(h))
                times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
            rows.append({"descriptor_bytes": size, "descriptors": n, "bytes": n * size, "times_s": times})
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
        conn.send(("result", rows))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


def read_sweep(device: Placement, sizes: list[int], *, total: int = 256 << 20, max_descs: int = 4096,
               repeat: int = 5, regions: int = 1) -> dict[str, Any]:
    """Bare NIXL READ times between two processes for equal-size descriptors: the points a calibration
    (``n_desc * c + bytes / bw``) is fitted to.  ``rows``: descriptor size, count, bytes, times per size;
    ``ucx``: the transports UCX chose for the READs."""
    import multiprocessing as mp

    import_nixl()
    check_devices(device)
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + TIMEOUT_S
    pa, pb = ctx.Pipe()
    da, db = ctx.Pipe()
    logs = Path(tempfile.mkdtemp(prefix="hybridpd-ucx-"))
    procs = [ctx.Process(target=_sweep_prefill, args=(pb, device.p, sizes, total, max_descs, regions), daemon=True),
             ctx.Process(target=_sweep_decode, args=(db, device, sizes, total, max_descs, repeat, regions,
                                                     str(logs / "d.log")), daemon=True)]
    for pr in procs:
        pr.start()
    try:
        _, md, bases = _recv(pa, "sweep prefill", deadline)
        _recv(da, "sweep decode", deadline)
        da.send(("peer", (md, bases)))
        rows: list[dict[str, Any]] = _recv(da, "sweep decode", deadline)[1]
        pa.send("stop")
        _recv(pa, "sweep prefill", deadline)
        for pr in procs:
            pr.join(timeout=10)
        return {"rows": rows, "ucx": _ucx_report(logs / "d.log")}
    finally:
        _reap(procs)
        shutil.rmtree(logs, ignore_errors=True)
