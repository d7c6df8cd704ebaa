"""Full NIXL descriptor tables (address, length) and per-request desc-id lists, vectorised with numpy.

Layout of ids (reference §3.4; 0.32 packs K+V so ``fa_regions = T``):
  FA:    id = r * N_phys + b            r < fa_regions, b a kernel block
  Mamba: id = num_fa_descs + m * N_log + b   m = n*tensor + sub-projection (Mamba2 x:0 B:1 C:2 SSM:3, n = 4;
         GatedDeltaNet Q K V SSM, n = 4; Mamba-1 x:0 SSM:1, n = 2), b a logical block
Groups are concatenated in group order; within a group, region-major then block.  numpy is imported
here only (never by `plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridpd.core.layout import SideLayout
from hybridpd.core.transfer import SourceRead


@dataclass(frozen=True)
class DescTable:
    addr: np.ndarray  # uint64
    length: np.ndarray  # uint64
    num_fa_descs: int
    n_phys: int
    n_log: int

    def __len__(self) -> int:
        return int(self.addr.shape[0])


def _grid_into(out: np.ndarray, bases: np.ndarray, offsets: np.ndarray, n: int, stride: int) -> None:
    """out[i, j, b] = bases[i] + offsets[j] + b*stride, base-major, written in place: one broadcast pass over
    ``out`` (no full-size temporaries; tables reach ~16M descriptors, so the build is memory-bound)."""
    blocks = np.arange(n, dtype=np.uint64) * np.uint64(stride)
    starts = bases[:, None] + offsets[None, :]
    np.add(starts[:, :, None], blocks[None, None, :], out=out.reshape(bases.shape[0], offsets.shape[0], n))


def _mamba_spans(side: SideLayout) -> tuple[tuple[int, int], ...]:
    """(offset in the page, length) of each of a slot's Mamba descriptors; empty without Mamba groups."""
    return tuple(side.mamba.desc_spans()) if side.mamba is not None and side.mamba_groups else ()


def _table(bases: np.ndarray, *, n_phys: int, n_log: int, kernel_page: int, fa_offsets: Sequence[int],
           fa_length: int, mamba_slots: int, page: int, spans: Sequence[tuple[int, int]]) -> DescTable:
    """FA descriptors (every base x ``fa_offsets`` x kernel block), then Mamba (the first ``mamba_slots``
    bases x ``spans`` x logical block), written into two preallocated arrays."""
    fa_offs = np.asarray(fa_offsets, dtype=np.uint64)
    mb = bases[:mamba_slots]
    n_fa = bases.shape[0] * fa_offs.shape[0] * n_phys
    n_m = mb.shape[0] * len(spans) * n_log
    addr = np.empty(n_fa + n_m, dtype=np.uint64)
    length = np.empty(n_fa + n_m, dtype=np.uint64)
    if n_fa:
        _grid_into(addr[:n_fa], bases, fa_offs, n_phys, kernel_page)
        length[:n_fa] = fa_length
    if n_m:
        _grid_into(addr[n_fa:], mb, np.asarray([o for o, _ in spans], dtype=np.uint64), n_log, page)
        lens = np.asarray([ln for _, ln in spans], dtype=np.uint64)
        length[n_fa:].reshape(mb.shape[0], len(spans), n_log)[...] = lens[None, :, None]
    return DescTable(addr=addr, length=length, num_fa_descs=n_fa, n_phys=n_phys, n_log=n_log)


def local_table(side: SideLayout, bases: list[int], n_log: int) -> DescTable:
    """The descriptors a rank registers over its own KV-cache tensors (one base address per tensor)."""
    kvd = side.profile.kv_descs_per_block
    kp = side.kernel_page_bytes
    # region order: tensor i -> (K, V) when kvd == 2
    offs = [h * (kp // kvd) for h in range(kvd)] if side.attention_groups else []
    return _table(np.asarray(bases, dtype=np.uint64), n_phys=n_log * side.physical_per_logical, n_log=n_log,
                  kernel_page=kp, fa_offsets=offs, fa_length=kp // kvd, mamba_slots=side.num_ssm_slots,
                  page=side.page_size_bytes, spans=_mamba_spans(side))


def remote_table(p: SideLayout, src: SourceRead, bases: list[int], n_log: int) -> DescTable:
    """The descriptors a D rank builds over one source P rank's memory (vLLM's remote view)."""
    kvd = p.profile.kv_descs_per_block
    kp = p.kernel_page_bytes
    offs: list[int] = []
    fa_len = 0
    if p.attention_groups and src.fa is not None:
        v = src.fa_v_offset if src.fa_v_offset is not None else src.fa[0] + kp // 2
        offs, fa_len = ([src.fa[0]] if kvd == 1 else [src.fa[0], v]), src.fa[1]
    elif p.attention_groups:
        # this P rank holds no needed heads: same id space, zero-length FA descriptors never referenced
        offs = [0] if kvd == 1 else [0, kp // 2]
    return _table(np.asarray(bases, dtype=np.uint64), n_phys=n_log * p.physical_per_logical, n_log=n_log,
                  kernel_page=kp, fa_offsets=offs, fa_length=fa_len, mamba_slots=p.num_ssm_slots,
                  page=p.page_size_bytes, spans=tuple(src.mamba_spans))


@dataclass(frozen=True)
class StridedRows:
    """vLLM 0.33's registration: NIXL >= 1.5 strided rows (addr, len, dev, stride, count), built directly.

    ``_block_strided_descs``: an FA region is one row when its kernel blocks are back to back (stride == len,
    so always with K and V packed), else one row per block; Mamba gets one row per (region, sub-projection)
    with the page as stride.  Expanding every row gives the flat table of ``local_table``."""

    rows: np.ndarray  # (N, 5) uint64
    num_fa_rows: int

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def expanded(self) -> tuple[np.ndarray, np.ndarray]:
        """(addr, length) of every descriptor the rows stand for, in id order."""
        r = self.rows
        counts = r[:, 4].astype(np.int64)
        idx = np.repeat(np.arange(r.shape[0]), counts)
        step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return r[idx, 0] + r[idx, 3] * step.astype(np.uint64), r[idx, 1]


def strided_rows(side: SideLayout, bases: list[int], n_log: int, dev: int = 0) -> StridedRows:
    b = np.asarray(bases, dtype=np.uint64)
    kvd = side.profile.kv_descs_per_block
    n_phys = n_log * side.physical_per_logical
    kp = side.kernel_page_bytes
    parts: list[np.ndarray] = []
    n_fa = 0
    if side.attention_groups:
        ln = kp // kvd
        offs = np.arange(kvd, dtype=np.uint64) * np.uint64(ln)
        starts = (b[:, None] + offs[None, :]).reshape(-1)
        if ln == kp:  # back to back: one row per region
            fa = np.stack([starts, np.full_like(starts, ln), np.full_like(starts, dev), np.full_like(starts, kp),
                           np.full_like(starts, n_phys)], axis=1)
        else:  # one row per (region, block)
            addr = np.empty(b.shape[0] * kvd * n_phys, dtype=np.uint64)
            _grid_into(addr, b, offs, n_phys, kp)
            fa = np.stack([addr, np.full_like(addr, ln), np.full_like(addr, dev), np.full_like(addr, ln),
                           np.ones_like(addr)], axis=1)
        parts.append(fa)
        n_fa = fa.shape[0]
    spans = _mamba_spans(side)
    if spans:
        mb = b[:side.num_ssm_slots]
        starts = (mb[:, None] + np.asarray([o for o, _ in spans], dtype=np.uint64)[None, :]).reshape(-1)
        lens = np.tile(np.asarray([ln for _, ln in spans], dtype=np.uint64), mb.shape[0])
        parts.append(np.stack([starts, lens, np.full_like(starts, dev),
                               np.full_like(starts, side.page_size_bytes), np.full_like(starts, n_log)], axis=1))
    rows = np.concatenate(parts) if parts else np.zeros((0, 5), np.uint64)
    return StridedRows(rows=rows, num_fa_rows=n_fa)


def request_desc_ids(side: SideLayout, table: DescTable, block_ids: list[list[int]], *,
                     fa: bool = True, mamba: bool = True) -> np.ndarray:
    """Desc ids for one request's logical block ids (one list per HMA group, in group order)."""
    T = side.num_shared_tensors
    kvd = side.profile.kv_descs_per_block
    ratio = side.physical_per_logical
    out: list[np.ndarray] = []
    for g, ids in zip(side.groups, block_ids, strict=True):
        blk = np.asarray(ids, dtype=np.int64)
        if g.kind == "attention":
            if not fa or blk.size == 0:
                continue
            kern = (blk[:, None] * ratio + np.arange(ratio)[None, :]).reshape(-1)
            regions = np.arange(T * kvd, dtype=np.int64)[:, None]
            out.append((regions * table.n_phys + kern[None, :]).reshape(-1))
        else:
            if not mamba or blk.size == 0:
                continue
            assert side.mamba is not None
            regions = np.arange(side.mamba.regions_per_slot * side.num_ssm_slots, dtype=np.int64)[:, None]
            out.append((table.num_fa_descs + regions * table.n_log + blk[None, :]).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def summary(table: DescTable) -> dict[str, Any]:
    return {"descriptors": len(table), "num_fa_descs": table.num_fa_descs, "n_phys": table.n_phys,
            "n_log": table.n_log, "bytes": int(table.length.sum())}
