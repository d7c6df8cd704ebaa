"""Full NIXL descriptor tables (address, length) and per-request desc-id lists, vectorised with numpy.

Layout of ids (reference §3.4; 0.32 packs K+V so ``fa_regions = T``):
  FA:    id = r * N_phys + b            r < fa_regions, b a kernel block
  Mamba: id = num_fa_descs + m * N_log + b   m = 4*tensor + {x:0, B:1, C:2, SSM:3}, b a logical block
Groups are concatenated in group order; within a group, region-major then block.  numpy is imported
here only (never by `plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .layout import SideLayout
from .transfer import SourceRead


@dataclass(frozen=True)
class DescTable:
    addr: np.ndarray  # uint64
    length: np.ndarray  # uint64
    num_fa_descs: int
    n_phys: int
    n_log: int

    def __len__(self) -> int:
        return int(self.addr.shape[0])


def _fa_part(bases: np.ndarray, n_phys: int, kernel_page: int, kvd: int, offset: int, v_offset: int | None,
             length: int) -> tuple[np.ndarray, np.ndarray]:
    T = bases.shape[0]
    blocks = np.arange(n_phys, dtype=np.uint64) * np.uint64(kernel_page)
    offs = [offset] if kvd == 1 else [offset, v_offset if v_offset is not None else offset + kernel_page // 2]
    # region order: tensor i -> (K, V) when kvd == 2
    per_region = [bases[i] + np.uint64(o) + blocks for i in range(T) for o in offs]
    addr = np.concatenate(per_region) if per_region else np.zeros(0, np.uint64)
    return addr, np.full(addr.shape[0], length, dtype=np.uint64)


def _mamba_part(bases: np.ndarray, n_log: int, page: int, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    blocks = np.arange(n_log, dtype=np.uint64) * np.uint64(page)
    addrs, lens = [], []
    for i in range(bases.shape[0]):
        for off, ln in spans:
            addrs.append(bases[i] + np.uint64(off) + blocks)
            lens.append(np.full(n_log, ln, dtype=np.uint64))
    if not addrs:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return np.concatenate(addrs), np.concatenate(lens)


def local_table(side: SideLayout, bases: list[int], n_log: int) -> DescTable:
    """The descriptors a rank registers over its own KV-cache tensors (one base address per tensor)."""
    b = np.asarray(bases, dtype=np.uint64)
    kvd = side.profile.kv_descs_per_block
    n_phys = n_log * side.physical_per_logical
    kp = side.kernel_page_bytes
    fa_a, fa_l = (_fa_part(b, n_phys, kp, kvd, 0, None, kp // kvd) if side.attention_groups
                  else (np.zeros(0, np.uint64), np.zeros(0, np.uint64)))
    spans: list[tuple[int, int]] = []
    if side.mamba is not None and side.mamba_groups:
        spans = [*side.mamba.conv.local_offsets(), (side.mamba.conv_bytes, side.mamba.ssm_bytes)]
    m_a, m_l = _mamba_part(b[:side.num_ssm_slots], n_log, side.page_size_bytes, spans)
    return DescTable(addr=np.concatenate([fa_a, m_a]), length=np.concatenate([fa_l, m_l]),
                     num_fa_descs=int(fa_a.shape[0]), n_phys=n_phys, n_log=n_log)


def remote_table(p: SideLayout, src: SourceRead, bases: list[int], n_log: int) -> DescTable:
    """The descriptors a D rank builds over one source P rank's memory (vLLM's remote view)."""
    b = np.asarray(bases, dtype=np.uint64)
    kvd = p.profile.kv_descs_per_block
    n_phys = n_log * p.physical_per_logical
    kp = p.kernel_page_bytes
    if p.attention_groups and src.fa is not None:
        fa_a, fa_l = _fa_part(b, n_phys, kp, kvd, src.fa[0], src.fa_v_offset, src.fa[1])
    elif p.attention_groups:
        # this P rank holds no needed heads: same id space, zero-length FA descriptors never referenced
        fa_a, fa_l = _fa_part(b, n_phys, kp, kvd, 0, None, 0)
    else:
        fa_a, fa_l = np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    spans = [s for s in (src.x, src.b, src.c, src.ssm) if s is not None]
    m_a, m_l = _mamba_part(b[:p.num_ssm_slots], n_log, p.page_size_bytes, spans)
    return DescTable(addr=np.concatenate([fa_a, m_a]), length=np.concatenate([fa_l, m_l]),
                     num_fa_descs=int(fa_a.shape[0]), n_phys=n_phys, n_log=n_log)


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
            regions = np.arange(4 * side.num_ssm_slots, dtype=np.int64)[:, None]
            out.append((table.num_fa_descs + regions * table.n_log + blk[None, :]).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def loop_local_table(side: SideLayout, bases: list[int], n_log: int) -> list[tuple[int, int]]:
    """Reference implementation: one descriptor at a time (the bench's baseline)."""
    kvd = side.profile.kv_descs_per_block
    n_phys = n_log * side.physical_per_logical
    kp = side.kernel_page_bytes
    out: list[tuple[int, int]] = []
    if side.attention_groups:
        for base in bases:
            for half in range(kvd):
                for blk in range(n_phys):
                    out.append((base + blk * kp + half * (kp // kvd), kp // kvd))
    if side.mamba is not None and side.mamba_groups:
        spans = [*side.mamba.conv.local_offsets(), (side.mamba.conv_bytes, side.mamba.ssm_bytes)]
        for base in bases[:side.num_ssm_slots]:
            for off, ln in spans:
                for blk in range(n_log):
                    out.append((base + blk * side.page_size_bytes + off, ln))
    return out


def summary(table: DescTable) -> dict[str, Any]:
    return {"descriptors": len(table), "num_fa_descs": table.num_fa_descs, "n_phys": table.n_phys,
            "n_log": table.n_log, "bytes": int(table.length.sum())}
