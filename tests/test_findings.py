"""hybridpd.core.findings: each rule fires where /work/shared/reference/vllm-hybrid-pd.md (§3.7-3.9) and
vllm-0.24-0.33.md say vLLM rejects or corrupts, and stays quiet on the release that fixed it.

The rules already pinned elsewhere (conv-state-corruption, n-groups-tp, tp-heads, derived-ratio-bug at 0.20,
block-not-divisible, ssm-one-local-block, hma-auto-disabled, unsupported-mamba-type) are not repeated here.
"""

from __future__ import annotations

from hybridpd.core.findings import ERROR, INFO, WARNING, Finding
from hybridpd.core.plan import Plan, build_plan
from hybridpd.core.settings import EngineSettings as E


def plan(model: str, p: E, d: E, version: str) -> Plan:
    return build_plan(model, prefill=p, decode=d, vllm_version=version)


def codes(pl: Plan) -> set[str]:
    return {f.code for f in pl.findings}


def finding(pl: Plan, code: str) -> Finding:
    return next(f for f in pl.findings if f.code == code)


def fp8(tp: int, **kw: object) -> E:
    return E(tp=tp, kv_cache_dtype="fp8", **kw)  # type: ignore[arg-type]


def test_errors_then_warnings_then_info() -> None:
    pl = plan("nano", fp8(4), fp8(2), "0.20")
    rank = {ERROR: 0, WARNING: 1, INFO: 2}
    sev = [rank[f.severity] for f in pl.findings]
    assert sev == sorted(sev) and {ERROR, WARNING, INFO} <= {f.severity for f in pl.findings}


def test_remote_expansion_with_the_local_ratio_0_20() -> None:
    # §3.9.2: Nano fp8 P TP4 (ratio 2096/16 = 131) <-> D TP2 (4176/16 = 261) is wrong on 0.20 (arange(local ratio));
    # P TP2 <-> D TP1 is fine (261 = 261); fixed by 0.22.1
    bad = plan("nano", fp8(4), fp8(2), "0.20")
    assert "P 131, D 261" in finding(bad, "hetero-expansion-bug").message
    assert "hetero-expansion-bug" not in codes(plan("nano", fp8(2), fp8(1), "0.20"))
    assert "hetero-expansion-bug" not in codes(plan("nano", fp8(4), fp8(2), "0.22.1"))


def test_derived_ratio_fixed_in_0_21() -> None:
    # §3.9.1 / §2.5: Nano fp8 TP4 --block-size 128 -> 2176 / k64, true ratio 34, 0.20 derives 33; fixed in 0.21.0
    s = fp8(4, block_size=128)
    assert "derived-ratio-bug" in codes(plan("nano", s, s, "0.20"))
    assert "derived-ratio-bug" not in codes(plan("nano", s, s, "0.21"))


def test_hetero_tp_is_experimental_in_the_0_20_compatibility_doc() -> None:
    # §3.9.3: the compatibility doc lists Hybrid SSM hetero TP as 🚧 ("require homogeneous TP")
    assert finding(plan("nano", fp8(2), fp8(1), "0.20"), "hetero-tp-experimental").severity == WARNING
    assert "hetero-tp-experimental" not in codes(plan("nano", fp8(2), fp8(2), "0.20"))


def test_tp_sizes_must_divide_one_another_in_either_direction() -> None:
    # §3.7: tp_ratio = D_TP // P_TP or -(P_TP // D_TP), divisibility asserted; both directions allowed for Mamba
    assert "tp-not-divisible" in codes(plan("nano", E(tp=2), E(tp=3), "0.32"))
    for p, d in ((2, 4), (4, 2)):
        assert "tp-not-divisible" not in codes(plan("nano", E(tp=p), E(tp=d), "0.32"))


def test_sd_conv_layout_fails_at_worker_init_even_at_equal_tp() -> None:
    # §3.8: the SD conv layout fails the AssertionError at NIXL worker init, homogeneous TP included
    pl = plan("nano", E(tp=2, conv_layout="SD"), E(tp=2), "0.32")
    assert finding(pl, "conv-layout-sd").severity == ERROR
    assert "conv-layout-ds" not in codes(pl)


def test_ds_layout_names_the_families_sub_projections() -> None:
    # §1: DS conv is [x | B | C] for Mamba2; §8 (0.33 derive_mamba_conv_split): GDN is (Q, K, V)
    assert "(x, B, C contiguous" in finding(plan("nano", E(tp=2), E(tp=2), "0.32"), "conv-layout-ds").message
    qwen = E(tp=1, enable_prefix_caching=False)
    assert "(Q, K, V contiguous" in finding(plan("qwen3-next", qwen, qwen, "0.33"), "conv-layout-ds").message


def test_kernel_blocks_must_match_under_hma() -> None:
    # §3.8: with HMA the handshake asserts block_size_ratio == 1 over KERNEL block sizes; 0.26 (vllm-0.24-0.33.md
    # appendix): "P and D must have equal kernel block sizes".  --block-size 4224 on both sides: FlashInfer
    # ([16, 32, 64]) takes kernel 64 (4224 = 64 * 66), Triton (MultipleOf(16)) keeps 4224
    p = fp8(2, block_size=4224, attention_backend="flashinfer")
    d = fp8(2, block_size=4224, attention_backend="triton")
    f = finding(plan("nano", p, d, "0.26"), "kernel-block-mismatch")
    assert f.severity == ERROR and "P 64, D 4224" in f.message


def test_equal_kernels_with_different_blocks_misaddress_silently_0_20() -> None:
    # §3.8: for Mamba the FA block_len relations are not checked, so blocks that differ with the same kernel
    # pass validation.  Nano fp8 P TP4 2096 / k16 vs D TP2 4176 / k16 (§2.5 table); 4176 % 2096 != 0
    f = finding(plan("nano", fp8(4), fp8(2), "0.20"), "block-size-mismatch")
    assert "P block 2096 vs D block 4176 (same kernel block, ratio n/a)" in f.message


def test_spec_decode_joins_the_compatibility_hash_in_0_28() -> None:
    # §3.8: 0.20's compat hash has no spec fields; vllm-0.24-0.33.md: from 0.28 it includes the speculative config
    s = E(tp=1, num_speculative_tokens=3)
    assert "ignores it, so a mismatch pairs silently" in finding(plan("nano", s, s, "0.27"), "spec-decode").message
    assert "fails the handshake" in finding(plan("nano", s, s, "0.28"), "spec-decode").message


def test_spec_decode_prefill_backoff_from_0_31() -> None:
    # vllm-0.24-0.33.md: P drops max(1, lookahead - 1) prompt tokens from 0.31 (3 speculative tokens -> 2), one before
    s = E(tp=1, num_speculative_tokens=3)
    assert "P leaves 2 prompt tokens to D" in finding(plan("nano", s, s, "0.31"), "spec-decode").message
    assert "P leaves" not in finding(plan("nano", s, s, "0.28"), "spec-decode").message


def test_dense_model_has_no_mamba_rules() -> None:
    pl = plan("llama-3.1-8b", E(tp=1), E(tp=1), "0.32")
    assert "dense-model" in codes(pl)
    assert not codes(pl) & {"conv-layout-ds", "conv-layout-sd", "hma-required", "spec-decode", "prefix-caching-hybrid"}
