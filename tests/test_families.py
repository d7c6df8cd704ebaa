"""hybridpd.core.families: what each adapter reads from the real configs (hybridpd/data/configs/, the same values as
/work/shared/reference/configs/) and the reference's §2.4 table.

Every expected value is read off config.json or the reference by hand; the arithmetic is in the comments.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridpd.core import families, models
from hybridpd.core.families import ATTENTION, MAMBA, GdnDims, Mamba1Dims, MambaDims
from hybridpd.errors import ConfigError

# Nano's hybrid_override_pattern (reference §2.4): 52 symbols, 23 M, 23 E, 6 *.
# Positions of '*' read off "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME": 5, 12, 19, 26, 33, 42.
NANO_ATTENTION = (5, 12, 19, 26, 33, 42)


def spec(name: str) -> families.ModelSpec:
    return families.model_spec(models.resolve(name))


def kinds(s: families.ModelSpec) -> tuple[int, int]:
    return len(s.mamba_layers), len(s.attention_layers)


def test_nano_matches_the_reference_table() -> None:
    s = spec("nano")
    assert (s.family, s.num_hidden_layers, s.layer_pattern.count("E")) == ("nemotron_h", 52, 23)
    assert kinds(s) == (23, 6)  # E (MoE) layers own no cache: HMA sees only M and * (§2.4)
    assert tuple(c.index for c in s.attention_layers) == NANO_ATTENTION
    # intermediate = mamba_num_heads * mamba_head_dim = 64 * 64 = 4096, not expand * hidden = 2 * 2688 = 5376 (§1)
    assert s.mamba == MambaDims(num_heads=64, head_dim=64, n_groups=8, state_size=128, conv_kernel=4,
                                intermediate_size=4096)
    assert s.attention is not None
    assert (s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_size) == (32, 2, 128)
    assert (s.hf_mamba_ssm_cache_dtype, s.mamba_chunk_size, s.mamba_type) == ("float32", 128, "mamba2")
    # layer 0 is 'M', so the first cache layer is a Mamba mixer: HMA groups come out [Mamba..., FA] (§2.3)
    assert (s.cache_layers[0].kind, s.cache_layers[0].name) == (MAMBA, "model.layers.0.mixer")
    assert s.attention_layers[0].name == "model.layers.5.self_attn.attn"


def test_super_matches_the_reference_table() -> None:
    s = spec("super")
    assert (s.num_hidden_layers, kinds(s)) == (88, (40, 8))  # 40 M, 40 E, 8 * (§2.4)
    # 128 * 64 = 8192 x channels; n_groups 8, state 128, conv 4
    assert s.mamba == MambaDims(num_heads=128, head_dim=64, n_groups=8, state_size=128, conv_kernel=4,
                                intermediate_size=8192)


@pytest.mark.parametrize("name,quant", [("super-nvfp4", "fp8"), ("super", None), ("nano", None)])
def test_fp8_kv_cache_scheme_is_read_from_quantization_config(name: str, quant: str | None) -> None:
    # Super-NVFP4 config.json: quantization_config.kv_cache_scheme {"type": "float", "num_bits": 8} -> FP8 KV (§2.2)
    assert spec(name).kv_cache_quant == quant


def test_falcon_h1_registers_attention_before_mamba_in_every_layer() -> None:
    s = spec("falcon-h1-0.5b")
    assert (s.family, s.num_hidden_layers) == ("falcon_h1", 36)
    assert kinds(s) == (36, 36)  # every layer is both
    assert [(c.index, c.kind) for c in s.cache_layers[:4]] == [(0, ATTENTION), (0, MAMBA), (1, ATTENTION), (1, MAMBA)]
    # mamba_d_ssm 1536 = mamba_n_heads 24 * mamba_d_head 64; mamba_n_groups 1 (the vllm#55208 model)
    assert s.mamba == MambaDims(num_heads=24, head_dim=64, n_groups=1, state_size=128, conv_kernel=4,
                                intermediate_size=1536)
    assert s.attention is not None
    assert (s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_size) == (8, 2, 64)
    assert s.mamba_chunk_size == 128  # mamba_chunk_size in config.json


def test_falcon_h1_34b_has_two_groups() -> None:
    m = spec("falcon-h1-34b").mamba
    # mamba_d_ssm 4096 = 32 heads * 128; mamba_n_groups 2
    assert m is not None and (m.num_heads, m.head_dim, m.n_groups, m.intermediate_size) == (32, 128, 2, 4096)


@pytest.mark.parametrize("name,heads,hidden,attn_heads,kv_heads", [
    ("granite-tiny", 48, 1536, 12, 4),
    ("granite-micro", 64, 2048, 32, 8),
])
def test_granite_4_h(name: str, heads: int, hidden: int, attn_heads: int, kv_heads: int) -> None:
    s = spec(name)
    assert (s.family, s.num_hidden_layers, kinds(s)) == ("granitemoehybrid", 40, (36, 4))
    # layer_types: "attention" at 5, 15, 25, 35, "mamba" elsewhere
    assert tuple(c.index for c in s.attention_layers) == (5, 15, 25, 35)
    m = s.mamba
    assert m is not None
    # mamba_expand 2 * hidden_size = mamba_n_heads * mamba_d_head 64 (tiny: 2 * 1536 = 3072 = 48 * 64;
    # micro: 2 * 2048 = 4096 = 64 * 64); mamba_n_groups 1 (the reference's unchecked "I believe": the config says 1)
    assert (m.num_heads, m.head_dim, m.n_groups, m.intermediate_size) == (heads, 64, 1, 2 * hidden)
    assert s.attention is not None
    # no head_dim key: vLLM divides hidden_size by num_attention_heads (tiny 1536/12 = 128, micro 2048/32 = 64)
    assert (s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_size) == (
        attn_heads, kv_heads, hidden // attn_heads)


def test_zamba2_hybrid_layers_own_both_caches() -> None:
    s = spec("zamba2-2.7b")
    # layers_block_type: 45 "mamba" + 9 "hybrid" (at 6, 12, 18, 24, 30, 36, 42, 47, 51); a hybrid layer has both
    assert (s.num_hidden_layers, kinds(s)) == (54, (54, 9))
    assert tuple(c.index for c in s.attention_layers) == (6, 12, 18, 24, 30, 36, 42, 47, 51)
    # n_mamba_heads 80 * mamba_headdim 64 = 5120 = mamba_expand 2 * hidden_size 2560
    assert s.mamba == MambaDims(num_heads=80, head_dim=64, n_groups=1, state_size=64, conv_kernel=4,
                                intermediate_size=5120)
    assert s.attention is not None
    # attention_head_dim 160 wins over hidden_size / heads = 2560 / 32 = 80
    assert (s.attention.num_kv_heads, s.attention.head_size) == (32, 160)


def test_state_spaces_mamba2_uses_mamba_ssm_defaults() -> None:
    s = spec("mamba2-2.7b")
    # d_model 2560, n_layer 64, ssm_cfg {"layer": "Mamba2"}: expand 2, headdim 64, d_state 128, ngroups 1, d_conv 4
    # (mamba_ssm's Mamba2 defaults) -> 2 * 2560 = 5120 channels, 5120 / 64 = 80 heads
    assert s.mamba == MambaDims(num_heads=80, head_dim=64, n_groups=1, state_size=128, conv_kernel=4,
                                intermediate_size=5120)
    assert (kinds(s), s.is_hybrid, s.attention) == ((64, 0), False, None)
    assert any("ssm_cfg.expand not in config.json" in n for n in s.notes)


def test_jamba_attention_every_period_at_offset() -> None:
    s = spec("jamba")
    # attn_layer_period 8, attn_layer_offset 4 over 32 layers: attention at 4, 12, 20, 28; Mamba-1 elsewhere
    assert tuple(c.index for c in s.attention_layers) == (4, 12, 20, 28)
    assert kinds(s) == (28, 4)
    # mamba_expand 2 * hidden_size 4096 = 8192; mamba_d_state 16, mamba_d_conv 4
    assert (s.mamba, s.recurrent, s.mamba_type) == (None, Mamba1Dims(intermediate_size=8192, state_size=16,
                                                                      conv_kernel=4), "mamba1")
    assert s.attention is not None and s.attention.head_size == 4096 // 32  # JambaConfig has no head_dim


def test_qwen3_next_full_attention_every_fourth_layer() -> None:
    s = spec("qwen3-next")
    # full_attention_interval 4 over 48 layers: (i + 1) % 4 == 0 -> 3, 7, ..., 47 (12 layers), 36 GatedDeltaNet
    assert tuple(c.index for c in s.attention_layers) == tuple(range(3, 48, 4))
    assert kinds(s) == (36, 12)
    assert s.recurrent == GdnDims(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)
    assert s.attention is not None
    assert (s.attention.num_heads, s.attention.num_kv_heads, s.attention.head_size) == (16, 2, 256)
    assert s.mamba_prefix_caching is False  # Qwen3Next is not SupportsMambaPrefixCaching


def test_dense_llama() -> None:
    s = spec("llama-3.1-8b")
    assert (s.family, kinds(s), s.has_mamba, s.mamba_chunk_size) == ("dense", (0, 32), False, None)
    assert s.attention is not None
    # no head_dim key: 4096 / 32 = 128; num_key_value_heads 8
    assert (s.attention.num_kv_heads, s.attention.head_size) == (8, 128)


def _nano_with(**changes: object) -> families.ModelSpec:
    raw = models.resolve("nano")
    return families.model_spec(replace(raw, config={**raw.config, **changes}))


def test_transformers5_layers_block_type_replaces_the_pattern() -> None:
    # transformers >= 5 writes layers_block_type (no pattern, no num_hidden_layers): same layers
    raw = models.resolve("nano")
    names = {"M": "mamba", "E": "moe", "*": "attention"}
    cfg = {k: v for k, v in raw.config.items() if k not in ("hybrid_override_pattern", "num_hidden_layers")}
    cfg["layers_block_type"] = [names[c] for c in raw.config["hybrid_override_pattern"]]
    s = families.model_spec(replace(raw, config=cfg))
    assert (s.num_hidden_layers, kinds(s)) == (52, (23, 6))
    assert tuple(c.index for c in s.attention_layers) == NANO_ATTENTION


def test_nemotron_n_groups_must_divide_the_mamba_heads() -> None:
    # 64 heads with n_groups 7: 64 % 7 = 1, MambaMixer2 cannot split the heads into groups
    with pytest.raises(ConfigError) as e:
        _nano_with(n_groups=7)
    assert e.value.field == "n_groups"
