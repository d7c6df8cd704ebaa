"""Rehearsal logic without NIXL (fill, expectation, descriptor views, checks) plus NIXL integration runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.verify.rehearsal import D_INIT, P_PAD, expected_decode, fill_prefill, full_fa, full_mamba, make_setup
from hybridpd.verify.verdict import RankResult, run_in_memory


def _plan(model: Path | str, ptp: int, dtp: int, **kw: Any) -> Any:
    return build_plan(str(model), prefill=EngineSettings(tp=ptp, **kw), decode=EngineSettings(tp=dtp, **kw))


def _ok(res: list[RankResult]) -> bool:
    return all(r.ok for r in res)


# ------------------------------------------------------------------------------------ unit: the fill


def test_prefill_tp1_page_is_the_full_state(tiny_models: dict[str, Path]) -> None:
    s = make_setup(_plan(tiny_models["nemoh"], 1, 2))
    p = s.p
    tensors = fill_prefill(s, 0)
    g = next(g for g in p.groups if g.kind == "mamba")
    blk = s.p_blocks[g.index][0]
    conv, ssm = full_mamba(s, 0, g.index)
    page = tensors[0][blk * p.page_size_bytes:(blk + 1) * p.page_size_bytes]
    assert p.mamba is not None
    assert np.array_equal(page[:p.mamba.conv_bytes], conv.reshape(-1))
    assert np.array_equal(page[p.mamba.conv_bytes:p.mamba_page_bytes], ssm.reshape(-1))
    assert (page[p.mamba_page_bytes:] == P_PAD).all()


def test_decode_expectation_is_rank_slice(tiny_models: dict[str, Path]) -> None:
    """D TP2's expected page, sliced by hand from the TP=1 state.  Tiny NemotronH (tests/conftest.py): x = 8 heads x
    32 = 256 channels, B and C = n_groups 2 x state 16 = 32 channels each, so the DS conv state is [x 0:256 | B
    256:288 | C 288:320], each channel a row of conv_kernel - 1 = 3 bf16 (6 B).  MambaMixer2 shards x, the groups
    and the heads contiguously (shared/reference/vllm-hybrid-pd.md §1): rank r keeps x[128r:128r+128],
    B[256+16r:+16], C[288+16r:+16] (160 channels = 960 B) and heads [4r:4r+4] (4 x 32 x 16 fp32 = 8192 B)."""
    s = make_setup(_plan(tiny_models["nemoh"], 1, 2))
    d = s.d
    assert d.mamba is not None
    assert (d.mamba.conv_bytes, d.mamba_page_bytes) == (960, 960 + 8192)
    g = next(g for g in d.groups if g.kind == "mamba")
    conv, ssm = full_mamba(s, 0, g.index)
    assert conv.shape == (320, 6) and ssm.shape == (8, 32 * 16 * 4)
    for r in range(2):
        exp = expected_decode(s, r)
        blk = s.d_blocks[g.index][0]
        page = exp[0][blk * d.page_size_bytes:(blk + 1) * d.page_size_bytes]
        want_conv = np.concatenate([conv[128 * r:128 * r + 128], conv[256 + 16 * r:272 + 16 * r],
                                    conv[288 + 16 * r:304 + 16 * r]])
        assert np.array_equal(page[:960], want_conv.reshape(-1))
        assert np.array_equal(page[960:960 + 8192], ssm[4 * r:4 * r + 4].reshape(-1))
        assert (page[960 + 8192:] == D_INIT).all()  # padding untouched
        # blocks outside the request stay as initialised
        other = sorted(set(range(s.n_log)) - {b for ids in s.d_blocks for b in ids})[0]
        assert (exp[0][other * d.page_size_bytes:(other + 1) * d.page_size_bytes] == D_INIT).all()


@pytest.mark.parametrize("release,kernel_block", [("0.32", 48), ("0.20", 16)])
def test_decode_expectation_fa_is_rank_head(tiny_models: dict[str, Path], release: str, kernel_block: int) -> None:
    """D TP2's expected FA pages, sliced by hand from the TP=1 K/V.  Tiny NemotronH: 2 KV heads of head_dim 64 in
    bf16, so one head's K (or V) is 128 B per token, and at D TP2 rank r keeps head r.  Block 48 tokens: vLLM 0.32
    runs one 48-token kernel block per block, K and V of a head packed (kv_descs_per_block 1); 0.20 runs three
    16-token kernel blocks, all heads' K then all heads' V (kv_descs_per_block 2).  With one head per rank both
    lay a kernel page out as [K of head r: kernel_block x 128 B | V of head r]."""
    plan = build_plan(str(tiny_models["nemoh"]), prefill=EngineSettings(tp=1), decode=EngineSettings(tp=2),
                      vllm_version=release)
    s = make_setup(plan)
    d = s.d
    ratio = 48 // kernel_block
    assert (d.block_size, d.kernel_block_size, d.physical_per_logical) == (48, kernel_block, ratio)
    assert d.kernel_page_bytes == 2 * kernel_block * 128 and d.page_size_bytes == ratio * d.kernel_page_bytes
    g = next(g for g in d.groups if g.kind == "attention")
    assert len(s.d_blocks[g.index]) == 2  # 71 tokens (N-1 of 72) in 48-token blocks
    for r in range(2):
        exp = expected_decode(s, r)
        for j, blk in enumerate(s.d_blocks[g.index]):
            kv = full_fa(s, 0, g.index, j)  # TP=1: (kernel blocks, KV heads, K|V, tokens, bytes per token and head)
            assert kv.shape == (ratio, 2, 2, kernel_block, 128)
            page = exp[0][blk * d.page_size_bytes:(blk + 1) * d.page_size_bytes]
            assert np.array_equal(page.reshape(ratio, 2, kernel_block, 128), kv[:, r])


def test_n_minus_one_and_blocks(tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models["nemoh"], 1, 1)
    s = make_setup(plan, isl=97)
    assert s.n_tok == 96
    assert plan.transfer_for(97).logical_blocks == 2
    all_p = [b for ids in s.p_blocks for b in ids]
    assert len(all_p) == len(set(all_p))


# ------------------------------------------------------------------- unit: whole rehearsal, numpy copies


@pytest.mark.parametrize("ptp,dtp", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_nemotronh_passes_in_memory(tiny_models: dict[str, Path], ptp: int, dtp: int) -> None:
    res = run_in_memory(make_setup(_plan(tiny_models["nemoh"], ptp, dtp)))
    assert _ok(res), [r.mismatches for r in res]
    for r in res:
        assert r.moved_bytes == r.expected_bytes
        assert r.padding_bytes_moved == 0


def test_granite_homogeneous_passes(tiny_models: dict[str, Path]) -> None:
    assert _ok(run_in_memory(make_setup(_plan(tiny_models["granite"], 1, 1))))


def test_granite_hetero_fails_naming_region(tiny_models: dict[str, Path]) -> None:
    res = run_in_memory(make_setup(_plan(tiny_models["granite"], 1, 2)))
    assert not _ok(res)
    # accounting matches (vLLM moves the predicted bytes), semantics do not
    assert all(r.moved_bytes == r.expected_bytes for r in res)
    assert any("D rank 0: region C" in m for m in res[0].mismatches)
    assert any("D rank 1: region B" in m for m in res[1].mismatches)


@pytest.mark.parametrize("inject", ["offset", "length"])
def test_injection_fails_naming_rank_region_block(tiny_models: dict[str, Path], inject: str) -> None:
    res = run_in_memory(make_setup(_plan(tiny_models["nemoh"], 1, 2), inject=inject, inject_rank=1))
    assert res[0].ok and not res[1].ok
    msg = " ".join(res[1].mismatches)
    assert "D rank 1: region B" in msg and "block" in msg
    assert res[1].injected


def test_refuses_block_not_divisible_with_fix(tiny_models: dict[str, Path]) -> None:
    plan = build_plan(str(tiny_models["nemoh"]), prefill=EngineSettings(tp=1, block_size=48),
                      decode=EngineSettings(tp=1, block_size=64))
    with pytest.raises(UsageError) as e:
        make_setup(plan)
    assert e.value.exit_code == 2
    assert "block-not-divisible" in str(e.value) and "--block-size 64" in str(e.value)
    fixed = _plan(tiny_models["nemoh"], 1, 1, block_size=plan.recommended_block_size)
    assert _ok(run_in_memory(make_setup(fixed)))


def test_refuses_dense_model(tiny_models: dict[str, Path]) -> None:
    res = None
    try:
        res = run_in_memory(make_setup(_plan(tiny_models["llama"], 1, 2)))
    except UsageError:
        return
    assert _ok(res)


def test_cli_numpy_transport_json(tiny_models: dict[str, Path]) -> None:
    from hybridpd_cli.main import cli

    r = CliRunner().invoke(cli, ["verify", str(tiny_models["nemoh"]), "--ptp", "1", "--dtp", "2", "--rehearse",
                                 "--transport", "numpy", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] is True
    assert {"rank", "expected_bytes", "moved_bytes", "expected_descriptors", "moved_descriptors",
            "mismatches"} <= set(data["per_rank"][0])


def test_cli_device_cuda_without_gpu_is_one_line(tiny_models: dict[str, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from hybridpd_cli.main import main

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tiny_models["nemoh"]), "--rehearse", "--device", "cuda"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--device" in err and "0 CUDA device" in err


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:0,1,2", "cuda:-1"])
def test_cli_device_malformed_exit_2(tiny_models: dict[str, Path], spec: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from hybridpd_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["verify", str(tiny_models["nemoh"]), "--rehearse", "--device", spec])
    assert e.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_cli_numpy_transport_on_gpu_refused(tiny_models: dict[str, Path]) -> None:
    from hybridpd_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["verify", str(tiny_models["nemoh"]), "--rehearse", "--device", "cuda", "--transport", "numpy"])
    assert e.value.code == 2


def test_cli_refusal_exit_2(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from hybridpd_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["verify", str(tiny_models["nemoh"]), "--rehearse", "--p-block-size", "48", "--d-block-size", "64",
              "--transport", "numpy"])
    assert e.value.code == 2
    assert "--block-size 64" in capsys.readouterr().err


# ---------------------------------------------------------------------------- integration: real NIXL


def _nixl(setup: Any) -> list[RankResult]:
    from hybridpd.verify.nixl_agent import nixl_available, run_nixl

    if not nixl_available():
        pytest.skip("nixl not installed")
    return run_nixl(setup)


@pytest.mark.integration
@pytest.mark.parametrize("model,ptp,dtp", [("nemoh", 1, 1), ("nemoh", 1, 2), ("nemoh", 2, 1), ("granite", 1, 1)])
def test_nixl_passes(tiny_models: dict[str, Path], model: str, ptp: int, dtp: int) -> None:
    res = _nixl(make_setup(_plan(tiny_models[model], ptp, dtp)))
    assert _ok(res), [r.mismatches for r in res]
    for r in res:
        if r.telemetry:
            assert r.telemetry["bytes"] == r.expected_bytes


@pytest.mark.integration
def test_nixl_granite_hetero_fails(tiny_models: dict[str, Path]) -> None:
    res = _nixl(make_setup(_plan(tiny_models["granite"], 1, 2)))
    assert not _ok(res)
    assert any("region C" in m for m in res[0].mismatches)
    assert any("region B" in m for m in res[1].mismatches)


@pytest.mark.integration
@pytest.mark.parametrize("inject", ["offset", "length"])
def test_nixl_injection_fails(tiny_models: dict[str, Path], inject: str) -> None:
    res = _nixl(make_setup(_plan(tiny_models["nemoh"], 1, 1), inject=inject))
    assert not _ok(res)
    assert any("D rank 0: region B" in m and "block" in m for m in res[0].mismatches)


@pytest.mark.integration
def test_nixl_cli_bundled_nano(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridpd_cli.main import main

    from hybridpd.verify.nixl_agent import nixl_available

    if not nixl_available():
        pytest.skip("nixl not installed")
    main(["verify", "nano-fp8", "--ptp", "1", "--dtp", "2", "--rehearse", "--json"])  # no SystemExit: exit 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["transport"] == "nixl"
    # UCX's own protocol report names what carried the DRAM READs (cma, or tcp when cma is unavailable)
    assert data["memory"] == "DRAM" and data["ucx_read_transports"], data
    assert all("into host memory from host" in op for op in data["ucx_read_operations"])


@pytest.mark.integration
def test_nixl_cli_granite_tiny_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridpd_cli.main import main

    from hybridpd.verify.nixl_agent import nixl_available

    if not nixl_available():
        pytest.skip("nixl not installed")
    with pytest.raises(SystemExit) as e:
        main(["verify", "granite-tiny", "--ptp", "1", "--dtp", "2", "--rehearse", "--json"])
    assert e.value.code == 1


def test_offset_injection_on_the_last_block_stays_in_registered_memory() -> None:
    """Seed 0, Nano 2->2: the first B descriptor of D rank 0 sits in P's last block; shifting it up would leave
    the registered tensor (NIXL refuses to prep it), so the fault shifts it down and the check must catch it."""
    s = make_setup(_plan("nano", 2, 2), inject="offset", inject_rank=0)
    res = run_in_memory(s)  # numpy copies refuse addresses outside every tensor, like NIXL
    assert "(-" in res[0].injected[0], res[0].injected
    assert not res[0].ok and res[1].ok
    assert any("D rank 0: region B" in m for m in res[0].mismatches)


# ----------------------------------------------------------------------- the NIXL wrapper and plumbing


def test_set_env_defaults_cma_segment_but_keeps_the_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from hybridpd.verify.nixl_wrap import set_env

    monkeypatch.delenv("UCX_CMA_SEG_SIZE", raising=False)
    set_env()
    assert os.environ["UCX_CMA_SEG_SIZE"] == "64m"  # one process_vm_readv per KV descriptor (bench_rehearsal)
    monkeypatch.setenv("UCX_CMA_SEG_SIZE", "512k")
    set_env()
    assert os.environ["UCX_CMA_SEG_SIZE"] == "512k"


def _fails(conn: Any) -> None:
    conn.send(("error", "rank went wrong"))


def _silent(conn: Any) -> None:
    conn.recv()  # waits for the parent, which never writes


@pytest.mark.integration
def test_rank_processes_report_errors_and_never_hang() -> None:
    import time

    from hybridpd.errors import ExternalToolError
    from hybridpd.verify.nixl_agent import RankProcesses

    t0 = time.monotonic()
    with RankProcesses(timeout_s=20) as rp:
        c = rp.start(_fails)
        with pytest.raises(ExternalToolError, match="decode rank 0 failed:\nrank went wrong"):
            rp.recv(c, "decode rank 0")
    with pytest.raises(ExternalToolError, match="prefill rank 1 did not answer within 2 s"):
        with RankProcesses(timeout_s=2) as rp:
            procs = rp.procs
            rp.recv(rp.start(_silent), "prefill rank 1")
    assert not any(p.is_alive() for p in procs)  # reaped on the way out
    assert time.monotonic() - t0 < 60
