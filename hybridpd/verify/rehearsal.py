"""`verify --rehearse`: the plan's KV-cache tensors laid out in real memory, filled from one TP=1 state.

Pure logic (numpy only, no NIXL) so it can be unit tested:

* ``make_setup``   sizes the rehearsal (logical blocks per rank, request length, block ids per group);
* ``fill_prefill`` writes what P rank r holds: every byte derives from a seeded full-model (TP=1) state,
  sharded with the rank state's ``conv_channel_map`` / ``ssm_rows`` (``hybridpd.core.mamba``) and
  ``transfer.kv_heads_of_rank``; padding, unused token slots and
  blocks outside the request get guard bytes;
* ``expected_decode`` is the ground truth for D rank r after a correct transfer (its own x/B/C channels,
  SSM heads and KV heads; padding and other blocks untouched);
* ``transfer_views`` builds vLLM's descriptor views and desc-id lists from the plan (``descriptors.py``),
  optionally with an injected fault;
* ``numpy_read`` does the READs with numpy copies.

``hybridpd.verify.verdict`` checks D's buffers and the moved descriptors (naming the rank, tensor, block and
region) and runs the whole rehearsal in memory; ``hybridpd.verify.nixl_agent`` runs one process per rank and does
the READs over NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridpd.core.descriptors import DescTable, local_table, remote_table, request_desc_ids
from hybridpd.core.findings import errors
from hybridpd.core.layout import SideLayout, cdiv
from hybridpd.core.plan import Plan
from hybridpd.core.transfer import SourceRead, kv_head_token_bytes, kv_heads_of_rank, tokens_transferred
from hybridpd.errors import UsageError

P_PAD = 0xAB  # P's Mamba page padding
P_TOKEN_GUARD = 0xCD  # P's FA token slots past the request's N-1 tokens
P_OTHER = 0xEF  # P's blocks that belong to no request group
D_INIT = 0x5A  # every D byte before the READ
DEFAULT_BLOCKS = 64
DEFAULT_MAX_RANK_BYTES = 64 * 1024 * 1024
COMPONENTS = ("FA", "x", "B", "C", "SSM")  # Mamba2's; components_of() gives each model's
INJECTIONS = ("offset", "length")
ALLOWED_ERRORS = {"conv-state-corruption"}  # vLLM runs these; the rehearsal must show the damage


def components_of(side: SideLayout) -> tuple[str, ...]:
    """FA, then the model's conv sub-projections (x|B|C, x, or Q|K|V), then SSM."""
    return ("FA", *side.mamba.part_names, "SSM") if side.mamba is not None else COMPONENTS


@dataclass(frozen=True, kw_only=True)
class Setup:
    plan: Plan
    n_log: int
    isl: int
    n_tok: int
    seed: int
    p_blocks: tuple[tuple[int, ...], ...]  # per group, P's logical block ids
    d_blocks: tuple[tuple[int, ...], ...]  # per group, D's logical block ids
    inject: str | None = None
    inject_rank: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def p(self) -> SideLayout:
        return self.plan.prefill

    @property
    def d(self) -> SideLayout:
        return self.plan.decode


# --------------------------------------------------------------------------------------------- setup


def refuse_if_vllm_refuses(plan: Plan) -> None:
    """vLLM refuses these combinations at start-up or handshake: so does the rehearsal (exit 2)."""
    refusing = errors(plan.findings, allowed=ALLOWED_ERRORS)
    if refusing:
        f = refusing[0]
        raise UsageError(f"refused ({f.code}): {f.message}", fix=f.fix)
    if plan.routes is None:
        raise UsageError("refused: the plan has no transfer routes for this combination",
                         fix="run `hybridpd plan` to see why")
    if not plan.prefill.attention_groups:
        raise UsageError("refused: attention-free model, no P/D transfer to rehearse")
    if plan.prefill.settings.conv_layout != "DS":
        raise UsageError("refused: the rehearsal models the DS conv layout only", field="--conv-layout", fix="use DS")


def request_blocks(plan: Plan, n_tok: int) -> list[int]:
    """Blocks the request occupies per group (attention: ceil(n/block); Mamba: one)."""
    L = cdiv(n_tok, plan.prefill.block_size)
    return [L if g.kind == "attention" else 1 for g in plan.prefill.groups]


def make_setup(plan: Plan, *, num_blocks: int | None = None, isl: int | None = None, seed: int = 0,
               inject: str | None = None, inject_rank: int = 0,
               max_rank_bytes: int = DEFAULT_MAX_RANK_BYTES) -> Setup:
    refuse_if_vllm_refuses(plan)
    p, d = plan.prefill, plan.decode
    if inject is not None and inject not in INJECTIONS:
        raise UsageError(f"unknown injection {inject!r}", field="--inject", fix=f"use one of {', '.join(INJECTIONS)}")
    if not 0 <= inject_rank < d.tp:
        raise UsageError(f"D rank {inject_rank} outside D TP {d.tp}", field="--inject-rank")
    if isl is None:
        isl = p.block_size + p.block_size // 2
    if isl < 1:
        raise UsageError("must be >= 1", field="--isl")
    n_tok = tokens_transferred(p, isl)
    need = sum(request_blocks(plan, n_tok))
    notes: list[str] = []
    per_block = p.num_shared_tensors * max(p.page_size_bytes, d.page_size_bytes)
    if num_blocks is None:
        num_blocks = max(2, min(DEFAULT_BLOCKS, max_rank_bytes // max(per_block, 1)))
        if num_blocks < DEFAULT_BLOCKS:
            notes.append(f"{num_blocks} logical blocks per rank ({p.num_shared_tensors} tensors x "
                         f"{max(p.page_size_bytes, d.page_size_bytes):,} B pages = {per_block:,} B per block; "
                         f"capped at {max_rank_bytes:,} B per rank)")
    if num_blocks < need + 1:
        notes.append(f"raised --num-blocks {num_blocks} -> {need + 1}: the request needs {need} blocks")
        num_blocks = need + 1
    rng = np.random.default_rng([seed, 1])
    counts = request_blocks(plan, n_tok)
    pb = rng.permutation(num_blocks)[:need]
    db = rng.permutation(num_blocks)[:need]
    p_blocks, d_blocks, k = [], [], 0
    for c in counts:
        p_blocks.append(tuple(int(v) for v in pb[k:k + c]))
        d_blocks.append(tuple(int(v) for v in db[k:k + c]))
        k += c
    return Setup(plan=plan, n_log=num_blocks, isl=isl, n_tok=n_tok, seed=seed, p_blocks=tuple(p_blocks),
                 d_blocks=tuple(d_blocks), inject=inject, inject_rank=inject_rank, notes=tuple(notes))


# ------------------------------------------------------------------------------ the full-model state


def full_fa(s: Setup, slot: int, group: int, j: int) -> np.ndarray:
    """TP=1 K/V of block j of the request: (ratio, heads, 2, kernel_block, head_bytes) uint8."""
    p = s.p
    attn = p.model.attention
    assert attn is not None and p.num_kv_heads
    H, hb, kbs = attn.num_kv_heads, kv_head_token_bytes(p), p.kernel_block_size
    ratio = p.physical_per_logical
    rng = np.random.default_rng([s.seed, 2, slot, group, j])
    a = rng.integers(0, 256, (ratio, H, 2, kbs, hb), dtype=np.uint8)
    tok = j * p.block_size + np.arange(ratio)[:, None] * kbs + np.arange(kbs)[None, :]  # (ratio, kbs)
    a[np.broadcast_to((tok >= s.n_tok)[:, None, None, :], a.shape[:4])] = P_TOKEN_GUARD
    return a


def full_mamba(s: Setup, slot: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """TP=1 conv state (x|B|C, x or Q|K|V) as (channels, row bytes) in DS order, SSM state as (rows, row bytes)."""
    assert s.p.mamba is not None
    full = s.p.mamba.at_tp(1)
    rng = np.random.default_rng([s.seed, 3, slot, group])
    return (rng.integers(0, 256, (full.conv.dim, full.conv.row_bytes), dtype=np.uint8),
            rng.integers(0, 256, (full.heads, full.ssm_row_bytes), dtype=np.uint8))


def rank_kernel_page(side: SideLayout, rank: int, kern: np.ndarray) -> np.ndarray:
    """One kernel page of ``rank`` from the TP=1 (heads, 2, kbs, hb) data, in the profile's K/V layout."""
    heads = kv_heads_of_rank(kern.shape[0], side.tp, rank)
    sel = kern[list(heads)]  # (h, 2, kbs, hb)
    if side.profile.kv_descs_per_block == 2:
        sel = sel.transpose(1, 0, 2, 3)  # K of all heads, then V of all heads
    out = np.ascontiguousarray(sel).reshape(-1)
    assert out.size == side.kernel_page_bytes, (out.size, side.kernel_page_bytes)
    return out


def rank_mamba_page(side: SideLayout, rank: int, conv: np.ndarray, ssm: np.ndarray, pad: int | None) -> np.ndarray:
    m = side.mamba
    assert m is not None
    c = conv[m.conv_channel_map(rank)].reshape(-1)
    h = ssm[list(m.ssm_rows(rank))].reshape(-1)
    assert c.size == m.conv_bytes and h.size == m.ssm_bytes, (c.size, m.conv_bytes, h.size, m.ssm_bytes)
    out = np.full(side.page_size_bytes, pad if pad is not None else 0, dtype=np.uint8)
    out[:c.size] = c
    out[c.size:c.size + h.size] = h
    return out


def _write_request(s: Setup, side: SideLayout, rank: int, tensors: list[np.ndarray],
                   blocks: tuple[tuple[int, ...], ...], pad: int | None) -> None:
    page = side.page_size_bytes
    kp = side.kernel_page_bytes
    for slot in range(side.num_shared_tensors):
        t = tensors[slot]
        for g, ids in zip(side.groups, blocks, strict=True):
            for j, b in enumerate(ids):
                base = b * page
                if g.kind == "attention":
                    fa = full_fa(s, slot, g.index, j)
                    for k in range(side.physical_per_logical):
                        t[base + k * kp: base + (k + 1) * kp] = rank_kernel_page(side, rank, fa[k])
                else:
                    conv, ssm = full_mamba(s, slot, g.index)
                    pg = rank_mamba_page(side, rank, conv, ssm, pad)
                    if pad is None:  # D: keep its padding bytes as they were
                        t[base: base + side.mamba_page_bytes] = pg[:side.mamba_page_bytes]
                    else:
                        t[base: base + page] = pg


def fill_prefill(s: Setup, rank: int) -> list[np.ndarray]:
    p = s.p
    tensors = [np.full(s.n_log * p.page_size_bytes, P_OTHER, dtype=np.uint8) for _ in range(p.num_shared_tensors)]
    _write_request(s, p, rank, tensors, s.p_blocks, P_PAD)
    return tensors


def init_decode(s: Setup) -> list[np.ndarray]:
    d = s.d
    return [np.full(s.n_log * d.page_size_bytes, D_INIT, dtype=np.uint8) for _ in range(d.num_shared_tensors)]


def expected_decode(s: Setup, rank: int) -> list[np.ndarray]:
    tensors = init_decode(s)
    _write_request(s, s.d, rank, tensors, s.d_blocks, None)
    return tensors


# --------------------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, kw_only=True)
class SourceView:
    """Everything one READ (D rank <- one P rank) needs: full tables plus the request's desc ids."""

    p_rank: int
    local: DescTable
    remote: DescTable
    local_ids: np.ndarray
    remote_ids: np.ndarray
    components: tuple[str, ...]  # per desc in the request
    injected: str | None  # human description of the injected fault


def _local_table_for(d: SideLayout, src: SourceRead, fa_index: int, n_fa: int, bases: list[int],
                     n_log: int) -> DescTable:
    """D's local view for one source: the whole local table, or, when P TP > D TP, each of its descriptors cut to
    the part this source fills: FA descriptors to the ``fa_index``-th of ``n_fa`` parts (zero length when the
    source holds no needed heads), Mamba descriptors to the ``local_slot``-th of ``local_parts`` parts."""
    full = local_table(d, bases, n_log)
    if src.local_parts == 1:
        return full
    addr, length = full.addr.copy(), full.length.copy()
    nf = full.num_fa_descs
    ln = (d.kernel_page_bytes // d.profile.kv_descs_per_block) // max(n_fa, 1) if src.fa is not None else 0
    addr[:nf] += np.uint64(fa_index * ln if src.fa is not None else 0)
    length[:nf] = ln
    length[nf:] //= np.uint64(src.local_parts)
    addr[nf:] += np.uint64(src.local_slot) * length[nf:]
    return DescTable(addr=addr, length=length, num_fa_descs=nf, n_phys=full.n_phys, n_log=full.n_log)


def _components(table: DescTable, ids: np.ndarray, names: tuple[str, ...]) -> tuple[str, ...]:
    """names: the Mamba descriptors of a slot in order (x, B, C, SSM / x, SSM / Q, K, V, SSM)."""
    out = []
    for i in ids.tolist():
        if i < table.num_fa_descs:
            out.append("FA")
        else:
            out.append(names[((i - table.num_fa_descs) // table.n_log) % len(names)])
    return tuple(out)


def transfer_views(s: Setup, rank: int, p_bases: dict[int, list[int]], d_bases: list[int]) -> list[SourceView]:
    """vLLM's two views (FA K/V and Mamba x/B/C/SSM) and desc-id lists for D ``rank``, one per source P rank."""
    assert s.plan.routes is not None
    route = s.plan.routes[rank]
    fa_srcs = [src.p_rank for src in route.sources if src.fa is not None]
    out: list[SourceView] = []
    for src in route.sources:
        remote = remote_table(s.p, src, p_bases[src.p_rank], s.n_log)
        fa_index = fa_srcs.index(src.p_rank) if src.p_rank in fa_srcs else 0
        local = _local_table_for(s.d, src, fa_index, len(fa_srcs), d_bases, s.n_log)
        has_fa = src.fa is not None
        has_m = src.conv is not None
        r_ids = request_desc_ids(s.p, remote, [list(b) for b in s.p_blocks], fa=has_fa, mamba=has_m)
        l_ids = request_desc_ids(s.d, local, [list(b) for b in s.d_blocks], fa=has_fa, mamba=has_m)
        assert r_ids.shape == l_ids.shape
        out.append(SourceView(p_rank=src.p_rank, local=local, remote=remote, local_ids=l_ids, remote_ids=r_ids,
                              components=_components(remote, r_ids, components_of(s.p)[1:]), injected=None))
    if s.inject and rank == s.inject_rank and out:
        out[0] = inject_fault(s, out[0])
    return out


def inject_fault(s: Setup, v: SourceView) -> SourceView:
    """Corrupt one descriptor of the request: shift the remote one by a block, or shorten both."""
    # pick the first Mamba B descriptor when there is one (small, easy to name), else the first FA one
    pick = next((k for k, c in enumerate(v.components) if c == "B"), 0)
    comp = v.components[pick]
    rid, lid = int(v.remote_ids[pick]), int(v.local_ids[pick])
    raddr, rlen = v.remote.addr.copy(), v.remote.length.copy()
    laddr, llen = v.local.addr.copy(), v.local.length.copy()
    if s.inject == "offset":
        step = s.p.page_size_bytes if comp != "FA" else s.p.kernel_page_bytes
        # one block up, or down for the last block: NIXL refuses descriptors outside registered memory
        blk, n = ((rid % v.remote.n_phys, v.remote.n_phys) if comp == "FA"
                  else ((rid - v.remote.num_fa_descs) % v.remote.n_log, v.remote.n_log))
        up = blk + 1 < n
        raddr[rid] = raddr[rid] + np.uint64(step) if up else raddr[rid] - np.uint64(step)
        what = f"remote descriptor {rid} ({comp}) shifted by one block ({'+' if up else '-'}{step:,} B)"
    else:
        cut = max(1, int(rlen[rid]) // 2)
        rlen[rid] -= np.uint64(cut)
        llen[lid] -= np.uint64(cut)
        what = f"descriptor {rid} ({comp}) shortened by {cut:,} B"
    return SourceView(p_rank=v.p_rank,
                      local=DescTable(addr=laddr, length=llen, num_fa_descs=v.local.num_fa_descs,
                                      n_phys=v.local.n_phys, n_log=v.local.n_log),
                      remote=DescTable(addr=raddr, length=rlen, num_fa_descs=v.remote.num_fa_descs,
                                       n_phys=v.remote.n_phys, n_log=v.remote.n_log),
                      local_ids=v.local_ids, remote_ids=v.remote_ids, components=v.components,
                      injected=f"injected fault, D rank {s.inject_rank} <- P rank {v.p_rank}: {what}")


def numpy_read(views: list[SourceView], p_tensors: dict[int, list[np.ndarray]], p_bases: dict[int, list[int]],
               d_tensors: list[np.ndarray], d_bases: list[int]) -> None:
    """The READs done with plain numpy copies (unit tests, and the bench's baseline)."""
    def locate(addr: int, bases: list[int], tensors: list[np.ndarray]) -> tuple[np.ndarray, int]:
        for b, t in zip(bases, tensors, strict=True):
            if b <= addr < b + t.size:
                return t, addr - b
        raise ValueError(f"address {addr:#x} outside every region")

    for v in views:
        for lid, rid in zip(v.local_ids.tolist(), v.remote_ids.tolist(), strict=True):
            n = int(v.local.length[lid])
            dt, do = locate(int(v.local.addr[lid]), d_bases, d_tensors)
            st, so = locate(int(v.remote.addr[rid]), p_bases[v.p_rank], p_tensors[v.p_rank])
            dt[do:do + n] = st[so:so + n]
