"""Shell completion: checked-in scripts are current, and MODEL completes to bundled ids and aliases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.shell_completion import ShellComplete
from click.testing import CliRunner
from hybridpd_cli.completions import COMPLETE_VAR, PROG_NAME, SHELLS, completion_script
from hybridpd_cli.main import cli

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("shell", SHELLS)
def test_checked_in_script_is_current(shell: str) -> None:
    path = REPO / "completions" / f"hybridpd.{shell}"
    regen = f"hybridpd completions {shell} > completions/hybridpd.{shell}"
    assert path.exists(), f"{path} is missing; generate it with `{regen}`"
    assert path.read_text() == completion_script(shell), (
        f"completions/hybridpd.{shell} is stale; regenerate it with `{regen}`")


@pytest.mark.parametrize("shell", SHELLS)
def test_command_prints_script(shell: str) -> None:
    res = CliRunner().invoke(cli, ["completions", shell])
    assert res.exit_code == 0, res.output
    assert res.output == completion_script(shell)
    assert COMPLETE_VAR in res.output


def test_unknown_shell_is_usage_error() -> None:
    res = CliRunner().invoke(cli, ["completions", "powershell"])
    assert res.exit_code == 2


def _complete(args: list[str], incomplete: str) -> list[str]:
    comp = ShellComplete(cli, {}, PROG_NAME, COMPLETE_VAR)
    return [c.value for c in comp.get_completions(args, incomplete)]


def test_model_completion_offers_aliases_via_api() -> None:
    got = _complete(["plan"], "nan")
    assert {"nano", "nano-fp8", "nano-bf16", "nano-nvfp4"} <= set(got)
    assert all(v.startswith("nan") for v in got)


def test_doctor_model_option_completes() -> None:
    assert "super-fp8" in _complete(["doctor", "--model"], "super-")


def test_subcommand_and_shell_completion() -> None:
    assert _complete([], "mod") == ["models"]
    assert _complete(["completions"], "") == list(SHELLS)


def test_bash_completion_in_subprocess() -> None:
    """What the bash script does: COMP_WORDS/COMP_CWORD + _HYBRIDPD_COMPLETE=bash_complete."""
    env = dict(os.environ, COMP_WORDS="hybridpd plan nan", COMP_CWORD="2", **{COMPLETE_VAR: "bash_complete"})
    cp = subprocess.run([sys.executable, "-m", "hybridpd_cli.main"], env=env, capture_output=True, text=True,
                        timeout=60, check=False)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert "plain,nano" in lines and "plain,nano-fp8" in lines, cp.stdout
    assert all(line.startswith("plain,nan") for line in lines)


def _items(args: list[str], incomplete: str) -> list[tuple[str, str]]:
    comp = ShellComplete(cli, {}, PROG_NAME, COMPLETE_VAR)
    return [(c.type, c.value) for c in comp.get_completions(args, incomplete)]


def test_model_path_falls_back_to_file_completion() -> None:
    """Item 6: a MODEL that is a path (no bundled id matches) gets the shell's file completion."""
    for args in (["plan"], ["verify"], ["serve"]):
        assert _items(args, "tests/da") == [("file", "tests/da")], args
        assert _items(args, "./my-model") == [("file", "./my-model")], args


def test_model_ids_and_file_names_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix that matches both an alias and a local directory offers both."""
    (tmp_path / "nano-local").mkdir()
    (tmp_path / "nano.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    got = _items(["plan"], "nano")
    assert ("plain", "nano-fp8") in got
    assert ("plain", "nano-local/") in got and ("plain", "nano.json") in got


def test_convert_paths_complete_as_files() -> None:
    assert _items(["convert"], "conv") == [("file", "conv")]
    assert _items(["convert", "in.safetensors"], "ou") == [("file", "ou")]


def test_vllm_version_and_link_complete() -> None:
    versions = [v for _, v in _items(["plan", "--vllm-version"], "0.3")]
    assert "0.32" in versions and "0.33" in versions
    links = [v for _, v in _items(["plan", "--link"], "")]
    assert "cuda_ipc-h200" in links  # an entry of the bundled hybridpd/data/calibration.json


def test_bash_protocol_says_file_for_paths() -> None:
    env = dict(os.environ, COMP_WORDS="hybridpd plan ./models/m", COMP_CWORD="2", **{COMPLETE_VAR: "bash_complete"})
    cp = subprocess.run([sys.executable, "-m", "hybridpd_cli.main"], env=env, capture_output=True, text=True,
                        timeout=60, check=False)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.splitlines() == ["file,./models/m"]
