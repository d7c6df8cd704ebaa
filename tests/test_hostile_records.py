"""Hostile deployment records (issue 29): bounded, type-checked, and never executed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_deployment import _lp

from hybridpd.errors import UsageError
from hybridpd.launch import deployment


def _record(tiny_models: dict[str, Path]) -> dict:
    return deployment.build_record(_lp(tiny_models["llama"]), model_arg=str(tiny_models["llama"]))


@pytest.mark.parametrize("field,value,needle", [
    ("tp", 10**18, "outside 1..1024"),
    ("tp", 65536, "outside 1..1024"),
    ("tp", "2", "must be an integer"),
    ("tp", True, "must be an integer"),
    ("gpu_memory_utilization", "@@NAN@@", "finite"),
    ("max_model_len", [1], "must be an integer"),
    ("num_blocks", 10**30, "num_blocks"),
    ("enable_prefix_caching", "yes", "true or false"),
])
def test_bad_setting_is_one_line_usage_error(tiny_models: dict[str, Path], tmp_path: Path, field: str,
                                             value: object, needle: str) -> None:
    rec = _record(tiny_models)
    rec["settings"]["decode"][field] = value
    p = tmp_path / "d.json"
    p.write_text(json.dumps(rec).replace('"@@NAN@@"', "NaN"))
    with pytest.raises(UsageError) as e:
        deployment.load(str(p))
    assert needle in str(e.value) and "\n" not in str(e.value) and field in str(e.value)


def test_huge_tp_record_is_refused_by_verify_cli(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    rec = _record(tiny_models)
    rec["settings"]["prefill"]["tp"] = 10**18
    p = tmp_path / "d.json"
    p.write_text(json.dumps(rec))
    cp = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "diff", "--deployment", str(p), "--ptp", "2"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert cp.returncode in (1, 2) and "Traceback" not in cp.stderr, cp.stderr


def test_doctor_never_runs_the_recorded_python(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = tmp_path / "evil-python"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\n")
    evil.chmod(evil.stat().st_mode | stat.S_IEXEC)
    rec = _record(tiny_models)
    rec["vllm"]["python"] = str(evil)
    p = tmp_path / "d.json"
    p.write_text(json.dumps(rec))
    cp = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "doctor", "--deployment", str(p), "--json"],
                        capture_output=True, text=True, timeout=120, check=False,
                        env={**os.environ, "PATH": os.environ.get("PATH", "")})
    assert "Traceback" not in cp.stderr, cp.stderr
    assert not marker.exists(), "doctor executed the interpreter named in the record"
    assert "not run" in cp.stdout
