"""Mamba-1 (Jamba) and GatedDeltaNet (Qwen3-Next) state: figures pinned to hand computation from the bundled configs.

ai21labs/Jamba-v0.1: hidden 4096, mamba_expand 2 -> 8192 channels, mamba_d_state 16, mamba_d_conv 4; attention
32 heads / 8 KV heads, head 4096/32 = 128; attention at layers 4, 12, 20, 28 (period 8, offset 4); bf16.
Qwen/Qwen3-Next-80B-A3B-Instruct: 16 key heads x 128, 32 value heads x 128, conv kernel 4; attention 16 heads /
2 KV heads x 256 at layers 3, 7, ..., 47; bf16 (assumed).  vLLM's own functions are checked in
tests/test_vllm_crosscheck_states.py; here every expected number is worked out by hand in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridpd.core import families, models
from hybridpd.core.descriptors import local_table, request_desc_ids
from hybridpd.core.mamba import GdnRankState, Mamba1RankState
from hybridpd.core.plan import build_plan, plan_to_dict
from hybridpd.core.semantics import check_conv
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError


def _plan(model: str, version: str, ptp: int = 1, dtp: int = 1, isls: tuple[int, ...] | None = None,
          **kw: object):  # type: ignore[no-untyped-def]
    return build_plan(model, prefill=EngineSettings(tp=ptp, **kw), decode=EngineSettings(tp=dtp, **kw),  # type: ignore[arg-type]
                      vllm_version=version, isls=isls)


def _codes(plan) -> set[str]:  # type: ignore[no-untyped-def]
    return {f.code for f in plan.findings}


# ---------------------------------------------------------------- Jamba (Mamba-1)


def test_jamba_tp1_state_and_block() -> None:
    p = _plan("jamba", "0.25").prefill
    assert isinstance(p.mamba, Mamba1RankState)
    assert p.mamba.conv.shape("DS") == (8192, 3)  # (channels, conv_kernel - 1)
    assert p.mamba.ssm_shape == (8192, 16)
    assert p.mamba.conv_bytes == 8192 * 3 * 2 == 49_152
    assert p.mamba.ssm_bytes == 8192 * 16 * 2 == 262_144
    assert p.mamba_page_bytes == 311_296
    assert p.attn_bytes_per_token == 2 * 8 * 128 * 2 == 4096
    # 16 * ceil(311296 / (16 * 4096)) = 16 * 5
    assert p.block_size == 80 and p.kernel_block_size == 80
    assert p.page_size_bytes == 80 * 4096 == 327_680 and p.padding_bytes == 16_384
    assert p.num_shared_tensors == 4
    kinds = [(g.kind, g.layers) for g in p.groups]
    assert kinds[0] == ("mamba", (0, 8, 16, 24)) and kinds[-1] == ("attention", (4, 12, 20, 28))
    assert len(kinds) == 8  # 28 Mamba layers in 7 groups of 4, one attention group of 4


def test_jamba_tp2_state_and_block() -> None:
    p = _plan("jamba", "0.32", 2, 2).prefill
    assert p.mamba is not None
    assert p.mamba.conv.shape("DS") == (4096, 3) and p.mamba.ssm_shape == (4096, 16)
    assert p.mamba_page_bytes == 4096 * 3 * 2 + 4096 * 16 * 2 == 155_648
    assert p.num_kv_heads == 4 and p.attn_bytes_per_token == 2048
    # 16 * ceil(155648 / 32768) = 16 * 5
    assert p.block_size == 80 and p.page_size_bytes == 163_840 and p.padding_bytes == 8192


def test_mamba1_conv_state_has_no_speculative_rows() -> None:
    """mamba1_state_shape takes no num_spec (Mamba2 and GDN add the draft tokens' rows)."""
    j = _plan("jamba", "0.32", num_speculative_tokens=2).prefill
    q = _plan("qwen3-next", "0.32", num_speculative_tokens=2).prefill
    assert j.mamba is not None and q.mamba is not None
    assert j.mamba.conv.state_len == 3 and q.mamba.conv.state_len == 5


def test_jamba_request_bytes_and_descriptors_025() -> None:
    """0.25: K and V are separate descriptors; 2 Mamba descriptors (x, SSM) per slot and group."""
    t1k, t8k = _plan("jamba", "0.25", isls=(1024, 8192)).transfers
    # 1023 tokens -> ceil(1023/80) = 13 blocks; FA 4 slots * 13 * 2 (K, V) = 104 descs of 163,840 B
    assert t1k.logical_blocks == 13 and t1k.fa_bytes == 104 * 163_840 == 17_039_360
    # Mamba: 4 slots * 7 groups * (x 49,152 + SSM 262,144)
    assert t1k.mamba_bytes == 28 * 311_296 == 8_716_288
    assert t1k.descriptors == 104 + 28 * 2 == 160
    # 8191 tokens -> 103 blocks: 4 * 103 * 2 = 824 FA descs
    assert t8k.logical_blocks == 103 and t8k.fa_bytes == 824 * 163_840 and t8k.descriptors == 824 + 56


def test_jamba_request_033_packs_k_and_v() -> None:
    (t,) = _plan("jamba", "0.33", isls=(1024,), enable_prefix_caching=False).transfers
    assert t.fa_bytes == 4 * 13 * 327_680 and t.descriptors == 4 * 13 + 56


def test_jamba_hetero_tp_offsets_are_linear_and_correct() -> None:
    plan = _plan("jamba", "0.32", 1, 2)
    assert plan.routes is not None and "conv-state-corruption" not in _codes(plan)
    for r, rt in enumerate(plan.routes):
        (src,) = rt.sources
        # D's x slice is 4096 channels * 6 B = 24,576 B at r * 24,576; SSM rows r*4096.. at 49,152 + r*131,072
        assert src.conv == ((r * 24_576, 24_576),) and src.ssm == (49_152 + r * 131_072, 131_072)
        assert check_conv(plan.prefill, plan.decode, rt).ok
    (t,) = plan.transfer_for(1024).per_rank[:1]
    assert t.mamba_bytes == 28 * (24_576 + 131_072)


def test_jamba_p_tp_larger_than_d() -> None:
    plan = _plan("jamba", "0.32", 2, 1)
    assert plan.routes is not None
    (rt,) = plan.routes
    assert [s.p_rank for s in rt.sources] == [0, 1]
    for j, s in enumerate(rt.sources):
        # each P rank's whole x (4096 channels, 24,576 B) and SSM (131,072 B); fills half j of D's regions
        assert s.conv == ((0, 24_576),) and s.ssm == (24_576, 131_072) and s.local_slot == j
    assert check_conv(plan.prefill, plan.decode, rt).ok


def test_jamba_refused_before_025_and_planned_from_it() -> None:
    assert "unsupported-mamba-type" in _codes(_plan("jamba", "0.24"))
    for v in ("0.25", "0.28", "0.33"):
        plan = _plan("jamba", v)
        assert "layout-not-modelled" not in _codes(plan) and plan.ok and plan.transfers, v


def test_jamba_prefix_caching_all_mode_uses_chunk_2048() -> None:
    """0.26/0.27 put Jamba (SupportsMambaPrefixCaching) in mode 'all': block = lcm(2048, 16) * ceil(76 / 2048)."""
    p = _plan("jamba", "0.27", enable_prefix_caching=True).prefill
    assert p.mamba_cache_mode == "all" and p.block_size == 2048


# ---------------------------------------------------------------- Qwen3-Next (GatedDeltaNet)


def test_qwen3_next_tp1_state_and_block() -> None:
    p = _plan("qwen3-next", "0.22").prefill
    assert isinstance(p.mamba, GdnRankState)
    assert p.mamba.conv.names == ("Q", "K", "V") and p.mamba.conv.channels == (2048, 2048, 4096)
    assert p.mamba.conv.shape("DS") == (2 * 16 * 128 + 32 * 128, 3) == (8192, 3)
    assert p.mamba.ssm_shape == (32, 128, 128)
    assert p.mamba_page_bytes == 49_152 + 32 * 128 * 128 * 2 == 1_097_728
    assert p.attn_bytes_per_token == 2 * 2 * 256 * 2 == 2048
    # 16 * ceil(1,097,728 / 32,768) = 16 * 34
    assert p.block_size == 544 and p.page_size_bytes == 1_114_112 and p.padding_bytes == 16_384
    assert p.num_shared_tensors == 12 and [g.kind for g in p.groups] == ["mamba"] * 3 + ["attention"]


def test_qwen3_next_tp4_kv_heads_replicated() -> None:
    p = _plan("qwen3-next", "0.32", 4, 4).prefill
    assert p.mamba is not None and p.num_kv_heads == 1 and p.kv_heads_replicated
    assert p.mamba.conv.channels == (512, 512, 1024) and p.mamba.ssm_shape == (8, 128, 128)
    # 12,288 + 262,144 = 274,432; 16 * ceil(274,432 / 16,384) = 272
    assert p.mamba_page_bytes == 274_432 and p.block_size == 272


def test_qwen3_next_request_022() -> None:
    (t,) = _plan("qwen3-next", "0.22", isls=(1024,)).transfers
    # ceil(1023 / 544) = 2 blocks; FA 12 slots * 2 blocks * 2 (K, V) = 48 descs of 557,056 B
    assert t.fa_bytes == 48 * 557_056 and t.mamba_bytes == 36 * 1_097_728
    assert t.descriptors == 48 + 36 * 4 == 192  # Q, K, V, SSM per slot and group


def test_qwen3_next_hetero_offsets() -> None:
    plan = _plan("qwen3-next", "0.32", 1, 2)
    assert plan.routes is not None and "conv-state-corruption" not in _codes(plan)
    (src,) = plan.routes[1].sources
    # P's Q, K, V sections: 12,288, 12,288, 24,576 B; D rank 1 takes the second half of each
    assert src.conv == ((6144, 6144), (18_432, 6144), (36_864, 12_288))
    assert src.ssm == (49_152 + 524_288, 524_288)
    assert all(check_conv(plan.prefill, plan.decode, rt).ok for rt in plan.routes)


def test_qwen3_next_prefix_caching_falls_back_to_align() -> None:
    """No SupportsMambaPrefixCaching: mode 'align' even where the release picks 'all' (0.26, 0.27)."""
    assert _plan("qwen3-next", "0.27", enable_prefix_caching=True).prefill.mamba_cache_mode == "align"
    assert _plan("nano", "0.27", enable_prefix_caching=True).prefill.mamba_cache_mode == "all"


def test_qwen3_next_033_checkpoint_alignment() -> None:
    """0.33 align mode on CUDA: lcm(16, FlashInfer GDN checkpoint 64) = 64; 64 * ceil(1,097,728 / 131,072) = 576."""
    assert _plan("qwen3-next", "0.33", enable_prefix_caching=True).prefill.block_size == 576
    assert _plan("qwen3-next", "0.32", enable_prefix_caching=True).prefill.block_size == 544
    assert _plan("qwen3-next", "0.33", enable_prefix_caching=False).prefill.block_size == 544


def test_qwen3_next_refused_before_022() -> None:
    assert "unsupported-mamba-type" in _codes(_plan("qwen3-next", "0.21"))
    plan = _plan("qwen3-next", "0.22")
    assert plan.ok and plan.transfers and "layout-not-modelled" not in _codes(plan)


def test_gdn_key_heads_must_divide_tp() -> None:
    r = families.model_spec(models.resolve("qwen3-next")).recurrent
    assert isinstance(r, families.GdnDims)
    with pytest.raises(UsageError, match="key heads 16 is not divisible by TP 32"):
        _ = GdnRankState(dims=r, tp=32, num_spec=0, conv_dtype="bfloat16", conv_elem=2, ssm_dtype="bfloat16",
                         ssm_elem=2).conv


# ---------------------------------------------------------------- descriptors, JSON


@pytest.mark.parametrize("model,version,per_slot", [("jamba", "0.32", 2), ("qwen3-next", "0.32", 4),
                                                    ("jamba", "0.25", 2)])
def test_descriptor_tables_and_request_ids(model: str, version: str, per_slot: int) -> None:
    n = 32  # more than the 13 (Jamba) / 2 (Qwen3-Next) attention blocks of a 1k request, plus one per Mamba group
    plan = _plan(model, version, num_blocks=n)
    p = plan.prefill
    table = local_table(p, [(i + 1) << 32 for i in range(p.num_shared_tensors)], n)
    kvd = p.profile.kv_descs_per_block
    assert table.num_fa_descs == p.num_shared_tensors * kvd * n
    assert len(table) - table.num_fa_descs == per_slot * p.num_ssm_slots * n
    t = plan.transfer_for(1024)
    blocks = [list(range(t.logical_blocks)) if g.kind == "attention" else [n - 1 - g.index] for g in p.groups]
    ids = request_desc_ids(p, table, blocks)
    assert ids.size == t.descriptors
    assert int(table.length[ids].sum()) == t.bytes
    assert np.unique(ids).size == ids.size


def test_plan_json_names_the_sub_projections() -> None:
    j = plan_to_dict(_plan("jamba", "0.32"))
    assert j["prefill"]["conv_split"] == {"x": 8192, "state_len": 3}
    assert j["prefill"]["descriptors"]["mamba_desc_bytes"] == {"x": 49_152, "ssm": 262_144}
    assert j["prefill"]["descriptors"]["mamba_regions"] == 2 * 4
    assert j["model"]["recurrent"] == {"kind": "mamba1", "intermediate_size": 8192, "state_size": 16,
                                       "conv_kernel": 4}
    q = plan_to_dict(_plan("qwen3-next", "0.32"))
    assert q["prefill"]["conv_split"] == {"Q": 2048, "K": 2048, "V": 4096, "state_len": 3}
    assert q["conv_offsets"][0]["sources"][0]["conv"] == {"Q": [0, 12_288], "K": [12_288, 12_288],
                                                          "V": [24_576, 24_576]}
    n = plan_to_dict(_plan("nano", "0.32"))
    assert list(n["prefill"]["conv_split"]) == ["x", "B", "C", "state_len"]
    assert list(n["prefill"]["descriptors"]["mamba_desc_bytes"]) == ["x", "B", "C", "ssm"]


# ---------------------------------------------------------------- the rehearsal (numpy copies, no NIXL)


@pytest.mark.parametrize("model,ptp,dtp", [("jamba", 1, 2), ("jamba", 4, 2), ("qwen3-next", 1, 2),
                                           ("qwen3-next", 2, 1)])
def test_rehearsal_moves_exactly_the_ground_truth(model: str, ptp: int, dtp: int) -> None:
    from hybridpd.verify.rehearsal import make_setup
    from hybridpd.verify.verdict import run_in_memory

    plan = _plan(model, "0.32", ptp, dtp)
    res = run_in_memory(make_setup(plan, max_rank_bytes=8 << 20))
    assert all(r.ok for r in res), [r.mismatches[:2] for r in res]
    names = ["FA", "x", "SSM"] if model == "jamba" else ["FA", "Q", "K", "V", "SSM"]
    assert list(res[0].moved_components) == names
    # Jamba P TP1 -> D TP2 per D rank per (slot, group): x 24,576 B + SSM 131,072 B; 4 slots x 7 groups
    if (model, ptp, dtp) == ("jamba", 1, 2):
        assert res[0].moved_components["x"] == 28 * 24_576 and res[0].moved_components["SSM"] == 28 * 131_072


@pytest.mark.parametrize("model", ["jamba", "qwen3-next"])
@pytest.mark.parametrize("inject", ["offset", "length"])
def test_rehearsal_catches_an_injected_fault(model: str, inject: str) -> None:
    from hybridpd.verify.rehearsal import make_setup
    from hybridpd.verify.verdict import run_in_memory

    res = run_in_memory(make_setup(_plan(model, "0.32", 1, 2), inject=inject, max_rank_bytes=8 << 20))
    assert [r.ok for r in res] == [False, True]
    first = "x" if model == "jamba" else "Q"
    assert any(f"region {first}:" in m for m in res[0].mismatches)


@pytest.mark.integration
@pytest.mark.parametrize("model,ptp,dtp", [("jamba", 1, 2), ("qwen3-next", 2, 1)])
def test_nixl_rehearsal_moves_the_planned_bytes(model: str, ptp: int, dtp: int) -> None:
    """Real NIXL agents (one process per rank): NIXL's own telemetry counts the plan's bytes and descriptors."""
    from hybridpd.verify.nixl_agent import nixl_available, run_nixl
    from hybridpd.verify.rehearsal import make_setup

    if not nixl_available():
        pytest.skip("nixl not installed")
    plan = _plan(model, "0.32", ptp, dtp)
    setup = make_setup(plan, max_rank_bytes=8 << 20)
    res = run_nixl(setup)
    assert all(r.ok for r in res), [r.mismatches[:2] for r in res]
    want = plan.transfer_for(setup.isl)
    for r in res:
        if r.telemetry:
            assert r.telemetry["bytes"] == r.expected_bytes == want.per_rank[r.rank].bytes
            assert r.telemetry["descriptors"] == r.moved_descriptors
