"""Known values from shared/reference/vllm-hybrid-pd.md (§2.5, §3.4-3.6) and vllm-cpu-notes.md (measured).

Every expected number below is copied from those documents, not from this code's output.
"""

from __future__ import annotations

import pytest

from hybridpd.core import families, layout, models, profiles
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings as E
from hybridpd.core.transfer import remote_conv_offsets

CUDA = profiles.platform_for("cuda")
P020 = profiles.profile_for("0.20")


def side(name: str, tp: int, **kw: object) -> layout.SideLayout:
    spec = families.model_spec(models.resolve(name))
    return layout.side_layout(spec, E(tp=tp, **kw), P020, CUDA, role="prefill")  # type: ignore[arg-type]


@pytest.mark.parametrize("tp,conv,ssm", [(1, 36864, 2097152), (2, 18432, 1048576), (4, 9216, 524288),
                                          (8, 4608, 262144)])
def test_nano_mamba_bytes(tp: int, conv: int, ssm: int) -> None:
    s = side("nano", tp)
    assert s.mamba is not None
    assert (s.mamba.conv_bytes, s.mamba.ssm_bytes) == (conv, ssm)


@pytest.mark.parametrize("tp,conv,ssm", [(1, 61440, 4194304), (2, 30720, 2097152), (4, 15360, 1048576),
                                          (8, 7680, 524288)])
def test_super_mamba_bytes(tp: int, conv: int, ssm: int) -> None:
    s = side("super", tp)
    assert s.mamba is not None
    assert (s.mamba.conv_bytes, s.mamba.ssm_bytes) == (conv, ssm)


# Reference §2.5 "Block size / kernel / ratio" table: (block, kernel, ratio, derived-0.20-ratio).
TABLE = {
    ("nano", "fp8", None): [(4176, 16, 261, 261), (4176, 16, 261, 261), (2096, 16, 131, 131), (1056, 32, 33, 33)],
    ("nano", "fp8", 128): [(4224, 64, 66, 66), (4224, 64, 66, 66), (2176, 64, 34, 33), (1152, 64, 18, 17)],
    ("nano", "bfloat16", None): [(2096, 16, 131, 131), (2096, 16, 131, 131), (1056, 32, 33, 33), (528, 16, 33, 33)],
    ("nano", "bfloat16", 128): [(2176, 64, 34, 33), (2176, 64, 34, 33), (1152, 64, 18, 17), (640, 64, 10, 9)],
    ("super", "fp8", None): [(8320, 64, 130, 130), (8320, 64, 130, 130), (4160, 64, 65, 65), (2080, 32, 65, 65)],
    ("super", "fp8", 128): [(8320, 64, 130, 130), (8320, 64, 130, 130), (4224, 64, 66, 65), (2176, 64, 34, 33)],
    ("super", "bfloat16", None): [(4160, 64, 65, 65), (4160, 64, 65, 65), (2080, 32, 65, 65), (1040, 16, 65, 65)],
    ("super", "bfloat16", 128): [(4224, 64, 66, 65), (4224, 64, 66, 65), (2176, 64, 34, 33), (1152, 64, 18, 17)],
}


@pytest.mark.parametrize("key", list(TABLE))
def test_block_size_table(key: tuple[str, str, int | None]) -> None:
    name, kv, bs = key
    got = []
    for tp in (1, 2, 4, 8):
        s = side(name, tp, kv_cache_dtype=kv, block_size=bs)
        got.append((s.block_size, s.kernel_block_size, s.physical_per_logical, s.derived_ratio_v020))
    assert got == TABLE[key]


def test_hma_groups_nano_and_super() -> None:
    nano = side("nano", 2)
    assert [(g.kind, len(g.layers)) for g in nano.groups] == [("mamba", 6)] * 3 + [("mamba", 5), ("attention", 6)]
    assert nano.num_shared_tensors == 6
    sup = side("super", 4)
    assert [g.kind for g in sup.groups] == ["mamba"] * 5 + ["attention"]
    assert sup.num_shared_tensors == 8


def test_nano_tp2_padding_worked_example() -> None:
    s = side("nano", 2, kv_cache_dtype="fp8")
    assert (s.block_size, s.padding_bytes) == (4176, 2048)


def test_super_tp4_padding_worked_example() -> None:
    s = side("super", 4, kv_cache_dtype="fp8", block_size=128)
    assert (s.block_size, s.padding_bytes) == (4224, 17408)


@pytest.mark.parametrize("isl,nbytes,descs", [(1000, 32_022_528, 3228), (8192, 38_436_864, 6360)])
def test_nano_tp2_request_bytes(isl: int, nbytes: int, descs: int) -> None:
    s = E(tp=2, kv_cache_dtype="fp8")
    plan = build_plan("nano", prefill=s, decode=s, vllm_version="0.20", isls=(isl,))
    per = plan.transfers[0].per_rank[0]
    assert (per.bytes, per.descriptors) == (nbytes, descs)


def test_super_tp4_request_bytes_and_naive() -> None:
    s = E(tp=4, kv_cache_dtype="fp8", block_size=128)
    plan = build_plan("super", prefill=s, decode=s, vllm_version="0.20", isls=(4225,))
    per = plan.transfers[0].per_rank[0]
    assert (per.fa_bytes, per.mamba_bytes, per.descriptors) == (8_650_752, 42_557_440, 1216)
    assert per.naive_bytes - per.fa_bytes == 43_253_760
    codes = {f.code for f in plan.findings}
    assert "derived-ratio-bug" in codes  # 65 vs 66, reference §3.9.1


def test_remote_conv_offsets_nano_1_to_2() -> None:
    # Reference §3.6: Nano P_TP1 -> D_TP2, D rank 1 (bf16, DS): xb=12288, bb=3072.
    assert remote_conv_offsets(1, 2, 12288, 3072) == ((12288, 12288), (27648, 3072), (33792, 3072))
    plan = build_plan("nano", prefill=E(tp=1), decode=E(tp=2, block_size=None), vllm_version="0.20",
                      isls=(1000,))
    assert plan.routes is not None
    src = plan.routes[1].sources[0]
    assert (src.x, src.b, src.c) == ((12288, 12288), (27648, 3072), (33792, 3072))
    assert src.ssm == (1085440, 1048576)


def test_granite_tiny_matches_article_block_400() -> None:
    # Reference §9.10: the article's block 400 is Granite-4.0-H-Tiny at TP1 (bf16 SSM, FA align 16).
    s = layout.side_layout(families.model_spec(models.resolve("granite-tiny")), E(tp=1),
                           profiles.profile_for("0.32"), CUDA, role="prefill")
    assert s.block_size == 400
    assert s.mamba is not None and s.mamba.page_bytes == 806400


# ---- measured on vllm-cpu 0.32 (vllm-cpu-notes.md) ------------------------------------------------

def cpu_plan(path: object, ptp: int, dtp: int, isl: int, **kw: object):  # type: ignore[no-untyped-def]
    kw.setdefault("cpu_avx512_bf16", True)  # the notes' machine (AMD EPYC with avx512_bf16)
    s_p = E(tp=ptp, enable_prefix_caching=False, **kw)  # type: ignore[arg-type]
    s_d = E(tp=dtp, enable_prefix_caching=False, **kw)  # type: ignore[arg-type]
    return build_plan(str(path), prefill=s_p, decode=s_d, vllm_version="0.32", platform="cpu", isls=(isl,))


def test_cpu_nemotronh_layout(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["nemoh"], 1, 1, 97)
    p = plan.prefill
    assert p.mamba is not None
    assert (p.mamba.conv_bytes, p.mamba.ssm_bytes) == (1920, 16384)
    assert (p.block_size, p.page_size_bytes, p.num_shared_tensors) == (128, 65536, 1)
    assert len(p.groups) == 3  # 2 Mamba-layer groups + 1 FA group: remote_block_ids [[1],[2],[3]]
    t = plan.transfers[0]
    assert (t.bytes, t.descriptors) == (102144, 9)


def test_cpu_nemotronh_198_tokens(tiny_models: dict) -> None:  # type: ignore[type-arg]
    t = cpu_plan(tiny_models["nemoh"], 1, 1, 198).transfers[0]
    assert t.bytes == 167680
    assert t.descriptors_min <= 10 <= t.descriptors  # measured 10 with remote ids [[3],[2],[1,4]]


def test_cpu_block_32_is_raised_to_64(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["nemoh"], 1, 1, 97, block_size=32)
    assert (plan.prefill.block_size, plan.prefill.page_size_bytes) == (64, 32768)
    assert plan.transfers[0].bytes == 102144  # notes §3.2: 'P/D with block 64 gives the same bytes' as block 128


def test_cpu_granite_layout(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["granite"], 1, 1, 97)
    p = plan.prefill
    assert p.mamba is not None
    assert (p.mamba.conv_bytes, p.mamba.ssm_bytes, p.num_shared_tensors) == (1728, 16384, 2)  # SSM forced fp32
    assert (plan.transfers[0].bytes, plan.transfers[0].descriptors) == (167296, 10)
    assert cpu_plan(tiny_models["granite"], 1, 1, 198).transfers[0].bytes == 298368


def test_cpu_dense_bytes(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["llama"], 1, 1, 96)
    assert (plan.transfers[0].bytes, plan.transfers[0].descriptors) == (131072, 2)
    t200 = cpu_plan(tiny_models["llama"], 1, 1, 200).transfers[0]
    assert t200.bytes == 262144 and t200.descriptors_min == 2  # [[1, 2]] coalesced to 2 descriptors


def test_cpu_hetero_nemotronh_correct(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["nemoh"], 1, 2, 98)
    t = plan.transfers[0]
    assert [r.bytes for r in t.per_rank] == [51072, 51072]
    assert [r.descriptors for r in t.per_rank] == [9, 9]
    assert plan.routes is not None
    r0, r1 = (rt.sources[0] for rt in plan.routes)
    # Part 2 §2.4 byte probe: rank 0 x [0,768) B [1536,1632) C [1728,1824) SSM [1920,10112) FA [0,32768)
    assert (r0.x, r0.b, r0.c, r0.ssm, r0.fa) == ((0, 768), (1536, 96), (1728, 96), (1920, 8192), (0, 32768))
    assert (r1.x, r1.b, r1.c, r1.ssm, r1.fa) == ((768, 768), (1632, 96), (1824, 96), (10112, 8192), (32768, 32768))
    assert "conv-state-corruption" not in {f.code for f in plan.findings}


def test_cpu_hetero_granite_corrupt(tiny_models: dict) -> None:  # type: ignore[type-arg]
    plan = cpu_plan(tiny_models["granite"], 1, 2, 98)
    t = plan.transfers[0]
    assert t.bytes == 167680 and t.descriptors == 20  # measured: +167680 B, +20 descriptors
    bad = [f for f in plan.findings if f.code == "conv-state-corruption"]
    assert bad and bad[0].severity == "error"
    assert not plan.ok


def test_cpu_block_64_vs_128_flagged(tiny_models: dict) -> None:  # type: ignore[type-arg]
    sp = E(tp=1, enable_prefix_caching=False, block_size=64)
    sd = E(tp=1, enable_prefix_caching=False, block_size=128)
    plan = build_plan(str(tiny_models["nemoh"]), prefill=sp, decode=sd, vllm_version="0.32", platform="cpu")
    assert {f.code for f in plan.findings} >= {"block-size-mismatch"}
    plan2 = build_plan(str(tiny_models["nemoh"]), prefill=sd, decode=sp, vllm_version="0.32", platform="cpu")
    assert "block-not-divisible" in {f.code for f in plan2.findings}


# docs/vllm-0.32-nixl-audit.md: vLLM 0.32's own descriptor code + a real NIXL READ, Nano with block 2096 on both
# sides and two consecutive FA blocks: (P TP, D TP) -> (descriptors after NIXL's merge, total bytes).
AUDIT_032 = {(1, 1): (102, 76_972_032), (2, 2): (204, 76_972_032), (1, 2): (216, 76_972_032),
             (2, 1): (216, 76_972_032), (1, 4): (432, 102_727_680), (4, 1): (408, 76_972_032),
             (2, 4): (408, 102_727_680), (4, 2): (396, 76_972_032)}


@pytest.mark.parametrize("ptp,dtp", list(AUDIT_032))
def test_vllm_032_descriptor_oracle(ptp: int, dtp: int) -> None:
    plan = build_plan("nano", prefill=E(tp=ptp, block_size=2096), decode=E(tp=dtp, block_size=2096),
                      vllm_version="0.32", isls=(2 * 2096 + 1,))
    t = plan.transfers[0]
    assert (t.descriptors_min, t.bytes) == AUDIT_032[(ptp, dtp)]


def test_transformers5_nemotronh_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # What transformers 5.19's NemotronHConfig writes for make_hybrid.py's model: layers_block_type, no
    # num_hidden_layers and no hybrid_override_pattern.  Same layout as the pattern-style config (notes §3.2).
    import json

    from conftest import TINY_NEMOTRONH

    cfg = {k: v for k, v in TINY_NEMOTRONH.items() if k not in ("num_hidden_layers", "hybrid_override_pattern")}
    cfg["layers_block_type"] = ["linear_attention", "full_attention", "linear_attention", "mlp"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = cpu_plan(tmp_path, 1, 1, 97).transfers[0]
    assert (t.bytes, t.descriptors) == (102144, 9)


def test_transformers5_granite_layer_type_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from conftest import TINY_GRANITE

    cfg = dict(TINY_GRANITE, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t = cpu_plan(tmp_path, 1, 1, 97).transfers[0]
    assert (t.bytes, t.descriptors) == (167296, 10)  # notes §4, as with mamba/attention names


def test_cpu_granite_without_avx512_bf16(tiny_models: dict) -> None:  # type: ignore[type-arg]
    # Measured by tests/test_live_vllm.py on a host without avx512_bf16: vLLM keeps the SSM state in bf16,
    # so each Mamba layer moves 1728 + 8192 B and the 97-token request moves 150912 B.
    plan = cpu_plan(tiny_models["granite"], 1, 1, 97, cpu_avx512_bf16=False)
    assert plan.prefill.dtypes.ssm == "bfloat16"
    assert plan.transfers[0].bytes == 150912
