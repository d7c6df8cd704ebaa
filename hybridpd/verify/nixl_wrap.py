"""The NIXL wrapper: where KV tensors live, agent creation, registration, descriptor lists and READs.

Nothing here knows about plans or rehearsals: ``hybridpd.verify.nixl_agent`` runs the rank processes with it,
and the bench scripts reuse it.  Agents run without a progress thread (the default one busy-spins a core
per agent, nixl-notes gotcha 1), so whoever waits for a READ drives UCX's progress by polling.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hybridpd.core.descriptors import DescTable
from hybridpd.errors import ExternalToolError, UsageError
from hybridpd.gpus import require_gpu

WAIT_S = 60.0
CMA_SEG_SIZE = "64m"  # UCX's default is 512k (uct scopy UCT_SCOPY_IFACE_SEG_SIZE)


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


def set_env(gpu: bool = False, ucx_log: str | None = None) -> None:
    """UCX/NIXL environment, before the first ``import nixl`` of a process (defaults only: the caller's win)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # vLLM sets it too
    # DRAM READs go over UCX's cma (process_vm_readv), which by default copies 512 KiB per progress call and
    # syscall: a KV descriptor of 2 MiB costs 4 calls.  One call per descriptor brought the rehearsal's READ
    # from ~80 % to ~90 % of a memcpy of the same bytes (bench/bench_rehearsal.py); no effect on cuda_ipc.
    os.environ.setdefault("UCX_CMA_SEG_SIZE", CMA_SEG_SIZE)
    if gpu:
        # without it UCX disables cuda_ipc READs when it sees no NVLink and falls back to TCP through host
        # memory (~0.4 GB/s on an H200; nixl-notes section 5)
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    if ucx_log:
        os.environ["UCX_PROTO_INFO"] = "y"
        os.environ["UCX_LOG_FILE"] = ucx_log


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) without importing torch when possible.

    The wheels' own modules first (``nixl_cu13``, then ``nixl_cu12``), then the ``nixl`` meta package: the
    one ladder, read by the rehearsal and by `doctor`."""
    set_env()
    import importlib

    last: ImportError | None = None
    for mod in ("nixl_cu13._api", "nixl_cu12._api", "nixl._api"):
        try:
            api = importlib.import_module(mod)
        except ImportError as e:
            last = e
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ExternalToolError(f"NIXL is not installed ({last})",
                            fix="pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1")


def nixl_available() -> bool:
    try:
        import_nixl()
    except ExternalToolError:
        return False
    return True


def make_agent(name: str) -> Any:
    """A UCX agent with telemetry on and no progress or listener thread."""
    nixl_agent, nixl_agent_config = import_nixl()
    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, capture_telemetry=True,
                            backends=["UCX"])
    return nixl_agent(name, cfg)


class Memory:
    """One rank's KV tensors: numpy arrays in DRAM, or uint8 torch tensors on one GPU."""

    def __init__(self, arrays: list[np.ndarray], dev: str) -> None:
        self.dev = dev
        self.mem = Placement.mem(dev)
        self.dev_id = Placement.index(dev)
        self.tensors: list[Any]
        if dev == "cpu":
            self.tensors = list(arrays)
            self.bases = [int(a.ctypes.data) for a in arrays]
        else:
            import torch

            torch.cuda.set_device(self.dev_id)
            self.tensors = [torch.from_numpy(a).to(dev) for a in arrays]
            torch.cuda.synchronize(dev)
            self.bases = [int(t.data_ptr()) for t in self.tensors]

    def register(self, agent: Any) -> Any:
        sizes = [a.nbytes if self.dev == "cpu" else a.numel() for a in self.tensors]
        return agent.register_memory([(b, n, self.dev_id, "") for b, n in zip(self.bases, sizes, strict=True)],
                                     self.mem)

    def host(self) -> list[np.ndarray]:
        if self.dev == "cpu":
            return list(self.tensors)
        import torch

        torch.cuda.synchronize(self.dev)
        return [t.cpu().numpy() for t in self.tensors]

    def fill(self, value: int) -> None:
        for t in self.tensors:
            if self.dev == "cpu":
                t.fill(value)
            else:
                t.fill_(value)
        if self.dev != "cpu":
            import torch

            torch.cuda.synchronize(self.dev)  # UCX copies on its own streams: the fill must land first


def nx3(addr: Any, length: Any, dev_id: int) -> np.ndarray:
    """NIXL's Nx3 (addr, len, dev) uint64 descriptor array."""
    a = np.zeros((len(addr), 3), dtype=np.uint64)
    a[:, 0], a[:, 1], a[:, 2] = addr, length, dev_id
    return a


def telemetry(agent: Any, handle: Any) -> dict[str, int] | None:
    try:
        t = agent.get_xfer_telemetry(handle)
        return {"bytes": int(t.totalBytes), "descriptors": int(t.descCount), "xfer_us": int(t.xferDuration)}
    except Exception:  # noqa: BLE001 - telemetry is optional
        return None


def wait(agent: Any, handle: Any, state: str) -> None:
    """Poll until the transfer is done; the polling is what progresses UCX here (no progress thread)."""
    t1 = time.monotonic()
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if time.monotonic() - t1 > WAIT_S:
            raise TimeoutError(f"NIXL READ still in progress after {WAIT_S:.0f} s")
    if state != "DONE":
        raise RuntimeError(f"NIXL READ ended in state {state}")


def post_and_wait(agent: Any, handles: Sequence[Any]) -> None:
    """Post every transfer, then wait for each: all READs of a request are in flight together."""
    states = [(h, agent.transfer(h)) for h in handles]
    for h, st in states:
        wait(agent, h, st)


class ReadView(Protocol):
    """One READ's descriptors (``rehearsal.SourceView`` is one): full tables plus the request's desc ids."""

    @property
    def p_rank(self) -> int: ...
    @property
    def local(self) -> DescTable: ...
    @property
    def remote(self) -> DescTable: ...
    @property
    def local_ids(self) -> np.ndarray: ...
    @property
    def remote_ids(self) -> np.ndarray: ...


@dataclass
class Reader:
    """A D rank's NIXL side: the agent, its peers, and the descriptor lists prepped once (as vLLM does at
    handshake).  ``read`` is vLLM's per-request work: ``make_prepped_xfer`` with the request's desc ids,
    one per source P rank, all posted, then waited for."""

    agent: Any
    names: dict[int, Any]
    views: Sequence[ReadView]
    local_mem: str
    local_dev: int
    remote_mem: str
    remote_dev: int
    prepped: list[tuple[Any, Any]] = field(default_factory=list)
    _ids: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def prep(self) -> None:
        for v in self.views:
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", nx3(v.local.addr, v.local.length, self.local_dev),
                                            self.local_mem)
            rh = self.agent.prep_xfer_dlist(self.names[v.p_rank], nx3(v.remote.addr, v.remote.length,
                                                                      self.remote_dev), self.remote_mem)
            self.prepped.append((lh, rh))
            # vLLM hands NIXL int32 desc-id arrays it built for the request: not part of the timed READ
            self._ids.append((v.local_ids.astype(np.int32), v.remote_ids.astype(np.int32)))

    def read(self, notif: bytes = b"") -> tuple[float, dict[str, int] | None]:
        """One request's READs; (seconds from the first make_prepped_xfer to the last DONE, summed telemetry)."""
        t0 = time.perf_counter()
        posted = []
        for (lh, rh), (li, ri) in zip(self.prepped, self._ids, strict=True):
            h = self.agent.make_prepped_xfer("READ", lh, li, rh, ri, notif)
            posted.append((h, self.agent.transfer(h)))
        for h, st in posted:
            wait(self.agent, h, st)
        elapsed = time.perf_counter() - t0
        tel: dict[str, int] | None = {"bytes": 0, "descriptors": 0, "xfer_us": 0}
        for h, _ in posted:
            t = telemetry(self.agent, h)
            tel = None if t is None or tel is None else {k: tel[k] + t[k] for k in tel}
            self.agent.release_xfer_handle(h)
        return elapsed, tel

    def close(self) -> None:
        for lh, rh in self.prepped:
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
        for n in self.names.values():
            self.agent.remove_remote_agent(n)
