"""hybridpd.core.layout: HMA groups, per-token attention bytes, dtypes, padding and blocks that fit, against
/work/shared/reference/vllm-hybrid-pd.md (§1, §2.1-2.5) and the real configs.

The block-size table and the Mamba bytes per TP are pinned in test_reference_numbers.py; this file pins the rest
of the layout.  Every expected number is hand-computed from the reference's formulas, with the arithmetic shown.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridpd.core import families, layout, models, profiles
from hybridpd.core.layout import cdiv, hma_groups
from hybridpd.core.settings import EngineSettings as E

CUDA = profiles.platform_for("cuda")
P020 = profiles.profile_for("0.20")


def spec(name: str) -> families.ModelSpec:
    return families.model_spec(models.resolve(name))


def side(name: str, tp: int, **kw: object) -> layout.SideLayout:
    return layout.side_layout(spec(name), E(tp=tp, **kw), P020, CUDA, role="prefill")  # type: ignore[arg-type]


@pytest.mark.parametrize("a,b,want", [(1_067_008, 4096, 261), (4096, 4096, 1), (4097, 4096, 2), (0, 7, 0), (1, 7, 1)])
def test_cdiv(a: int, b: int, want: int) -> None:
    # §2.5 worked example: cdiv(1067008, 16*256) = 261 (1067008 / 4096 = 260.5)
    assert cdiv(a, b) == want


def test_nano_groups_take_every_fourth_mamba_layer() -> None:
    # §2.3: 23 M and 6 * -> group_size 6, cdiv(23, 6) = 4 Mamba groups; group i takes layers[i::4].
    # Nano's M positions (pattern of §2.4): 0 2 4 7 9 11 14 16 18 21 23 25 28 30 32 35 37 39 41 44 46 48 50
    groups, size = hma_groups(spec("nano"))
    assert size == 6
    assert [(g.kind, g.layers, g.padding_slots) for g in groups] == [
        ("mamba", (0, 9, 18, 28, 37, 46), 0),
        ("mamba", (2, 11, 21, 30, 39, 48), 0),
        ("mamba", (4, 14, 23, 32, 41, 50), 0),
        ("mamba", (7, 16, 25, 35, 44), 1),  # the one padding slot of §2.5
        ("attention", (5, 12, 19, 26, 33, 42), 0),
    ]


@pytest.mark.parametrize("name,kinds,size", [
    # Falcon-H1-0.5B: 36 attention + 36 Mamba, equal counts -> group_size 36; attention registers first in each
    # layer, so the attention group comes first (first-appearance order)
    ("falcon-h1-0.5b", ["attention", "mamba"], 36),
    # Zamba2-2.7B: 54 Mamba (45 mamba + 9 hybrid layers) and 9 attention -> group_size 9, cdiv(54, 9) = 6 Mamba groups
    ("zamba2-2.7b", ["mamba"] * 6 + ["attention"], 9),
    # Granite-4.0-H-Tiny: 36 Mamba, 4 attention -> group_size 4, 36 / 4 = 9 Mamba groups
    ("granite-tiny", ["mamba"] * 9 + ["attention"], 4),
    # Jamba-v0.1: 28 Mamba-1, 4 attention -> group_size 4, 7 Mamba groups
    ("jamba", ["mamba"] * 7 + ["attention"], 4),
    # Llama-3.1-8B: one kind, 32 layers -> one group of 32
    ("llama-3.1-8b", ["attention"], 32),
])
def test_group_order_and_size(name: str, kinds: list[str], size: int) -> None:
    groups, group_size = hma_groups(spec(name))
    assert ([g.kind for g in groups], group_size) == (kinds, size)


def test_group_size_takes_the_max_when_counts_are_within_one_and_a_half() -> None:
    # §2.3: group_size = min(#layers per type), but max if max < 1.5 * min.  Pattern "M*M*M*M": 4 M, 3 *;
    # 4 < 4.5 -> group_size 4: one Mamba group (0, 2, 4, 6), one attention group (1, 3, 5) with one padding slot.
    raw = models.resolve("nano")
    s = families.model_spec(replace(raw, config={**raw.config, "hybrid_override_pattern": "M*M*M*M",
                                                 "num_hidden_layers": 7}))
    groups, size = hma_groups(s)
    assert size == 4
    assert [(g.kind, g.layers, g.padding_slots) for g in groups] == [("mamba", (0, 2, 4, 6), 0),
                                                                     ("attention", (1, 3, 5), 1)]


@pytest.mark.parametrize("tp,kv,heads,a1,replicated", [
    # §2.5: a1 = 2 * max(1, 2 // tp) * 128 * es (K+V, 2 KV heads of 128)
    (1, "bfloat16", 2, 1024, False),  # 2 * 2 * 128 * 2
    (2, "bfloat16", 1, 512, False),  # 2 * 1 * 128 * 2
    (4, "bfloat16", 1, 512, True),  # TP 4 > 2 KV heads: the head is replicated (§2.1)
    (1, "fp8", 2, 512, False),  # 2 * 2 * 128 * 1
    (8, "fp8", 1, 256, True),  # 2 * 1 * 128 * 1
])
def test_attention_bytes_per_token(tp: int, kv: str, heads: int, a1: int, replicated: bool) -> None:
    s = side("nano", tp, kv_cache_dtype=kv)
    assert (s.num_kv_heads, s.attn_bytes_per_token, s.kv_heads_replicated) == (heads, a1, replicated)


def test_nemotron_ssm_dtype_comes_from_config_or_defaults_to_fp32() -> None:
    # §1: NemotronH override: mamba_ssm_cache_dtype "auto" -> config.json's value, else "float32"; conv = model dtype
    nano = spec("nano")
    assert nano.hf_mamba_ssm_cache_dtype == "float32"
    d = layout.resolve_dtypes(nano, E(), P020, CUDA)
    assert (d.kv, d.conv, d.ssm) == ("bfloat16", "bfloat16", "float32")
    bare = replace(nano, hf_mamba_ssm_cache_dtype=None)
    assert layout.resolve_dtypes(bare, E(), P020, CUDA).ssm == "float32"
    assert layout.resolve_dtypes(nano, E(mamba_ssm_cache_dtype="float16"), P020, CUDA).ssm == "float16"


def test_other_families_keep_the_ssm_state_in_the_conv_dtype() -> None:
    # §1: ssm dtype = mamba_ssm_cache_dtype when not "auto", otherwise the conv dtype (no override outside NemotronH)
    d = layout.resolve_dtypes(spec("granite-tiny"), E(), P020, CUDA)
    assert (d.conv, d.ssm) == ("bfloat16", "bfloat16")


def test_fp8_kv_checkpoint_resolves_auto_to_fp8() -> None:
    # §2.2: cache_dtype "auto" on a checkpoint whose kv_cache_scheme is 8-bit float gives fp8 (1 B)
    s = side("super-nvfp4", 4)
    assert (s.dtypes.kv, s.attn_bytes_per_token) == ("fp8", 256)  # 2 * 1 * 128 * 1


def test_padding_percentage_nano_tp2_fp8() -> None:
    # §2.5: 4176 * 256 - 1067008 = 2048 B of padding, 2048 / 1067008 = 0.19 %
    s = side("nano", 2, kv_cache_dtype="fp8")
    assert s.page_size_bytes == 4176 * 256 == 1_069_056
    assert round(s.padding_pct, 2) == 0.19


def test_blog_bf16_block_4224_pads_each_mamba_page_by_1_098_752() -> None:
    # §2.5 blog numbers: Super TP4 bf16 with an explicit --block-size 4224 keeps 4224 (its page already holds the
    # Mamba page): pad = 4224 * 512 - 1063936 = 2,162,688 - 1,063,936 = 1,098,752 B
    s = side("super", 4, kv_cache_dtype="bfloat16", block_size=4224)
    assert (s.block_size, s.padding_bytes) == (4224, 1_098_752)


def test_prefix_caching_all_mode_super_tp4() -> None:
    # §2.5: Super TP4 fp8 --block-size 128 with prefix caching ("all"): chunk = lcm(chunk_size 128, 128) = 128;
    # 128 * cdiv(cdiv(1063936, 256) = 4156, 128) = 128 * 33 = 4224
    s = side("super", 4, kv_cache_dtype="fp8", block_size=128, enable_prefix_caching=True)
    assert (s.mamba_cache_mode, s.block_size) == ("all", 4224)


def test_blocks_that_fit_divide_memory_by_page_and_tensors() -> None:
    # §2.3: num_blocks = available_memory // page // group_size.  Nano TP2 fp8: page 4176 * 256 = 1,069,056 B,
    # 6 tensors -> 64 GiB = 68,719,476,736 B // 6,414,336 = 10,713 (10,713 * 6,414,336 = 68,716,781,568;
    # the remainder 2,695,168 is less than one more block)
    s = side("nano", 2, kv_cache_dtype="fp8", kv_cache_memory=64 << 30)
    assert (s.num_shared_tensors, s.num_blocks) == (6, 10_713)
