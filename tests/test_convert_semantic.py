"""Semantics: the DS shard ``convert --tp-split`` writes for D rank r is exactly what the transfer plan's
``remote_conv_offsets`` says rank r reads from P's DS conv page -- and, for n_groups=1, it is not (vLLM bug).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_convert_support import GRANITE, geo, load, rand, save

from hybridpd.convert.plan import Geometry
from hybridpd.convert.run import ConvertOptions, convert, geometry_for

try:  # the plan's copy of vLLM's rule (MambaConvSplitInfo.remote_conv_offsets)
    from hybridpd.core.transfer import remote_conv_offsets
except ImportError:  # pragma: no cover - until hybridpd.core.transfer exists: the same rule, reference §3.6
    def remote_conv_offsets(r: int, t: int, xb: int, bb: int) -> tuple[tuple[int, int], ...]:  # type: ignore[misc]
        return ((r * xb, xb), (t * xb + r * bb, bb), (t * xb + t * bb + r * bb, bb))


def ds_pages(tmp: Path, g: Geometry, full: torch.Tensor, tp: int) -> list[bytes]:
    """Each rank's DS conv state bytes (one layer, one block), as `convert` writes them."""
    name = f"tp{tp}"
    if tp == 1:
        convert(tmp / "full.safetensors", tmp / f"{name}.safetensors", ConvertOptions(to="DS", geometry=g))
        files = [tmp / f"{name}.safetensors"]
    else:
        convert(tmp / "full.safetensors", tmp / name, ConvertOptions(to="DS", geometry=g, tp_split=tp))
        files = [tmp / name / f"full.rank{r}-of-{tp}.safetensors" for r in range(tp)]
    return [load(f)["conv_state"].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for f in files]


def vllm_reads(g: Geometry, ptp: int, dtp: int, p_pages: list[bytes], r: int) -> bytes:
    conv = g.rank_state(dtp, elem=2).conv  # D-local sizes
    t = dtp // ptp
    page = p_pages[r // t]
    return b"".join(page[off:off + n] for off, n in remote_conv_offsets(r % t, t, conv.x_bytes, conv.b_bytes))


@pytest.mark.parametrize(("ptp", "dtp"), [(1, 1), (1, 2), (1, 4), (2, 4), (1, 8), (2, 8), (4, 8)])
def test_ds_shard_equals_what_remote_conv_offsets_read(tmp_path: Path, ptp: int, dtp: int) -> None:
    g = geometry_for("nano")  # n_groups 8: divisible by every TP here
    assert g.dims.n_groups % dtp == 0
    full = rand((g.state_len, g.rank_state(1).conv.dim), torch.bfloat16)  # SD, as vLLM keeps it by default
    save(tmp_path / "full.safetensors", {"conv_state": full})
    p_pages = ds_pages(tmp_path, g, full, ptp)
    d_pages = p_pages if dtp == ptp else ds_pages(tmp_path, g, full, dtp)
    assert len(d_pages[0]) == g.rank_state(dtp, elem=2).conv.nbytes
    for r in range(dtp):
        assert vllm_reads(g, ptp, dtp, p_pages, r) == d_pages[r], f"D rank {r}"


def test_n_groups_1_tp1_to_tp2_vllm_offsets_are_not_the_shard(tmp_path: Path) -> None:
    """Known vLLM bug (reference vllm-cpu-notes §3.3; vLLM #55208): with n_groups=1, P TP1 -> D TP2,
    ``remote_conv_offsets`` assumes P holds TP copies of the B/C group.  P holds one, so D rank 0 reads
    C from P's SSM state and D rank 1 reads P's C into its B slot.  `convert` writes the true shard."""
    g = geo(GRANITE)
    full = rand((g.state_len, g.rank_state(1).conv.dim), torch.bfloat16)
    save(tmp_path / "full.safetensors", {"conv_state": full})
    p_page, d_pages = ds_pages(tmp_path, g, full, 1)[0], ds_pages(tmp_path, g, full, 2)
    conv = g.rank_state(2, elem=2).conv
    xb, bb = conv.x_bytes, conv.b_bytes
    p_x = 2 * xb  # P's x section; its B and C sections are bb each (one group)
    assert len(p_page) == p_x + 2 * bb
    for r in range(2):
        (xo, _), (bo, _), (co, _) = remote_conv_offsets(r, 2, xb, bb)
        assert vllm_reads(g, 1, 2, [p_page], r) != d_pages[r]
        assert p_page[xo:xo + xb] == d_pages[r][:xb]  # x is right
        assert co + bb > len(p_page)  # C is read beyond P's conv state (from its SSM state)
        truth_b, truth_c = d_pages[r][xb:xb + bb], d_pages[r][xb + bb:]
        assert truth_b == p_page[p_x:p_x + bb] and truth_c == p_page[p_x + bb:]  # replicated group 0
        if r == 0:
            assert p_page[bo:bo + bb] == truth_b  # rank 0: B right, C wrong
        else:
            assert p_page[bo:bo + bb] == truth_c  # rank 1: B slot gets P's C
