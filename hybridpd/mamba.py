"""Mamba2 state geometry per TP rank: shapes, bytes, the x|B|C conv split, and channel ownership.

Mirrors ``MambaStateShapeCalculator.mamba2_state_shape`` and ``extra_groups_for_head_shards``
(vllm/model_executor/layers/mamba/mamba_utils.py), and the sharding that ``MambaMixer2`` applies
to x, B, C and the SSM heads.  ``RankChannels`` is the *ground truth* of which global channels and
heads a rank holds; ``ConvSplit`` is what a rank's conv state looks like.  ``convert`` and
``verify --rehearse`` both read these, so there is one definition of "rank r's slice".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .errors import UsageError
from .families import MambaDims

SD = "SD"  # (state_len, dim): dim innermost, vLLM's default
DS = "DS"  # (dim, state_len): required for NIXL P/D


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
    """Per-rank conv state: channels ``[x | B | C]`` (DS: channel-major, each ``state_len`` long)."""

    x_channels: int
    b_channels: int  # == C channels
    state_len: int
    elem_size: int

    @property
    def dim(self) -> int:
        return self.x_channels + 2 * self.b_channels

    @property
    def x_bytes(self) -> int:
        return self.x_channels * self.state_len * self.elem_size

    @property
    def b_bytes(self) -> int:
        return self.b_channels * self.state_len * self.elem_size

    @property
    def nbytes(self) -> int:
        return self.dim * self.state_len * self.elem_size

    def shape(self, layout: str) -> tuple[int, int]:
        return (self.state_len, self.dim) if layout == SD else (self.dim, self.state_len)

    def local_offsets(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(offset, length) in bytes of x, B, C inside this rank's DS conv state."""
        xb, bb = self.x_bytes, self.b_bytes
        return ((0, xb), (xb, bb), (xb + bb, bb))


@dataclass(frozen=True, kw_only=True)
class MambaRankState:
    """Everything about one rank's Mamba2 state."""

    dims: MambaDims
    tp: int
    num_spec: int
    conv_dtype: str
    conv_elem: int
    ssm_dtype: str
    ssm_elem: int

    @cached_property
    def n_groups_eff(self) -> int:
        return self.dims.n_groups + extra_groups_for_head_shards(self.dims.n_groups, self.tp)

    @cached_property
    def conv_dim_global(self) -> int:
        return self.dims.intermediate_size + 2 * self.n_groups_eff * self.dims.state_size

    @cached_property
    def conv(self) -> ConvSplit:
        x = _divide(self.dims.intermediate_size, self.tp, "Mamba intermediate size")
        b = _divide(self.n_groups_eff * self.dims.state_size, self.tp, "n_groups*state_size")
        _divide(self.conv_dim_global, self.tp, "conv_dim")
        return ConvSplit(x_channels=x, b_channels=b, state_len=self.dims.conv_kernel - 1 + self.num_spec,
                         elem_size=self.conv_elem)

    @cached_property
    def heads(self) -> int:
        return _divide(self.dims.num_heads, self.tp, "Mamba heads")

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.dims.head_dim, self.dims.state_size)

    @property
    def conv_bytes(self) -> int:
        return self.conv.nbytes

    @property
    def ssm_bytes(self) -> int:
        return self.heads * self.dims.head_dim * self.dims.state_size * self.ssm_elem

    @property
    def page_bytes(self) -> int:
        """Unpadded Mamba page: conv + ssm."""
        return self.conv_bytes + self.ssm_bytes


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
