"""Ground truth vs what vLLM's offsets deliver, channel by channel.

For each D rank, ``expected_conv_channels`` lists the TP=1 conv channels its DS conv state must hold
(in local order); ``delivered_conv_channels`` follows vLLM's sub-projection spans (x|B|C for Mamba2,
x for Mamba-1, Q|K|V for GatedDeltaNet) through each source P rank's own channel map and reports what
actually lands there (or that a span runs past P's conv state into its SSM bytes).  The same comparison
drives the plan's finding and the rehearsal's expectations, so "wrong bytes" has one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.core.layout import SideLayout
from hybridpd.core.transfer import RankRoute

OUTSIDE_CONV = -1  # the span covered bytes past P's conv state (P's SSM state or padding)


@dataclass(frozen=True, kw_only=True)
class ConvCheck:
    rank: int
    ok: bool
    first_bad: int | None  # first local channel that differs
    region: str | None  # the sub-projection: "x" | "B" | "C" | "Q" | "K" | "V"
    expected: int | None  # global channel expected there
    delivered: int | None  # global channel delivered (OUTSIDE_CONV: SSM/padding bytes)


def expected_conv_channels(d: SideLayout, rank: int) -> list[int]:
    assert d.mamba is not None
    return d.mamba.conv_channel_map(rank)


def _region_of(d: SideLayout, local_ch: int) -> str:
    assert d.mamba is not None
    conv = d.mamba.conv
    start = 0
    for name, n in zip(conv.names, conv.channels, strict=True):
        if local_ch < start + n:
            return name
        start += n
    return conv.names[-1]


def delivered_conv_channels(p: SideLayout, d: SideLayout, route: RankRoute) -> list[int]:
    assert p.mamba is not None and d.mamba is not None
    row_bytes = p.mamba.conv.row_bytes  # one DS channel
    dconv = d.mamba.conv
    out = [OUTSIDE_CONV] * dconv.dim
    d_starts = [sum(dconv.channels[:i]) for i in range(len(dconv.channels))]
    for src in route.mamba_sources:
        p_map = p.mamba.conv_channel_map(src.p_rank)
        assert src.conv is not None
        for i, (off, length) in enumerate(src.conv):
            n = length // row_bytes
            dst0 = d_starts[i] + src.local_slot * (dconv.channels[i] // src.local_parts)
            for j in range(n):
                pch = off // row_bytes + j
                out[dst0 + j] = p_map[pch] if pch < len(p_map) else OUTSIDE_CONV
    return out


def check_conv(p: SideLayout, d: SideLayout, route: RankRoute) -> ConvCheck:
    exp = expected_conv_channels(d, route.rank)
    got = delivered_conv_channels(p, d, route)
    for i, (e, g) in enumerate(zip(exp, got, strict=True)):
        if e != g:
            return ConvCheck(rank=route.rank, ok=False, first_bad=i, region=_region_of(d, i), expected=e, delivered=g)
    return ConvCheck(rank=route.rank, ok=True, first_bad=None, region=None, expected=None, delivered=None)
