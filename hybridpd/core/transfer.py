"""P -> D transfer plan: who reads what from whom, and what one request moves.

Mirrors the NixlConnector (reference §3.3-3.7, §9.2): ``TransferTopology`` (source ranks),
``_build_fa_remote_for_mamba`` (FA head offsets), ``MambaConvSplitInfo.remote_conv_offsets``
(x/B/C offsets inside P's DS conv state), and the per-request accounting with the N-1 rule.
What vLLM *does* is computed here; whether that is *right* is checked against the ground truth
in ``hybridpd.core.mamba.rank_channels`` by findings and by the rehearsal.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.core.layout import SideLayout, cdiv
from hybridpd.core.mamba import MAMBA2_PARTS
from hybridpd.core.speculative import mamba_blocks_moved, prefill_lookahead

Span = tuple[int, int]  # (offset, length) in bytes


def tp_ratio(ptp: int, dtp: int) -> int:
    """vLLM: D_TP//P_TP when D >= P, else -(P_TP//D_TP)."""
    return dtp // ptp if dtp >= ptp else -(ptp // dtp)


def kv_heads_of_rank(total_kv: int, tp: int, rank: int) -> tuple[int, ...]:
    if tp <= total_kv:
        per = total_kv // tp
        return tuple(range(rank * per, (rank + 1) * per))
    return (rank * total_kv // tp,)


def remote_conv_offsets(r: int, t: int, xb: int, bb: int) -> tuple[Span, Span, Span]:
    """vLLM's rule: D-local sizes xb, bb; P's x section is t*xb and its B section t*bb."""
    return ((r * xb, xb), (t * xb + r * bb, bb), (t * xb + t * bb + r * bb, bb))


@dataclass(frozen=True, kw_only=True)
class SourceRead:
    """What one D rank reads from one P rank, per (layer slot, block)."""

    p_rank: int
    fa: Span | None  # offset inside P's kernel page and length of ONE FA descriptor (K, or K+V packed)
    fa_v_offset: int | None  # offset of the V descriptor when K and V move separately
    x: Span | None  # Mamba2's x, B, C (the same spans as ``conv``; None for other families)
    b: Span | None
    c: Span | None
    ssm: Span | None  # offset inside P's Mamba page
    local_slot: int  # which 1/k of each local sub-region this source fills (P TP > D TP), else 0
    local_parts: int  # k (P TP > D TP), else 1
    conv: tuple[Span, ...] | None = None  # one span per conv sub-projection (x|B|C, x, or Q|K|V), inside P's page
    conv_names: tuple[str, ...] = ()

    @property
    def mamba_spans(self) -> tuple[Span, ...]:
        """Every Mamba descriptor's span, in descriptor order: sub-projections, then the SSM state."""
        if self.conv is None:
            return ()
        return (*self.conv, *((self.ssm,) if self.ssm else ()))

    @property
    def mamba_bytes(self) -> int:
        return sum(s[1] for s in self.mamba_spans)


@dataclass(frozen=True, kw_only=True)
class RankRoute:
    rank: int
    sources: tuple[SourceRead, ...]

    @property
    def fa_sources(self) -> tuple[SourceRead, ...]:
        return tuple(s for s in self.sources if s.fa is not None)

    @property
    def mamba_sources(self) -> tuple[SourceRead, ...]:
        return tuple(s for s in self.sources if s.conv is not None)


def _source(d: SideLayout, pr: int, fa: Span | None, v_off: int | None, conv: tuple[Span, ...] | None,
            ssm: Span | None, slot: int, parts: int) -> SourceRead:
    names = d.mamba.conv.names if (d.mamba is not None and conv is not None) else ()
    x = b = c = None
    if conv is not None and names == MAMBA2_PARTS:
        x, b, c = conv
    return SourceRead(p_rank=pr, fa=fa, fa_v_offset=v_off, x=x, b=b, c=c, ssm=ssm, local_slot=slot,
                      local_parts=parts, conv=conv, conv_names=names)


def kv_head_token_bytes(side: SideLayout) -> int:
    """Bytes of one KV head's K (or V) for one token on ``side``: head_size x element size (0 if attention-free)."""
    return side.attn_bytes_per_token // (2 * side.num_kv_heads) if side.num_kv_heads else 0


def kv_head_block_bytes(side: SideLayout) -> int:
    """Bytes of one KV head's K (or V) over one kernel block: the unit FA head offsets step by."""
    return side.kernel_block_size * kv_head_token_bytes(side)


def fa_descs_per_source(p: SideLayout, blocks: int, kernel_blocks: int | None = None) -> int:
    """FA descriptors one FA source moves for a request of ``blocks`` logical blocks (``kernel_blocks`` kernel
    blocks per FA group when given, see ``fa_kernel_blocks``): tensors x attention groups x kernel blocks x
    (K and V, or K+V packed)."""
    kb = blocks * p.physical_per_logical if kernel_blocks is None else kernel_blocks
    return p.num_shared_tensors * len(p.attention_groups) * kb * p.profile.kv_descs_per_block


def fa_kernel_blocks(p: SideLayout, d: SideLayout, n: int) -> int:
    """Kernel blocks each FA group moves for ``n`` transferred tokens.

    P sends its logical ids, D allocates its own for the same ``n`` tokens; both sides expand them to kernel ids
    with their own ratio.  From 0.22 the worker (``_apply_prefix_caching`` / ``get_exchange_clipped_blocks``, the
    Mamba-hybrid branch) trims both lists to the shorter one when the kernel blocks are equal (block_size_ratio 1):
    e.g. P block 4176 (261 kernel blocks of 16), D block 2096 (131) at 999 tokens moves 131, not 261."""
    if not p.attention_groups:
        return 0
    kp = cdiv(n, p.block_size) * p.physical_per_logical
    if (p.profile.fa_trims_to_shorter_side and p.model.has_mamba and d.attention_groups
            and p.kernel_block_size == d.kernel_block_size):
        return min(kp, cdiv(n, d.block_size) * d.physical_per_logical)
    return kp


def source_request_bytes(p: SideLayout, src: SourceRead, blocks: int,
                         kernel_blocks: int | None = None) -> tuple[int, tuple[int, ...]]:
    """What one request moves from one source P rank: (FA bytes, bytes of each Mamba span in ``mamba_spans``
    order). Every Mamba span moves once per (slot holding SSM state, Mamba group, Mamba block moved)."""
    fa = fa_descs_per_source(p, blocks, kernel_blocks) * src.fa[1] if src.fa is not None and p.attention_groups \
        else 0
    rows = p.num_ssm_slots * len(p.mamba_groups) * mamba_blocks_per_group(p)
    return fa, tuple(rows * ln for _, ln in src.mamba_spans)


def routes(p: SideLayout, d: SideLayout) -> tuple[RankRoute, ...]:
    """For every D rank: its source P ranks and the byte spans vLLM's descriptors cover."""
    t = tp_ratio(p.tp, d.tp)
    kv_total = d.model.attention.num_kv_heads if (d.model.attention and d.model.attention_layers) else 0
    per_head_p = kv_head_block_bytes(p)
    kvd = p.profile.kv_descs_per_block
    out: list[RankRoute] = []
    for r in range(d.tp):
        srcs: list[SourceRead] = []
        d_heads = kv_heads_of_rank(kv_total, d.tp, r) if kv_total else ()
        d_fa_len = d.kernel_page_bytes // kvd if kv_total else 0
        if t >= 1:
            pr = r // t
            fa = v_off = None
            if kv_total:
                p_heads = kv_heads_of_rank(kv_total, p.tp, pr)
                head_off = (d_heads[0] - p_heads[0]) * per_head_p * (2 // kvd)  # K half per head, or K+V
                fa = (head_off, d_fa_len)
                v_off = head_off + p.kernel_page_bytes // 2 if kvd == 2 else None
            conv = ssm = None
            if d.mamba is not None and p.mamba is not None:
                conv = d.mamba.conv.remote_offsets(r % t, t)
                ssm = (p.mamba.conv_bytes + (r % t) * d.mamba.ssm_bytes, d.mamba.ssm_bytes)
            srcs.append(_source(d, pr, fa, v_off, conv, ssm, 0, 1))
        else:
            k = -t
            seen_heads: set[tuple[int, ...]] = set()
            fa_src: list[int] = []
            if kv_total:
                for j in range(k):
                    pr = r * k + j
                    ph = kv_heads_of_rank(kv_total, p.tp, pr)
                    if set(ph) & set(d_heads) and ph not in seen_heads:
                        seen_heads.add(ph)
                        fa_src.append(pr)
            n_fa = len(fa_src)
            for j in range(k):
                pr = r * k + j
                fa = v_off = None
                if pr in fa_src:
                    fa = (0, d_fa_len // n_fa)
                    v_off = p.kernel_page_bytes // 2 if kvd == 2 else None
                conv = ssm = None
                if d.mamba is not None and p.mamba is not None:
                    conv = d.mamba.conv.remote_offsets(0, t)
                    ssm = (p.mamba.conv_bytes, d.mamba.ssm_bytes // k)
                srcs.append(_source(d, pr, fa, v_off, conv, ssm, j, k))
        out.append(RankRoute(rank=r, sources=tuple(srcs)))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class RankRequest:
    rank: int
    fa_bytes: int
    mamba_bytes: int
    naive_bytes: int
    descriptors: int  # without coalescing
    descriptors_min: int  # with every contiguous run coalesced (profiles that coalesce)
    reads: int  # NIXL READ operations (one per source P rank)

    @property
    def bytes(self) -> int:
        return self.fa_bytes + self.mamba_bytes


@dataclass(frozen=True, kw_only=True)
class RequestTransfer:
    isl: int
    tokens_transferred: int  # N-1 for Mamba models (P prefills N-1; D computes token N)
    logical_blocks: int  # L
    per_rank: tuple[RankRequest, ...]

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.per_rank)

    @property
    def fa_bytes(self) -> int:
        return sum(r.fa_bytes for r in self.per_rank)

    @property
    def mamba_bytes(self) -> int:
        return sum(r.mamba_bytes for r in self.per_rank)

    @property
    def naive_bytes(self) -> int:
        return sum(r.naive_bytes for r in self.per_rank)

    @property
    def descriptors(self) -> int:
        return sum(r.descriptors for r in self.per_rank)

    @property
    def descriptors_min(self) -> int:
        return sum(r.descriptors_min for r in self.per_rank)

    @property
    def reads(self) -> int:
        return sum(r.reads for r in self.per_rank)


def prefill_backoff(p: SideLayout) -> int:
    """Prompt tokens P leaves for D to compute (nixl scheduler ``_prefill_backoff``).

    vLLM's N-1 rule (#37310): with Mamba layers P prefills N-1 tokens and D computes the last one.  From 0.31
    it is max(1, lookahead - 1), the lookahead being ``num_prefill_lookahead_tokens`` of the speculative method
    (core/speculative.py; NemotronH MTP: 1).  Without --speculative-config, hybridpd takes
    ``num_speculative_tokens`` as a multi-module MTP draft length."""
    base = 1 if p.model.has_mamba else 0
    if p.profile.backoff_uses_lookahead:
        s = p.settings
        look = (prefill_lookahead(p.model, s.speculative_method, s.num_speculative_tokens)
                if s.speculative_method else s.num_speculative_tokens)
        return max(base, look - 1)
    return base


def mamba_blocks_per_group(p: SideLayout) -> int:
    """Mamba states one request moves per Mamba group: 1, plus the speculative scratch slots where the release
    exchanges them (0.20 … 0.26; from 0.27 the NIXL scheduler strips them)."""
    return mamba_blocks_moved(p.settings.num_speculative_tokens, p.profile.first)


def tokens_transferred(p: SideLayout, isl: int) -> int:
    return max(isl - prefill_backoff(p), 1) if isl > 1 else isl


def request_transfer(p: SideLayout, d: SideLayout, rts: tuple[RankRoute, ...], isl: int) -> RequestTransfer:
    n = tokens_transferred(p, isl)
    blocks = cdiv(n, p.block_size) if p.attention_groups else 0
    kblocks = fa_kernel_blocks(p, d, n)
    T = p.num_shared_tensors
    Ts = p.num_ssm_slots
    G = len(p.mamba_groups) * mamba_blocks_per_group(p)  # Mamba (group, block) pairs that move
    kvd = p.profile.kv_descs_per_block
    # NIXL merges consecutive FA rows only when whole P kernel pages land in whole local pages ("dense"):
    # equal heads per rank on both sides (or <= 1 on both), and no P TP > D TP split over several FA sources
    # (docs/vllm-0.32-nixl-audit.md item 3).  Mamba rows never merge.
    dense = (p.num_kv_heads == d.num_kv_heads and (p.tp == d.tp or (p.num_kv_heads <= 1 and d.num_kv_heads <= 1)))
    per: list[RankRequest] = []
    for rt in rts:
        merge = p.profile.coalesces_contiguous_blocks and dense and len(rt.fa_sources) <= 1
        fa_bytes = mamba_bytes = descs = descs_min = 0
        for s in rt.sources:
            fa_b, span_b = source_request_bytes(p, s, blocks, kblocks)
            fa_bytes += fa_b
            mamba_bytes += sum(span_b)
            if s.fa is not None and p.attention_groups:
                n_fa = fa_descs_per_source(p, blocks, kblocks)
                descs += n_fa
                descs_min += (T * len(p.attention_groups) * kvd if blocks else 0) if merge else n_fa
            if s.conv is not None and G:
                n_m = len(s.mamba_spans) * Ts * G  # (sub-projections + SSM) per slot holding SSM state
                descs += n_m
                descs_min += n_m
        naive = fa_bytes + Ts * G * d.page_size_bytes if d.mamba is not None else fa_bytes
        per.append(RankRequest(rank=rt.rank, fa_bytes=fa_bytes, mamba_bytes=mamba_bytes, naive_bytes=naive,
                               descriptors=descs, descriptors_min=descs_min, reads=len(rt.sources)))
    return RequestTransfer(isl=isl, tokens_transferred=n, logical_blocks=blocks, per_rank=tuple(per))


@dataclass(frozen=True, kw_only=True)
class DescriptorLayout:
    """One side's registered NIXL descriptors (reference §3.2-3.4, §9.2)."""

    regions: int  # registered memory regions (shared tensors)
    fa_regions: int  # virtual FA regions (2T when K/V separate, T when packed)
    mamba_regions: int  # (sub-projections + 1) * T_ssm: 4 (x|B|C or Q|K|V, SSM) or 2 (Mamba-1 x, SSM) per slot
    fa_desc_len: int  # bytes per FA descriptor (local)
    mamba_desc_lens: tuple[int, ...]  # per slot: each conv sub-projection, then SSM
    num_phys_blocks: int | None  # N_phys = N_log * ratio
    num_logical_blocks: int | None
    num_fa_descs: int | None  # the FA/Mamba boundary in desc ids
    local_descs: int | None
    registered_rows: int | None  # rows handed to NIXL: local_descs, or (0.33 strided) one per region run
    mamba_desc_names: tuple[str, ...] = ("x", "B", "C", "ssm")  # names of mamba_desc_lens

    @property
    def mamba_id_formula(self) -> str:
        conv = self.mamba_desc_names[:-1]
        n = len(self.mamba_desc_names)
        named = ",".join(f"{c}:{i}" for i, c in enumerate((*conv, "SSM")))
        return f"num_fa_descs + m * N_log + b   (m = {n}*tensor + {{{named}}}, b = logical block)"

    @staticmethod
    def of(side: SideLayout) -> DescriptorLayout:
        T = side.num_shared_tensors
        kvd = side.profile.kv_descs_per_block
        fa_regions = T * kvd if side.attention_groups else 0
        mamba_regions = side.mamba.regions_per_slot * side.num_ssm_slots \
            if side.mamba is not None and side.mamba_groups else 0
        lens: tuple[int, ...] = (0, 0, 0, 0)
        if side.mamba is not None:
            lens = tuple(ln for _, ln in side.mamba.desc_spans())
        nlog = side.num_blocks
        nphys = nlog * side.physical_per_logical if nlog is not None else None
        nfa = fa_regions * nphys if nphys is not None else None
        local = (nfa + mamba_regions * nlog) if (nfa is not None and nlog is not None) else None
        rows = local
        if side.profile.strided_descriptors:
            # _block_strided_descs: an FA region is one row when its blocks are back to back (stride == ratio*len,
            # always so with K and V packed), else one row per block; Mamba one row per (region, sub-projection).
            fa_len = side.kernel_page_bytes // kvd if fa_regions else 0
            fa_rows = fa_regions if (kvd == 1 or fa_len * side.physical_per_logical == side.page_size_bytes) \
                else nfa
            rows = None if fa_rows is None else fa_rows + mamba_regions
        return DescriptorLayout(regions=T, fa_regions=fa_regions, mamba_regions=mamba_regions,
                                fa_desc_len=side.kernel_page_bytes // kvd if fa_regions else 0,
                                mamba_desc_lens=lens, num_phys_blocks=nphys, num_logical_blocks=nlog,
                                num_fa_descs=nfa, local_descs=local, registered_rows=rows,
                                mamba_desc_names=(*side.mamba.part_names, "ssm") if side.mamba is not None
                                else ("x", "B", "C", "ssm"))
