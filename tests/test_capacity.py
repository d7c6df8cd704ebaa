"""Capacity (issue #30 item 1) pinned to what real engines logged, and the before-launch refusals.

Expected figures are read from the H200 engine logs under docs/gpu-vllm-2026-12-01/ (vLLM 0.24.0 and 0.26.0, CUDA,
prefix caching off): "GPU KV cache size: N tokens", "Maximum concurrency for L tokens per request: Xx" and the
NIXL connector's "Hybrid SSM registration: ... logical_num_blocks=N". Never computed by hybridpd.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import TINY_GRANITE, TINY_NEMOTRONH

from hybridpd.core.capacity import engine_args, mamba_blocks_per_group, plan_capacity
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings as E

LOGS = Path(__file__).resolve().parents[1] / "docs" / "gpu-vllm-2026-12-01"
GIB = 1 << 30

# log file (under LOGS), model, release, --max-model-len, --kv-cache-memory (every command is in the .cmd beside it)
RUNS = [
    ("machine1/tiny24/tiny.serve.out", "nemoh", "0.24", 2048, GIB),
    ("machine1/tiny26/tiny.serve.out", "nemoh", "0.26", 2048, GIB),
    ("machine2/tinyc24/tiny.serve.out", "nemoh", "0.24", 2048, GIB),
    ("machine1/final24/nemotronh-0.24.0.serve.out", "nemoh", "0.24", 512, GIB),
    ("machine1/final26/nemotronh-0.26.0.serve.out", "nemoh", "0.26", 512, GIB),
    ("machine1/hma26/hma.log", "nemoh", "0.26", 512, GIB),
    ("machine1/final26/granite-0.26.0.serve.out", "granite", "0.26", 512, GIB),
    ("machine2/granite24/granite-0.24.0.serve.out", "granite", "0.24", 512, GIB),
    ("machine1/nano24/nano.serve.out", "nano", "0.24", 32768, 2 * GIB),
]


def logged(path: Path) -> tuple[int, float, int, int]:
    """(KV cache tokens, max concurrency, max_model_len it was logged for, logical blocks) from one engine log."""
    text = path.read_text(errors="replace")
    tokens = {int(m.replace(",", "")) for m in re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)}
    conc = {(int(a.replace(",", "")), float(b))
            for a, b in re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)}
    blocks = {int(m) for m in re.findall(r"logical_num_blocks=(\d+)", text)}
    assert len(tokens) == len(conc) == len(blocks) == 1, (path, tokens, conc, blocks)  # P and D logged the same
    (mml, c), = conc
    return tokens.pop(), c, mml, blocks.pop()


def _model(name: str, tmp_path: Path) -> str:
    if name == "nano":
        return "nano"
    d = tmp_path / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TINY_NEMOTRONH if name == "nemoh" else TINY_GRANITE))
    return str(d)


@pytest.mark.parametrize("log,model,release,mml,mem", RUNS, ids=[r[0].split("/")[1] + "-" + r[1] for r in RUNS])
def test_capacity_equals_engine_log(log: str, model: str, release: str, mml: int, mem: int, tmp_path: Path) -> None:
    tokens, conc, logged_mml, blocks = logged(LOGS / log)
    assert logged_mml == mml
    s = E(kv_cache_memory=mem, max_model_len=mml, enable_prefix_caching=False)
    plan = build_plan(_model(model, tmp_path), prefill=s, decode=s, vllm_version=release, isls=(mml // 2,))
    cap = plan_capacity(plan, flipped=False)
    for side in (cap.prefill, cap.decode):
        assert side.num_blocks == blocks
        assert side.kv_cache_tokens == tokens
        assert side.max_concurrency is not None and f"{side.max_concurrency:.2f}" == f"{conc:.2f}"


def test_plan_json_capacity_per_side(tmp_path: Path) -> None:
    """`plan --json` carries capacity per side with its limiting pool (the tiny26 run: 1 GiB, 2,048 tokens)."""
    from click.testing import CliRunner

    from cli.main import cli

    tokens, conc, _, blocks = logged(LOGS / "machine1/tiny26/tiny.serve.out")
    r = CliRunner().invoke(cli, ["plan", _model("nemoh", tmp_path), "--vllm-version", "0.26", "--platform", "cuda",
                                 "--kv-cache-memory", "1GiB", "--max-model-len", "2048", "--no-enable-prefix-caching",
                                 "--json"])
    assert r.exit_code == 0, r.output
    cap = json.loads(r.output)["capacity"]
    for role in ("prefill", "decode"):
        c = cap[role]
        assert (c["num_blocks"], c["kv_cache_tokens"], round(c["max_concurrency"], 2)) == (blocks, tokens, conc)
        assert c["limited_by"] == "attention"  # 43 attention blocks against 2 Mamba blocks per request
        assert c["blocks_per_request_at_max_model_len"]["blocks"] * int(conc) <= blocks
        assert c["prefix_caching_flipped"]["prefix_caching"] is True


def test_mamba_blocks_per_mode() -> None:
    # MambaSpec.max_memory_usage_bytes (0.24 .. 0.32): 'none' 1 + spec, 'align' 2 + spec, 'all' cdiv(len, block) + spec
    assert [mamba_blocks_per_group(m, 2048, 128) for m in ("none", "align", "all")] == [1, 2, 16]
    assert mamba_blocks_per_group("align", 2048, 128, spec_blocks=3) == 5


def _tiny(tmp_path: Path, **kw: object) -> object:
    s = E(max_model_len=2048, enable_prefix_caching=False, **kw)  # type: ignore[arg-type]
    return build_plan(_model("nemoh", tmp_path), prefill=s, decode=s, vllm_version="0.26", isls=(100,))


def test_max_num_seqs_above_mamba_blocks_is_refused(tmp_path: Path) -> None:
    """vLLM issue 49064: with CUDA graphs, max_num_seqs > num_blocks refuses to start; --enforce-eager does not."""
    plan = _tiny(tmp_path, num_blocks=100)
    codes = {f.code: f.severity for f in plan_capacity(plan, max_num_seqs=(101, 101)).findings}
    assert codes == {"max-num-seqs-mamba": "error"}
    assert not plan_capacity(plan, max_num_seqs=(100, 100)).findings
    assert not plan_capacity(plan, max_num_seqs=(101, 101), enforce_eager=(True, True)).findings
    # unknown GPU size: 100 blocks are below both defaults (256, 1024) -> error; 500 only below 1024 -> warning
    assert {f.severity for f in plan_capacity(plan).findings} == {"error"}
    assert {f.severity for f in plan_capacity(_tiny(tmp_path / "b", num_blocks=500)).findings} == {"warning"}


def test_default_max_num_seqs_follows_gpu_memory(tmp_path: Path) -> None:
    small = plan_capacity(_tiny(tmp_path, gpu_memory=24 * GIB, gpu_memory_utilization=0.01)).prefill
    big = plan_capacity(_tiny(tmp_path / "b", gpu_memory=141 * GIB, gpu_memory_utilization=0.9)).prefill
    assert (small.max_num_seqs, big.max_num_seqs) == (256, 1024)
    assert big.limited_by == "max_num_seqs"


def test_request_larger_than_pool_is_refused(tmp_path: Path) -> None:
    # 2,048 tokens at block 48: 43 attention + 2 Mamba blocks; 44 blocks cannot hold one request
    findings = plan_capacity(_tiny(tmp_path, num_blocks=44), enforce_eager=(True, True)).findings
    assert [f.code for f in findings] == ["kv-cache-too-small", "kv-cache-too-small"]
    assert not plan_capacity(_tiny(tmp_path / "b", num_blocks=45), enforce_eager=(True, True)).findings


def test_engine_args() -> None:
    assert engine_args(["--enforce-eager", "--seed", "0", "--max-num-seqs", "16"]) == (16, None, True)
    assert engine_args(["--max-num-seqs=8", "--max-num-batched-tokens", "97", "--no-enforce-eager"]) == (8, 97, False)
    assert engine_args(["--max-num-seqs", "x"]) == (None, None, False)
