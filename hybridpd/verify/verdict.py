"""The rehearsal's verdict: D's buffers and the moved descriptors against the TP=1 ground truth and the plan.

* ``diff_decode`` turns the bytes that differ at D rank r into runs naming the tensor, block and region;
* ``expected_components`` / ``moved_components`` / ``padding_moved`` are the accounting per component;
* ``rank_result`` is one D rank's verdict (``RankResult``), ``run_in_memory`` the whole rehearsal with numpy
  copies, ``summarize`` the ``RehearsalResult`` that `verify --rehearse` renders.

The results are frozen dataclasses; ``as_dict()`` gives the stable ``verify --rehearse --json`` keys. A
``RankResult`` crosses the pipe from a rank process as it is (it pickles: plain values, tuples and dicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hybridpd.core.findings import Finding, errors
from hybridpd.core.transfer import kv_head_block_bytes, source_request_bytes
from hybridpd.verify.rehearsal import (
    COMPONENTS,
    Setup,
    SourceView,
    components_of,
    expected_decode,
    fill_prefill,
    init_decode,
    numpy_read,
    transfer_views,
)

# ------------------------------------------------------------------------------------------ the results


@dataclass(frozen=True, kw_only=True)
class MismatchRun:
    """Bytes of one region of one D page that differ from the ground truth."""

    rank: int
    tensor: int
    block: int
    group: str
    region: str
    bytes: int
    first_offset: int
    where: str
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "tensor": self.tensor, "block": self.block, "group": self.group,
                "region": self.region, "bytes": self.bytes, "first_offset": self.first_offset, "where": self.where,
                "message": self.message}


@dataclass(frozen=True, kw_only=True)
class UcxReport:
    """What UCX chose for a rank's READs, and its warnings (from the rank's UCX log)."""

    read_transports: tuple[str, ...] = ()
    read_operations: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"read_transports": list(self.read_transports), "read_operations": list(self.read_operations),
                "warnings": list(self.warnings)}


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """Semantic + accounting verdict for one D rank. The last five fields exist only for a run over NIXL
    (``run_nixl`` sets them; None leaves the key out of ``as_dict``, as for `--transport numpy`)."""

    rank: int
    expected_bytes: int
    moved_bytes: int
    expected_descriptors: int
    expected_descriptors_min: int
    moved_descriptors: int
    reads: int
    expected_reads: int
    expected_components: Mapping[str, int]
    moved_components: Mapping[str, int]
    mismatched_bytes: Mapping[str, int]
    padding_bytes_moved: int
    telemetry: Mapping[str, int] | None  # NIXL's own counts of the checked READ
    elapsed_s: float | None
    injected: tuple[str, ...]
    sources: tuple[int, ...]
    mismatch_runs: tuple[MismatchRun, ...]
    mismatches: tuple[str, ...]
    first_elapsed_s: float | None = None
    read_times_s: tuple[float, ...] | None = None
    memory: str | None = None  # NIXL memory type of D's tensors (DRAM, VRAM)
    bench: Mapping[str, Any] | None = None  # a ``run_nixl(bench=...)`` hook's answer
    ucx: UcxReport | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank, "expected_bytes": self.expected_bytes, "moved_bytes": self.moved_bytes,
            "expected_descriptors": self.expected_descriptors,
            "expected_descriptors_min": self.expected_descriptors_min, "moved_descriptors": self.moved_descriptors,
            "reads": self.reads, "expected_reads": self.expected_reads,
            "expected_components": dict(self.expected_components), "moved_components": dict(self.moved_components),
            "mismatched_bytes": dict(self.mismatched_bytes), "padding_bytes_moved": self.padding_bytes_moved,
            "telemetry": None if self.telemetry is None else dict(self.telemetry), "elapsed_s": self.elapsed_s,
            "injected": list(self.injected), "sources": list(self.sources),
            "mismatch_runs": [r.as_dict() for r in self.mismatch_runs], "mismatches": list(self.mismatches),
            "ok": self.ok}
        nixl = {"first_elapsed_s": self.first_elapsed_s,
                "read_times_s": None if self.read_times_s is None else list(self.read_times_s),
                "memory": self.memory, "bench": None if self.bench is None else dict(self.bench),
                "ucx": None if self.ucx is None else self.ucx.as_dict()}
        out.update({k: v for k, v in nixl.items() if v is not None})
        return out


@dataclass(frozen=True, kw_only=True)
class RehearsalResult:
    """`verify --rehearse`: the setup, the plan's error findings, and every D rank's verdict."""

    transport: str
    memory: str
    model: str
    vllm_profile: str
    ptp: int
    dtp: int
    isl: int
    tokens_transferred: int
    logical_blocks: int
    num_blocks: int
    block_size: int
    page_size_bytes: int
    seed: int
    inject: str | None
    p_block_ids: tuple[tuple[int, ...], ...]
    d_block_ids: tuple[tuple[int, ...], ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]
    per_rank: tuple[RankResult, ...]

    mode: ClassVar[str] = "rehearse"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.per_rank)

    def _ucx_union(self, key: str) -> list[str]:
        return list(dict.fromkeys(v for r in self.per_rank if r.ucx is not None for v in getattr(r.ucx, key)))

    @property
    def ucx_read_transports(self) -> list[str]:
        return self._ucx_union("read_transports")

    @property
    def ucx_read_operations(self) -> list[str]:
        return self._ucx_union("read_operations")

    @property
    def ucx_warnings(self) -> list[str]:
        return self._ucx_union("warnings")

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "transport": self.transport, "memory": self.memory,
            "ucx_read_transports": self.ucx_read_transports, "ucx_read_operations": self.ucx_read_operations,
            "ucx_warnings": self.ucx_warnings, "model": self.model, "vllm_profile": self.vllm_profile,
            "ptp": self.ptp, "dtp": self.dtp, "isl": self.isl, "tokens_transferred": self.tokens_transferred,
            "logical_blocks": self.logical_blocks, "num_blocks": self.num_blocks, "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes, "seed": self.seed, "inject": self.inject,
            "p_block_ids": [list(b) for b in self.p_block_ids], "d_block_ids": [list(b) for b in self.d_block_ids],
            "findings": [f.as_dict() for f in self.findings], "notes": list(self.notes),
            "per_rank": [r.as_dict() for r in self.per_rank], "ok": self.ok,
        }


# -------------------------------------------------------------------------------------- the checks


def _region(s: Setup, block: int, off: int) -> tuple[str, str, str]:
    """(component, detail, group) of byte ``off`` inside D's page of logical ``block``."""
    d = s.d
    for g, ids in zip(d.groups, s.d_blocks, strict=True):
        if block not in ids:
            continue
        gname = f"group {g.index} ({g.kind})"
        if g.kind == "attention":
            kp = d.kernel_page_bytes
            k, o = divmod(off, kp)
            per_head = kv_head_block_bytes(d)
            if d.profile.kv_descs_per_block == 2:
                kv, o2 = divmod(o, kp // 2)
                head = o2 // per_head
            else:
                head, o2 = divmod(o, 2 * per_head)
                kv = o2 // per_head
            return "FA", f"kernel block {k}, local KV head {head} {'KV'[kv]}", gname
        assert d.mamba is not None
        c = d.mamba.conv
        for (start, length), name in zip(c.local_offsets(), c.names, strict=True):
            if off < start + length:
                return name, f"local {name} channel {(off - start) // c.row_bytes}", gname
        if off < d.mamba_page_bytes:
            return "SSM", f"local SSM head {(off - c.nbytes) // d.mamba.ssm_row_bytes}", gname
        return "padding", "Mamba page padding", gname
    return "other", "block outside the request", "no group"


def _bounds(s: Setup, block: int) -> tuple[list[int], list[str]]:
    """Region starts inside D's page of ``block`` and their names (vectorised classification): the Mamba
    descriptors' spans, then the page padding."""
    d = s.d
    for g, ids in zip(d.groups, s.d_blocks, strict=True):
        if block in ids:
            if g.kind == "attention":
                return [0], ["FA"]
            assert d.mamba is not None
            return ([o for o, _ in d.mamba.desc_spans()] + [d.mamba_page_bytes],
                    [*d.mamba.part_names, "SSM", "padding"])
    return [0], ["other"]


def diff_decode(s: Setup, rank: int, actual: list[np.ndarray], expected: list[np.ndarray],
                limit: int = 200) -> tuple[list[MismatchRun], dict[str, int], dict[str, int]]:
    """Mismatching runs naming tensor, block and region (at most ``limit``); mismatched bytes and pages per
    component."""
    page = s.d.page_size_bytes
    runs: list[MismatchRun] = []
    bad_bytes: dict[str, int] = {}
    bad_pages: dict[str, int] = {}
    for ti, (a, e) in enumerate(zip(actual, expected, strict=True)):
        bad = np.flatnonzero(a != e)
        if bad.size == 0:
            continue
        blocks = bad // page
        for b in np.unique(blocks).tolist():
            offs = bad[blocks == b] - b * page
            bounds, comps = _bounds(s, b)
            idx = np.searchsorted(np.asarray(bounds), offs, side="right") - 1
            for ci in np.unique(idx).tolist():
                sel = offs[idx == ci]
                comp = comps[ci]
                n = int(sel.size)
                first = int(sel[0])
                _, detail, g = _region(s, b, first)
                bad_bytes[comp] = bad_bytes.get(comp, 0) + n
                bad_pages[comp] = bad_pages.get(comp, 0) + 1
                if len(runs) < limit:
                    runs.append(MismatchRun(
                        rank=rank, tensor=ti, block=b, group=g, region=comp, bytes=n, first_offset=first, where=detail,
                        message=f"D rank {rank}: region {comp} of tensor {ti} block {b} ({g}): {n:,} bytes differ "
                                f"from the TP=1 ground truth, first at page offset {first:,} ({detail})"))
    return runs, bad_bytes, bad_pages


def expected_components(s: Setup, rank: int) -> dict[str, int]:
    """Bytes per component the plan's route moves for D ``rank`` (one request)."""
    assert s.plan.routes is not None
    p = s.p
    blocks = s.plan.transfer_for(s.isl).logical_blocks
    names = components_of(p)
    out = dict.fromkeys(names, 0)
    for src in s.plan.routes[rank].sources:
        fa, spans = source_request_bytes(p, src, blocks)
        out["FA"] += fa
        for name, n in zip(names[1:], spans, strict=True) if spans else ():
            out[name] += n
    return out


def moved_components(views: Sequence[SourceView], names: tuple[str, ...] = COMPONENTS) -> tuple[dict[str, int], int]:
    """Bytes per component the remote descriptors of the request cover, and the number of descriptors."""
    out = dict.fromkeys(names, 0)
    n = 0
    for v in views:
        lens = v.remote.length[v.remote_ids]
        for c, ln in zip(v.components, lens.tolist(), strict=True):
            out[c] += int(ln)
        n += len(v.components)
    return out, n


def padding_moved(s: Setup, views: Sequence[SourceView], p_bases: dict[int, list[int]]) -> int:
    """Bytes of P's Mamba padding that the remote descriptors cover (must be 0)."""
    p = s.p
    if not p.mamba_groups or not p.padding_bytes:
        return 0
    page = p.page_size_bytes
    total = 0
    for v in views:
        bases = p_bases[v.p_rank]
        for rid, comp in zip(v.remote_ids.tolist(), v.components, strict=True):
            if comp == "FA":
                continue
            a, ln = int(v.remote.addr[rid]), int(v.remote.length[rid])
            base = next(b for b in bases if b <= a < b + s.n_log * page)
            o = (a - base) % page
            total += max(0, min(o + ln, page) - max(o, p.mamba_page_bytes))
    return total


def rank_result(s: Setup, rank: int, views: Sequence[SourceView], actual: list[np.ndarray],
                p_bases: dict[int, list[int]], telemetry: Mapping[str, int] | None = None,
                elapsed_s: float | None = None) -> RankResult:
    """Semantic + accounting verdict for one D rank."""
    plan_rank = s.plan.transfer_for(s.isl).per_rank[rank]
    runs, bad_bytes, bad_pages = diff_decode(s, rank, actual, expected_decode(s, rank))
    exp_c = expected_components(s, rank)
    mov_c, n_desc = moved_components(views, components_of(s.p))
    moved = sum(mov_c.values())
    pad = padding_moved(s, views, p_bases)
    mism: list[str] = []
    for comp, nbad in bad_bytes.items():
        ex = next((r for r in runs if r.region == comp), None)
        eg = (f"; first: tensor {ex.tensor} block {ex.block} ({ex.group}) at page offset {ex.first_offset:,} "
              f"({ex.where})") if ex else ""
        mism.append(f"D rank {rank}: region {comp}: {nbad:,} bytes differ from the TP=1 ground truth"
                    f" (in {bad_pages[comp]} pages){eg}")
    if moved != plan_rank.bytes:
        mism.append(f"D rank {rank}: moved {moved:,} B, plan predicts {plan_rank.bytes:,} B")
    for c in components_of(s.p):
        if mov_c[c] != exp_c[c]:
            mism.append(f"D rank {rank}: region {c}: moved {mov_c[c]:,} B, plan predicts {exp_c[c]:,} B")
    if not plan_rank.descriptors_min <= n_desc <= plan_rank.descriptors:
        mism.append(f"D rank {rank}: {n_desc} descriptors, plan predicts "
                    f"[{plan_rank.descriptors_min}, {plan_rank.descriptors}]")
    if len(views) != plan_rank.reads:
        mism.append(f"D rank {rank}: {len(views)} READs, plan predicts {plan_rank.reads}")
    if pad:
        mism.append(f"D rank {rank}: {pad:,} B of P's Mamba padding were moved")
    if telemetry and telemetry.get("bytes") is not None and telemetry["bytes"] != moved:
        mism.append(f"D rank {rank}: NIXL telemetry says {telemetry['bytes']:,} B, descriptors say {moved:,} B")
    return RankResult(rank=rank, expected_bytes=plan_rank.bytes, moved_bytes=moved,
                      expected_descriptors=plan_rank.descriptors, expected_descriptors_min=plan_rank.descriptors_min,
                      moved_descriptors=n_desc, reads=len(views), expected_reads=plan_rank.reads,
                      expected_components=exp_c, moved_components=mov_c, mismatched_bytes=bad_bytes,
                      padding_bytes_moved=pad, telemetry=telemetry, elapsed_s=elapsed_s,
                      injected=tuple(v.injected for v in views if v.injected),
                      sources=tuple(v.p_rank for v in views), mismatch_runs=tuple(runs), mismatches=tuple(mism))


# -------------------------------------------------------------------------------------- the runs


def run_in_memory(s: Setup) -> list[RankResult]:
    """The whole rehearsal with numpy copies instead of NIXL (tests, and `--transport numpy`)."""
    p_tensors = {r: fill_prefill(s, r) for r in range(s.p.tp)}
    p_bases = {r: [t.ctypes.data for t in ts] for r, ts in p_tensors.items()}
    out = []
    for r in range(s.d.tp):
        d_tensors = init_decode(s)
        d_bases = [t.ctypes.data for t in d_tensors]
        views = transfer_views(s, r, p_bases, d_bases)
        numpy_read(views, p_tensors, p_bases, d_tensors, d_bases)
        out.append(rank_result(s, r, views, d_tensors, p_bases))
    return out


def summarize(s: Setup, per_rank: Sequence[RankResult], transport: str, memory: str = "DRAM") -> RehearsalResult:
    t = s.plan.transfer_for(s.isl)
    return RehearsalResult(
        transport=transport, memory=memory, model=s.plan.model.model_id, vllm_profile=s.plan.profile.name,
        ptp=s.p.tp, dtp=s.d.tp, isl=s.isl, tokens_transferred=s.n_tok, logical_blocks=t.logical_blocks,
        num_blocks=s.n_log, block_size=s.p.block_size, page_size_bytes=s.p.page_size_bytes, seed=s.seed,
        inject=s.inject, p_block_ids=s.p_blocks, d_block_ids=s.d_blocks,
        findings=errors(s.plan.findings), notes=s.notes, per_rank=tuple(per_rank))
