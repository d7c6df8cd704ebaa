"""Recurrent-state geometry per TP rank: shapes, bytes, the conv sub-projections, and channel ownership.

One model of "what a rank's Mamba state is" for every family the NixlConnector moves:

* Mamba2 (``MambaStateShapeCalculator.mamba2_state_shape``): conv ``[x | B | C]`` (with
  ``extra_groups_for_head_shards`` replicating groups when n_groups % TP != 0), SSM (heads, head_dim, state);
* Mamba-1 (``mamba1_state_shape``, Jamba): conv ``[x]`` (intermediate/TP channels, ``conv_kernel - 1``
  columns, no speculative rows), SSM (intermediate/TP, state_size);
* GatedDeltaNet (``gated_delta_net_state_shape``, Qwen3-Next): conv ``[Q | K | V]`` (key, key, value dims / TP),
  recurrent state (num_v_heads/TP, head_v_dim, head_k_dim).

``ConvSplit`` is a rank's conv state as a list of sub-projections, exactly as vLLM's NIXL worker decomposes it
(``ssm_conv_transfer_utils.MambaConvSplitInfo``: ``local_conv_offsets``, ``remote_conv_offsets``); a layer slot gets
one descriptor per sub-projection plus one for the SSM state.  ``conv_channel_map`` / ``ssm_rows`` are the *ground
truth* of which global (TP=1) channels and SSM rows a rank holds, as the mixers shard them; ``convert``,
``semantics`` and ``verify --rehearse`` read these, so there is one definition of "rank r's slice".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar

from hybridpd.core.families import GdnDims, Mamba1Dims, MambaDims, ModelSpec
from hybridpd.core.profiles import PlatformProfile
from hybridpd.errors import UsageError

SD = "SD"  # (state_len, dim): dim innermost, vLLM's default
DS = "DS"  # (dim, state_len): required for NIXL P/D

Span = tuple[int, int]  # (offset, length) in bytes

MAMBA2_PARTS = ("x", "B", "C")
MAMBA1_PARTS = ("x",)
GDN_PARTS = ("Q", "K", "V")


def extra_groups_for_head_shards(n_groups: int, tp: int) -> int:
    """vLLM: groups are replicated so every head shard carries its group."""
    return 0 if n_groups % tp == 0 else tp - n_groups


def _divide(num: int, den: int, what: str) -> int:
    if num % den:
        raise UsageError(f"{what} {num} is not divisible by TP {den}", field="tp",
                         fix=f"choose a TP size that divides {num}")
    return num // den


@dataclass(frozen=True, kw_only=True)
class ConvSplit:
    """Per-rank conv state as vLLM's NIXL worker sees it: sub-projections in memory order (DS: channel-major,
    each channel ``state_len`` elements long)."""

    names: tuple[str, ...]  # ("x", "B", "C") | ("x",) | ("Q", "K", "V")
    channels: tuple[int, ...]  # per-rank channels of each sub-projection
    state_len: int
    elem_size: int

    @property
    def dim(self) -> int:
        return sum(self.channels)

    @property
    def row_bytes(self) -> int:
        """Bytes of one DS channel."""
        return self.state_len * self.elem_size

    @property
    def part_bytes(self) -> tuple[int, ...]:
        return tuple(c * self.row_bytes for c in self.channels)

    @property
    def nbytes(self) -> int:
        return self.dim * self.row_bytes

    # Mamba2 names, kept for the callers that speak x/B/C
    @property
    def x_channels(self) -> int:
        return self.channels[0]

    @property
    def b_channels(self) -> int:  # == C channels
        assert self.names == MAMBA2_PARTS, self.names
        return self.channels[1]

    @property
    def x_bytes(self) -> int:
        return self.part_bytes[0]

    @property
    def b_bytes(self) -> int:
        assert self.names == MAMBA2_PARTS, self.names
        return self.part_bytes[1]

    def shape(self, layout: str) -> tuple[int, int]:
        return (self.state_len, self.dim) if layout == SD else (self.dim, self.state_len)

    def local_offsets(self) -> tuple[Span, ...]:
        """(offset, length) in bytes of each sub-projection inside this rank's DS conv state
        (``MambaConvSplitInfo.local_conv_offsets``)."""
        out: list[Span] = []
        off = 0
        for size in self.part_bytes:
            out.append((off, size))
            off += size
        return tuple(out)

    def remote_offsets(self, local_rank_offset: int, tp_ratio: int) -> tuple[Span, ...]:
        """``MambaConvSplitInfo.remote_conv_offsets``: this (D) rank's slices inside one P page.

        tp_ratio >= 1: P's sub-projection i is ``tp_ratio`` times D's, D reads slice ``local_rank_offset`` of it;
        tp_ratio < 0: P's pages are |tp_ratio| times smaller, D reads each P sub-projection whole."""
        out: list[Span] = []
        base = 0
        if tp_ratio >= 1:
            for size in self.part_bytes:
                out.append((base + local_rank_offset * size, size))
                base += size * tp_ratio
        else:
            k = -tp_ratio
            for size in self.part_bytes:
                out.append((base, size // k))
                base += size // k
        return tuple(out)

    def as_dict(self) -> dict[str, int]:
        out = dict(zip(self.names, self.channels, strict=True))
        out["state_len"] = self.state_len
        return out


@dataclass(frozen=True, kw_only=True)
class RankState:
    """One rank's recurrent state: the part every family shares."""

    kind: ClassVar[str]
    tp: int
    num_spec: int
    conv_dtype: str
    conv_elem: int
    ssm_dtype: str
    ssm_elem: int

    @property
    def conv(self) -> ConvSplit:
        raise NotImplementedError

    @property
    def ssm_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def heads(self) -> int:
        """SSM rows per rank: the temporal state's first dimension, the one TP shards."""
        return self.ssm_shape[0]

    @property
    def n_groups_eff(self) -> int | None:
        return None

    @property
    def part_names(self) -> tuple[str, ...]:
        return self.conv.names

    @property
    def regions_per_slot(self) -> int:
        """NIXL Mamba regions per layer slot: conv sub-projections + 1 SSM (Mamba2/GDN 4, Mamba-1 2)."""
        return len(self.conv.names) + 1

    @property
    def conv_bytes(self) -> int:
        return self.conv.nbytes

    @property
    def ssm_bytes(self) -> int:
        n = self.ssm_elem
        for d in self.ssm_shape:
            n *= d
        return n

    @property
    def ssm_row_bytes(self) -> int:
        return self.ssm_bytes // self.heads

    @property
    def page_bytes(self) -> int:
        """Unpadded Mamba page: conv + ssm."""
        return self.conv_bytes + self.ssm_bytes

    def desc_spans(self) -> tuple[Span, ...]:
        """A slot's Mamba descriptors inside one page: each sub-projection, then the SSM state."""
        return (*self.conv.local_offsets(), (self.conv_bytes, self.ssm_bytes))

    def validate(self) -> None:
        """Raise UsageError where vLLM's model construction refuses this TP."""
        _ = self.conv, self.ssm_shape

    def prefill_checkpoint_alignment(self, platform: PlatformProfile) -> int | None:
        """``get_mamba_prefill_checkpoint_alignment`` (0.33, 'align' mode): None unless the layers declare one."""
        return None

    def at_tp(self, tp: int) -> RankState:
        return replace(self, tp=tp)

    def conv_channel_map(self, rank: int) -> list[int]:
        """Ground truth: the TP=1 conv channel behind each local conv channel of ``rank``."""
        raise NotImplementedError

    def ssm_rows(self, rank: int) -> tuple[int, ...]:
        """Ground truth: the TP=1 SSM rows (heads / channels) ``rank`` holds, in local order."""
        self._check_rank(rank)
        h = self.heads
        return tuple(range(rank * h, (rank + 1) * h))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise UsageError(f"rank {rank} outside TP {self.tp}", field="rank")

    def _linear_map(self, rank: int, globals_: tuple[int, ...]) -> list[int]:
        """Each sub-projection of global width g sharded linearly: rank r holds [r*g/tp, (r+1)*g/tp)."""
        self._check_rank(rank)
        out: list[int] = []
        base = 0
        for g, local in zip(globals_, self.conv.channels, strict=True):
            out.extend(range(base + rank * local, base + (rank + 1) * local))
            base += g
        return out


@dataclass(frozen=True, kw_only=True)
class MambaRankState(RankState):
    """Everything about one rank's Mamba2 state."""

    kind: ClassVar[str] = "mamba2"
    dims: MambaDims

    @cached_property
    def n_groups_eff(self) -> int:  # type: ignore[override]
        return self.dims.n_groups + extra_groups_for_head_shards(self.dims.n_groups, self.tp)

    @cached_property
    def conv_dim_global(self) -> int:
        return self.dims.intermediate_size + 2 * self.n_groups_eff * self.dims.state_size

    @cached_property
    def conv(self) -> ConvSplit:  # type: ignore[override]
        x = _divide(self.dims.intermediate_size, self.tp, "Mamba intermediate size")
        b = _divide(self.n_groups_eff * self.dims.state_size, self.tp, "n_groups*state_size")
        _divide(self.conv_dim_global, self.tp, "conv_dim")
        return ConvSplit(names=MAMBA2_PARTS, channels=(x, b, b), state_len=self.dims.conv_kernel - 1 + self.num_spec,
                         elem_size=self.conv_elem)

    @cached_property
    def heads(self) -> int:  # type: ignore[override]
        return _divide(self.dims.num_heads, self.tp, "Mamba heads")

    @property
    def ssm_shape(self) -> tuple[int, int, int]:  # type: ignore[override]
        return (self.heads, self.dims.head_dim, self.dims.state_size)

    def validate(self) -> None:
        _ = self.conv, self.heads
        rank_channels(self.dims, self.tp, 0)  # n_groups vs TP: MambaMixer2's assert

    def conv_channel_map(self, rank: int) -> list[int]:
        return global_conv_channel_index(self.dims, rank_channels(self.dims, self.tp, rank))

    def ssm_rows(self, rank: int) -> tuple[int, ...]:
        return rank_channels(self.dims, self.tp, rank).heads


@dataclass(frozen=True, kw_only=True)
class Mamba1RankState(RankState):
    """One rank's Mamba-1 state (Jamba): conv [x] of intermediate/TP channels, SSM (intermediate/TP, state)."""

    kind: ClassVar[str] = "mamba1"
    dims: Mamba1Dims

    @cached_property
    def channels(self) -> int:
        return _divide(self.dims.intermediate_size, self.tp, "Mamba-1 intermediate size")

    @cached_property
    def conv(self) -> ConvSplit:  # type: ignore[override]
        # mamba1_state_shape takes no num_spec: the conv state is conv_kernel - 1 columns whatever the drafter
        return ConvSplit(names=MAMBA1_PARTS, channels=(self.channels,), state_len=self.dims.conv_kernel - 1,
                         elem_size=self.conv_elem)

    @property
    def ssm_shape(self) -> tuple[int, int]:  # type: ignore[override]
        return (self.channels, self.dims.state_size)

    def conv_channel_map(self, rank: int) -> list[int]:
        return self._linear_map(rank, (self.dims.intermediate_size,))


@dataclass(frozen=True, kw_only=True)
class GdnRankState(RankState):
    """One rank's GatedDeltaNet state (Qwen3-Next): conv [Q | K | V], recurrent (v_heads/TP, v_dim, k_dim)."""

    kind: ClassVar[str] = "gdn"
    dims: GdnDims

    @property
    def key_dim(self) -> int:
        return self.dims.num_k_heads * self.dims.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.dims.num_v_heads * self.dims.head_v_dim

    @cached_property
    def conv(self) -> ConvSplit:  # type: ignore[override]
        # the mixer shards Q, K and V by heads (mamba_v2_sharded_weight_loader over [key, key, value])
        _divide(self.dims.num_k_heads, self.tp, "GatedDeltaNet key heads")
        v_heads = _divide(self.dims.num_v_heads, self.tp, "GatedDeltaNet value heads")
        k = self.key_dim // self.tp
        v = v_heads * self.dims.head_v_dim
        _divide(2 * self.key_dim + self.value_dim, self.tp, "GatedDeltaNet conv_dim")
        return ConvSplit(names=GDN_PARTS, channels=(k, k, v), state_len=self.dims.conv_kernel - 1 + self.num_spec,
                         elem_size=self.conv_elem)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:  # type: ignore[override]
        v_heads = _divide(self.dims.num_v_heads, self.tp, "GatedDeltaNet value heads")
        return (v_heads, self.dims.head_v_dim, self.dims.head_k_dim)

    def conv_channel_map(self, rank: int) -> list[int]:
        return self._linear_map(rank, (self.key_dim, self.key_dim, self.value_dim))

    def prefill_checkpoint_alignment(self, platform: PlatformProfile) -> int | None:
        return platform.gdn_prefill_checkpoint_alignment


def rank_state(model: ModelSpec, *, tp: int, num_spec: int, conv_dtype: str, conv_elem: int, ssm_dtype: str,
               ssm_elem: int) -> RankState | None:
    """The rank state of ``model``'s recurrent layers, or None when it has none hybridpd models."""
    kw = dict(tp=tp, num_spec=num_spec, conv_dtype=conv_dtype, conv_elem=conv_elem, ssm_dtype=ssm_dtype,
              ssm_elem=ssm_elem)
    if model.mamba is not None:
        return MambaRankState(dims=model.mamba, **kw)  # type: ignore[arg-type]
    if isinstance(model.recurrent, Mamba1Dims):
        return Mamba1RankState(dims=model.recurrent, **kw)  # type: ignore[arg-type]
    if isinstance(model.recurrent, GdnDims):
        return GdnRankState(dims=model.recurrent, **kw)  # type: ignore[arg-type]
    return None


@dataclass(frozen=True, kw_only=True)
class RankChannels:
    """Ground truth: which global channels / heads rank ``rank`` of ``tp`` holds, in local order."""

    x: tuple[int, ...]  # indices into the global x channels [0, intermediate)
    b_groups: tuple[int, ...]  # global group indices whose B (and C) channels the rank holds, in order
    heads: tuple[int, ...]  # global SSM head indices


def rank_channels(dims: MambaDims, tp: int, rank: int) -> RankChannels:
    """How MambaMixer2 shards x, B/C groups and heads (with replication when n_groups % tp != 0)."""
    if not 0 <= rank < tp:
        raise UsageError(f"rank {rank} outside TP {tp}", field="rank")
    x = _divide(dims.intermediate_size, tp, "Mamba intermediate size")
    h = _divide(dims.num_heads, tp, "Mamba heads")
    if dims.n_groups % tp == 0:
        per = dims.n_groups // tp
        groups = tuple(range(rank * per, (rank + 1) * per))
    elif dims.n_groups == 1:
        groups = (0,)  # replicated on every rank
    else:
        # vLLM rejects this at model construction (MambaMixer2 asserts); callers check first.
        raise UsageError(f"n_groups {dims.n_groups} is neither 1 nor divisible by TP {tp}", field="n_groups",
                         fix=f"use a TP that divides {dims.n_groups}")
    return RankChannels(x=tuple(range(rank * x, (rank + 1) * x)), b_groups=groups,
                        heads=tuple(range(rank * h, (rank + 1) * h)))


def global_conv_channel_index(dims: MambaDims, ch: RankChannels) -> list[int]:
    """Map each local conv channel of a rank to its channel in the TP=1 conv state ``[x | B | C]``."""
    ss = dims.state_size
    inter = dims.intermediate_size
    b_base = inter
    c_base = inter + dims.n_groups * ss
    out = list(ch.x)
    for g in ch.b_groups:
        out.extend(range(b_base + g * ss, b_base + (g + 1) * ss))
    for g in ch.b_groups:
        out.extend(range(c_base + g * ss, c_base + (g + 1) * ss))
    return out
