"""`hybridpd plan` through its real entry point: exit codes, stdout JSON, stderr errors, imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED_SIDE_KEYS = {"tp", "attention_block_size", "kernel_block_size", "physical_per_logical", "page_size_bytes",
                      "mamba_page_bytes", "padding_bytes", "conv_state_shape", "ssm_state_shape", "conv_state_bytes",
                      "ssm_state_bytes", "num_kv_heads", "groups", "num_shared_tensors"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "hybridpd_cli.main", *args], capture_output=True, text=True,
                          env=e, timeout=60)


def test_json_schema_and_values() -> None:
    r = run("plan", "nano-nvfp4", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.20", "--isl", "1000", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for side in ("prefill", "decode"):
        assert REQUIRED_SIDE_KEYS <= set(d[side])
        assert all(set(g) >= {"kind", "layers"} for g in d[side]["groups"])
    t = d["transfer"][0]
    assert set(t) >= {"isl", "bytes", "naive_bytes", "descriptors", "per_rank"}
    assert set(t["per_rank"][0]) >= {"rank", "bytes", "naive_bytes", "descriptors"}
    assert t["bytes"] == sum(r["bytes"] for r in t["per_rank"])
    # NVFP4 checkpoint: hf_quant_config kv_cache_quant_algo FP8 -> fp8 KV (reference §2.2) -> block 4176
    assert d["prefill"]["kv_cache_dtype"] == "fp8"
    assert d["prefill"]["attention_block_size"] == 4176
    assert t["per_rank"][0]["bytes"] == 32_022_528
    assert all(set(f) == {"severity", "code", "message", "fix"} for f in d["findings"])
    assert isinstance(d["conv_offsets"], list) and d["conv_offsets"][0]["rank"] == 0


def test_human_output_has_sections() -> None:
    r = run("plan", "granite-tiny", "--ptp", "1", "--dtp", "2", "--fmt", "plain")
    assert r.returncode == 0, r.stderr
    for title in ("Per-side layout", "HMA groups", "NIXL descriptors", "Per request", "Findings"):
        assert title in r.stdout
    assert "conv-state-corruption" in r.stdout


def test_markdown_format() -> None:
    r = run("plan", "nano", "--fmt", "markdown")
    assert r.returncode == 0 and "| " in r.stdout and "### Findings" in r.stdout


def test_strict_exits_1_on_error_finding() -> None:
    r = run("plan", "granite-tiny", "--ptp", "1", "--dtp", "2", "--strict", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["ok"] is False


@pytest.mark.parametrize("args,needle", [
    (("plan", "no-such-model"), "MODEL"),
    (("plan", "nano", "--ptp", "0"), "--ptp"),
    (("plan", "nano", "--gpu-memory", "lots"), "--gpu-memory"),
    (("plan", "nano", "--vllm-version", "0.27"), "--vllm-version"),
    (("plan", "nano", "--isl", "abc"), "--isl"),
])
def test_usage_errors_exit_2_one_line(args: tuple[str, ...], needle: str) -> None:
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert needle in r.stderr
    assert lines[-1].startswith("Error")


def test_plan_does_not_import_heavy_modules() -> None:
    code = ("import sys; from hybridpd_cli.main import main\n"
            "try:\n    main(['plan','nano','--json'])\nexcept SystemExit:\n    pass\n"
            "bad=[m for m in ('torch','vllm','nixl','numpy','safetensors') if m in sys.modules]\n"
            "print('HEAVY', bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr


def test_help_does_not_import_library_layout() -> None:
    code = ("import sys; from hybridpd_cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', [m for m in ('hybridpd.layout','torch','rich') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LOADED []" in r.stdout, r.stdout[-300:]


def test_model_from_directory_and_config_path(tiny_models: dict[str, Path]) -> None:
    for arg in (tiny_models["nemoh"], tiny_models["nemoh"] / "config.json"):
        r = run("plan", str(arg), "--platform", "cpu", "--no-enable-prefix-caching", "--isl", "97", "--json",
                "--vllm-version", "0.32")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["transfer"][0]["bytes"] == 102144


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig.png"
    r = run("plan", "nano", "--plot", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
