"""`hybridpd convert` through its entry point: JSON keys, exit codes, stderr, and crash safety (SIGKILL)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hybridpd_cli.main import main
from test_convert_support import data_sha, data_xxh3, load, meta, rand, save

SUMMARY_KEYS = {"operation", "ok", "to", "layout_before", "layout_after", "model", "device", "tensors_total",
                "tensors_converted", "conv_tensors", "ssm_tensors", "bytes_read", "bytes_written", "seconds",
                "bytes_per_second", "checksums", "inputs", "outputs", "tensors", "notes"}
FILE_KEYS = {"path", "bytes", "data_checksum", "conv_layout", "tp_size", "tp_rank"}
TENSOR_KEYS = {"file", "name", "kind", "action", "dtype", "shape_in", "shape_out", "layout_in", "layout_out",
               "recognised_by", "note"}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        main(["convert", *args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["nemoh"]  # tests/conftest.py: n_groups 2, 8 heads x 32, state 16, conv_kernel 4


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return save(tmp_path / "state.safetensors", {"model.layers.0.mixer.conv_state": rand((4, 3, 320), torch.bfloat16),
                                                "model.layers.0.mixer.ssm_state": rand((4, 8, 32, 16), torch.float32),
                                                "seq_lens": torch.arange(4)})


def test_json_summary_has_stable_keys(capsys: pytest.CaptureFixture[str], tmp_path: Path, state: Path,
                                      model_dir: Path) -> None:
    code, out, err = cli(capsys, str(state), str(tmp_path / "ds.safetensors"), "--to", "ds", "--model",
                         str(model_dir), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert set(d) == SUMMARY_KEYS
    assert all(set(f) == FILE_KEYS for f in d["inputs"] + d["outputs"])
    assert all(set(t) == TENSOR_KEYS for t in d["tensors"])
    assert (d["operation"], d["ok"], d["layout_before"], d["layout_after"]) == ("convert", True, ["SD"], "DS")
    assert (d["tensors_total"], d["tensors_converted"], d["conv_tensors"], d["ssm_tensors"]) == (3, 1, 1, 1)
    assert d["checksums"][str(state)] == "xxh3:" + data_xxh3(state)
    assert isinstance(d["bytes_read"], int) and d["bytes_read"] > 0
    code, out, _ = cli(capsys, str(tmp_path / "ds.safetensors"), str(tmp_path / "shards"), "--to", "DS",
                       "--tp-split", "2", "--json")  # dims come from the metadata the first run recorded
    assert code == 0
    d = json.loads(out)
    assert d["operation"] == "tp-split" and [o["tp_rank"] for o in d["outputs"]] == [0, 1]
    code, out, _ = cli(capsys, str(state), str(tmp_path / "sha.safetensors"), "--to", "DS", "--from", "SD",
                       "--checksum", "sha256", "--json")
    assert code == 0 and json.loads(out)["checksums"][str(state)] == "sha256:" + data_sha(state)


def test_human_output_and_notes(capsys: pytest.CaptureFixture[str], tmp_path: Path, state: Path) -> None:
    code, out, err = cli(capsys, str(state), str(tmp_path / "o.safetensors"), "--to", "DS", "--from", "SD", "--fmt",
                         "plain")
    assert code == 0, err
    assert "conv layout SD -> DS" in out and "transposed" in out and "1 of 3 tensors converted" in out
    assert err == ""


@pytest.mark.parametrize(("args", "needle"), [
    (["--from", "SD"], "missing --to"),
    (["--to", "DS"], "--from"),
    (["--to", "XY"], "is not DS or SD"),
    (["--to", "DS", "--from", "SD", "--tp-split", "2"], "--model"),
    (["--to", "DS", "--model", "llama-3.1-8b"], "no Mamba2 layers"),
    (["--to", "DS", "--model", "no-such-model"], "MODEL"),
])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path, state: Path, args: list[str],
                             needle: str) -> None:
    code, out, err = cli(capsys, str(state), str(tmp_path / "out"), *args)
    assert code == 2 and out == "" and needle in err, err
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(capsys: pytest.CaptureFixture[str], tmp_path: Path, state: Path) -> None:
    out_path = tmp_path / "o.safetensors"
    out_path.write_text("keep me")
    code, _, err = cli(capsys, str(state), str(out_path), "--to", "DS", "--from", "SD")
    assert code == 2 and "--force" in err and out_path.read_text() == "keep me"
    code, _, err = cli(capsys, str(state), str(out_path), "--to", "DS", "--from", "SD", "--force")
    assert code == 0 and meta(out_path)["hybridpd.conv_layout"] == "DS"


def test_check_exit_codes_and_first_mismatch(capsys: pytest.CaptureFixture[str], tmp_path: Path, state: Path,
                                             model_dir: Path) -> None:
    ds = tmp_path / "ds.safetensors"
    assert cli(capsys, str(state), str(ds), "--to", "DS", "--model", str(model_dir))[0] == 0
    code, out, _ = cli(capsys, "--check", str(state), str(ds), "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    t = load(ds)
    t["model.layers.0.mixer.conv_state"].view(torch.int16)[2, 100, 1] ^= 0x10
    save(ds, t, meta(ds))
    code, out, err = cli(capsys, "--check", str(state), str(ds), "--json")
    d = json.loads(out)
    assert code == 1 and d["ok"] is False
    assert d["first_mismatch"]["tensor"] == "model.layers.0.mixer.conv_state"
    assert d["first_mismatch"]["index"] == [2, 100, 1]
    assert "Error:" in err and "[2, 100, 1]" in err
    code, out, _ = cli(capsys, "--check", str(state), str(ds), "--fmt", "plain")
    assert code == 1 and "FIRST MISMATCH" in out


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "Examples:" in out and "hybridpd convert" in out and "--tp-split" in out


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "hybridpd_cli.main", "convert", *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_sigkill_mid_write_leaves_input_intact_and_no_output(tmp_path: Path) -> None:
    src = save(tmp_path / "big.safetensors",
               {f"model.layers.{i}.mixer.conv_state": rand((64, 3, 2048), torch.bfloat16, i) for i in range(24)})
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    final = tmp_path / "out.safetensors"
    # HYBRIDPD_TEST_SLOW_WRITE: the writer sleeps after each tensor, so the kill lands mid-file.
    proc = _run([str(src), str(final), "--to", "DS", "--from", "SD"], {"HYBRIDPD_TEST_SLOW_WRITE": "0.25"})
    tmp_file = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        tmps = [p for p in tmp_path.iterdir() if p.name.startswith(".hybridpd-out.safetensors.")]
        if tmps and tmps[0].stat().st_size > 3 * 64 * 3 * 2048 * 2:  # a few tensors written
            tmp_file = tmps[0]
            break
        time.sleep(0.02)
    assert tmp_file is not None, proc.communicate()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    assert not final.exists()
    assert tmp_file.exists() and tmp_file.name.endswith(".tmp")  # hidden, never the final name
    # the next run completes and sweeps the dead process's temporary
    again = _run([str(src), str(final), "--to", "DS", "--from", "SD"])
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert final.exists() and not tmp_file.exists()
    assert load(final)["model.layers.5.mixer.conv_state"].shape == (64, 2048, 3)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_mid_write_removes_the_temporary(tmp_path: Path, sig: signal.Signals) -> None:
    src = save(tmp_path / "big.safetensors",
               {f"model.layers.{i}.mixer.conv_state": rand((64, 3, 2048), torch.bfloat16, i) for i in range(24)})
    final = tmp_path / "out.safetensors"
    proc = _run([str(src), str(final), "--to", "DS", "--from", "SD"], {"HYBRIDPD_TEST_SLOW_WRITE": "0.25"})
    deadline = time.monotonic() + 60
    seen = False
    while time.monotonic() < deadline and proc.poll() is None and not seen:
        seen = any(p.name.startswith(".hybridpd-out.safetensors.") for p in tmp_path.iterdir())
        time.sleep(0.02)
    assert seen, proc.communicate()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode == 128 + sig
    assert not final.exists()
    assert not list(tmp_path.glob(".hybridpd-*"))


def test_metadata_layout_contradicting_the_shape_is_refused(tmp_path: Path) -> None:
    # a (3, 6144) conv state is SD-shaped (state_len 3, 6144 channels); metadata claiming DS would transpose it wrongly
    src = tmp_path / "lying.safetensors"
    from safetensors.torch import save_file

    save_file({"model.layers.0.mixer.conv_state": rand((3, 6144), torch.bfloat16, 0)}, str(src),
              metadata={"hybridpd.conv_layout": "DS"})
    proc = _run([str(src), str(tmp_path / "o.safetensors"), "--to", "SD"])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert b"--from" in err and b"state_len 6144 > dim 3" in err and b"Traceback" not in err
    assert not (tmp_path / "o.safetensors").exists()
