"""Failures the operator causes or meets get one line and an exit code, never a traceback (issue #16 item 7)."""

from __future__ import annotations

import socket
import subprocess
import sys

import click
import pytest
from hybridpd_cli._errors import run_with_errors


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
