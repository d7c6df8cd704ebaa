"""Hostile flags and environment (issue 29): each case failed on the code before its fix (traceback, exit 0,
or a silently weaker setting) and is a one-line usage error (exit 2) after."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cli.main import main

_PROXY = ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) in-process, as the console script runs it: (exit code, stdout, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    code, out, err = _run(argv, capsys)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture
def no_serve(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The proxy's server replaced: records the config instead of listening."""
    import hybridpd.launch.proxy.server as server

    started: list[Any] = []
    monkeypatch.setattr(server, "run_proxy", started.append)
    return started


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
def test_proxy_empty_or_blank_api_key_is_a_usage_error(key: str, no_serve: list[Any],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # before: "" turned authentication off silently (the server started with api_key None)
    monkeypatch.setenv("HYBRIDPD_PROXY_API_KEY", key)
    _usage_error(_PROXY, capsys, "HYBRIDPD_PROXY_API_KEY", "--no-auth")
    assert no_serve == []


def test_proxy_no_auth_is_explicit_and_logged(no_serve: list[Any], caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HYBRIDPD_PROXY_API_KEY", "")
    with caplog.at_level(logging.WARNING, logger="hybridpd.launch.proxy"):
        code, _, err = _run([*_PROXY, "--no-auth"], capsys)
    assert code == 0, err
    assert len(no_serve) == 1 and no_serve[0].api_key is None
    assert "authentication is off" in caplog.text


def test_proxy_no_auth_with_a_key_is_a_usage_error(no_serve: list[Any], monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HYBRIDPD_PROXY_API_KEY", "secret")
    _usage_error([*_PROXY, "--no-auth"], capsys, "--no-auth")
    assert no_serve == []
