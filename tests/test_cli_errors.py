"""Failures the operator causes or meets get one line and an exit code, never a traceback (issue #16 item 7)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import click
import pytest
from hybridpd_cli._errors import run_with_errors
from pty_support import read_pty


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_verify_against_no_server_is_one_line_exit_1() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "verify", "nano", "--decode", url, "--prefill", url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"cannot reach {url}" in r.stderr


@pytest.mark.parametrize("module,hint", [("torch", "hybridpd[convert]"), ("numpy", "hybridpd[rehearse]"),
                                         ("nixl", "nixl-cu13")])
def test_missing_optional_dependency_names_the_install(module: str, hint: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    @click.command()
    def needs() -> None:
        raise ModuleNotFoundError(f"No module named '{module}'", name=module)

    with pytest.raises(SystemExit) as e:
        run_with_errors(needs, [])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"needs {module}" in err and hint in err and len(err.strip().splitlines()) == 1


def test_an_unknown_missing_module_is_still_a_bug() -> None:
    @click.command()
    def broken() -> None:
        raise ModuleNotFoundError("No module named 'hybridpd.nope'", name="hybridpd.nope")

    with pytest.raises(ModuleNotFoundError):
        run_with_errors(broken, [])


_LONG_ID = "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4-with-a-much-longer-local-suffix-for-this-test"


def _raise(msg: str) -> click.Command:
    from hybridpd.errors import ExternalToolError

    @click.command()
    def boom() -> None:
        raise ExternalToolError(msg, fix="check the deployment")

    return boom


@pytest.mark.parametrize("msg, pieces", [
    # at 80 columns a terminal's hard wrap put the line break inside 2096 ("20|96") and inside "HTTP 500"
    ("prefill and decode disagree on the attention block size: P reports 4176, D reports 2096 tokens per block",
     ["2096", "4176"]),
    ("the proxy at http://127.0.0.1:8000/v1/completions answered HTTP 500 while sending the probe of 54 tokens",
     ["HTTP 500", "54 tokens", "http://127.0.0.1:8000/v1/completions"]),
    (f"the model {_LONG_ID} is not served by D (it serves meta-llama/Llama-3.2-1B-Instruct instead)",
     [_LONG_ID, "meta-llama/Llama-3.2-1B-Instruct"]),
])
def test_errors_wrap_at_80_columns_without_splitting_numbers_or_ids(
        msg: str, pieces: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hybridpd_cli import _output

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(_output, "stderr_is_terminal", lambda: True)  # capsys's stderr is no terminal
    with pytest.raises(SystemExit) as ex:
        run_with_errors(_raise(msg), [])
    assert ex.value.code == 1
    lines = capsys.readouterr().err.rstrip("\n").splitlines()
    assert len(lines) > 1 and lines[0].startswith("Error: ")
    assert all(len(ln) <= 80 or ln.split() == [_LONG_ID] for ln in lines), lines  # an id wider than 80: alone
    for piece in pieces:
        assert any(piece in ln for ln in lines), (piece, lines)
    assert " ".join(lines).split() == f"Error: {msg} (fix: check the deployment)".split()  # nothing lost


def test_errors_stay_one_line_when_piped(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """stderr no terminal (a log, a pipe), even with COLUMNS set: one line, as before, so grep finds it whole."""
    monkeypatch.setenv("COLUMNS", "80")
    msg = "prefill and decode disagree on the attention block size: P reports 4176, D reports 2096 tokens per block"
    with pytest.raises(SystemExit):
        run_with_errors(_raise(msg), [])
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("cols", [60, 100])
def test_error_on_a_terminal_wraps_to_its_width(cols: int) -> None:
    """End to end on a pty of ``cols`` columns (no COLUMNS): the width is the terminal's, the URL stays whole."""
    import fcntl
    import pty
    import struct
    import termios

    url = f"http://127.0.0.1:{_closed_port()}"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.Popen([sys.executable, "-m", "hybridpd_cli.main", "verify", "nano", "--decode", url, "--prefill",
                          url], stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = read_pty(master)
    assert p.wait(timeout=60) == 1
    lines = out.decode().replace("\r", "").strip().splitlines()
    assert len(lines) > 1 and all(len(ln) <= cols for ln in lines), lines
    assert any(f"{url}/metrics:" in ln for ln in lines) and "Traceback" not in "".join(lines)
