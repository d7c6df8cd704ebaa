"""Hypothesis round trips: SD->DS->SD and TP split->merge are bit-identical over shapes, dtypes and TP."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_convert_support import DTYPES, conv_ds, data_sha, geo, load, rand, reference_shard, reference_ssm, same_bits, save

from hybridpd.convert.run import ConvertOptions, check, convert
from hybridpd.core.families import MambaDims

# HYBRIDPD_CONVERT_EXAMPLES=500 for a deeper search than the default run's.
SETTINGS = settings(max_examples=int(os.environ.get("HYBRIDPD_CONVERT_EXAMPLES", "30")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
lead_dims = st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple)


@st.composite
def mamba_dims(draw: st.DrawFn) -> MambaDims:
    n_groups = draw(st.sampled_from([1, 2, 4]))
    heads = n_groups * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([1, 2, 4]))
    return MambaDims(num_heads=heads, head_dim=head_dim, n_groups=n_groups, state_size=draw(st.integers(1, 5)),
                     conv_kernel=draw(st.integers(2, 4)), intermediate_size=heads * head_dim)


@SETTINGS
@given(lead=lead_dims, state_len=st.integers(1, 6), dim=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       start=st.sampled_from(["SD", "DS"]), chunk=st.sampled_from([7, 1 << 20]), seed=st.integers(0, 2**16))
def test_layout_round_trip(lead: tuple[int, ...], state_len: int, dim: int, dtype: torch.dtype, start: str,
                           chunk: int, seed: int) -> None:
    shape = (*lead, state_len, dim) if start == "SD" else (*lead, dim, state_len)
    x = rand(shape, dtype, seed)
    other = "DS" if start == "SD" else "SD"
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        save(p / "a.safetensors", {"conv_state": x, "keep": rand((3,), dtype, seed + 1)})
        convert(p / "a.safetensors", p / "b.safetensors", ConvertOptions(to=other, from_layout=start,
                                                                           chunk_bytes=chunk))
        b = load(p / "b.safetensors")
        assert same_bits(b["conv_state"], x.transpose(-1, -2).contiguous())
        convert(p / "b.safetensors", p / "c.safetensors", ConvertOptions(to=start, chunk_bytes=chunk))
        c = load(p / "c.safetensors")
        assert same_bits(c["conv_state"], x) and same_bits(c["keep"], b["keep"])
        assert data_sha(p / "c.safetensors") == data_sha(p / "a.safetensors")


@SETTINGS
@given(dims=mamba_dims(), spec=st.integers(0, 2), lead=lead_dims, dtype=st.sampled_from(DTYPES),
       ssm_dtype=st.sampled_from([torch.float32, torch.bfloat16]), layouts=st.tuples(
           st.sampled_from(["SD", "DS"]), st.sampled_from(["SD", "DS"]), st.sampled_from(["SD", "DS"])),
       tp_pick=st.integers(0, 10), chunk=st.sampled_from([5, 1 << 20]), seed=st.integers(0, 2**16))
def test_split_merge_round_trip(dims: MambaDims, spec: int, lead: tuple[int, ...], dtype: torch.dtype,
                                ssm_dtype: torch.dtype, layouts: tuple[str, str, str], tp_pick: int, chunk: int,
                                seed: int) -> None:
    g = geo(dims, spec)
    tps = [t for t in g.tps if t > 1]
    if not tps:
        return
    tp = tps[tp_pick % len(tps)]
    full_lay, shard_lay, back_lay = layouts
    dim, L = g.rank_state(1).conv.dim, g.state_len
    conv = rand((*lead, L, dim) if full_lay == "SD" else (*lead, dim, L), dtype, seed)
    ssm = rand((*lead, dims.num_heads, dims.head_dim, dims.state_size), ssm_dtype, seed + 1)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d)
        save(p / "full.safetensors", {"mixer.conv_state": conv, "mixer.ssm_state": ssm, "step": torch.tensor([7])})
        # --from: tiny dims can make the full state square (dim == state_len), which only a hint resolves
        convert(p / "full.safetensors", p / "shards", ConvertOptions(to=shard_lay, geometry=g, tp_split=tp,
                                                                     from_layout=full_lay, chunk_bytes=chunk))
        for r in range(tp):
            s = load(p / "shards" / f"full.rank{r}-of-{tp}.safetensors")
            assert same_bits(conv_ds(s["mixer.conv_state"], shard_lay),
                             reference_shard(conv_ds(conv, full_lay), dims, tp, r))
            assert same_bits(s["mixer.ssm_state"], reference_ssm(ssm, tp, r))
        assert check(p / "full.safetensors", p / "shards", ConvertOptions(geometry=g, from_layout=full_lay)).ok
        convert(p / "shards", p / "merged.safetensors", ConvertOptions(to=back_lay, tp_merge=True, chunk_bytes=chunk))
        m = load(p / "merged.safetensors")
        assert same_bits(conv_ds(m["mixer.conv_state"], back_lay), conv_ds(conv, full_lay).contiguous())
        assert same_bits(m["mixer.ssm_state"], ssm)
        if back_lay == full_lay:
            assert data_sha(p / "merged.safetensors") == data_sha(p / "full.safetensors")
