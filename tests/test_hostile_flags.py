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
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert "Traceback" not in err and len(errors) == 1, err  # click may add its Usage: lines above
    for w in words:
        assert w in errors[0], (w, err)
    return errors[0]


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


_SERVE = ["serve", "nano-fp8", "--dry-run"]


@pytest.mark.parametrize("value", ["nan", "inf", "-nan"])
@pytest.mark.parametrize("argv, flag", [
    (_SERVE, "--liveness-timeout"), (_SERVE, "--health-interval"), (_SERVE, "--grace"),
    (_SERVE, "--health-timeout"), (_SERVE, "--restart-backoff"), (_SERVE, "--decode-timeout"),
    (_SERVE, "--kv-lease"), (_PROXY, "--health-interval"), (_PROXY, "--prefill-timeout"),
    (["verify", "nano-fp8", "--decode", "http://127.0.0.1:1", "--passive"], "--window"),
])
def test_nan_and_inf_float_flags_are_usage_errors(argv: list[str], flag: str, value: str, no_serve: list[Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # before: nan passed every click.FloatRange check (nan < 1 is False) and switched hang detection off;
    # inf passed the ranges with no upper bound
    _usage_error([*argv, flag, value], capsys, flag)
    assert no_serve == []


@pytest.mark.parametrize("pair", ["$(touch pwned)=1", "1ABC=x", "A-B=1", "A B=1", "=1", "`id`=1", "A\nB=1"])
def test_serve_env_names_must_be_shell_names(pair: str, capsys: pytest.CaptureFixture[str]) -> None:
    # before: the key went unquoted into the --dry-run script: `$(touch pwned)=1 setsid vllm ...` runs touch
    _usage_error([*_SERVE, "--env", pair], capsys, "--env")


def test_dry_run_script_quotes_every_env_token() -> None:
    import shlex

    from hybridpd.launch.commands import ProcessSpec

    key, value = "$(touch pwned)", "a b; `id` $(x) 'q'"
    p = ProcessSpec(name="prefill-0", role="prefill", argv=("vllm", "serve", "m;rm"), env=((key, value),),
                    host="127.0.0.1", port=8100, health_url="http://127.0.0.1:8100/health")
    line = p.shell()
    assert "$(touch pwned)=" not in line  # the key is quoted, so the shell cannot expand it
    # the shell sees exactly the tokens given, nothing expanded or split (independent parser: shlex.split)
    assert shlex.split(line) == [f"{key}={value}", "vllm", "serve", "m;rm"]


def test_dry_run_serve_script_quotes_a_valid_env(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    code, out, err = _run([*_SERVE, "--env", "MY_VAR=$(touch pwned) `id`"], capsys)
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if "MY_VAR=" in ln]
    assert lines and all("MY_VAR=$(touch pwned) `id`" in shlex.split(ln) for ln in lines), out


@pytest.mark.parametrize("flag", ["--gpus", "--cpus"])
@pytest.mark.parametrize("devices", ["0-99999999", "99999999", "0-4096", "0-4095,4095", "0-" + "9" * 40])
def test_serve_device_lists_are_bounded(flag: str, devices: str, capsys: pytest.CaptureFixture[str]) -> None:
    # before: 0-99999999 built a list of 10^8 ints (MemoryError on small hosts, a traceback), "9"*40 ran on
    _usage_error([*_SERVE, flag, devices], capsys, "--gpus/--cpus")


def test_parse_devices_keeps_real_lists() -> None:
    from hybridpd.launch.commands import parse_devices

    assert parse_devices("0-3") == (0, 1, 2, 3)
    assert parse_devices("0,1,4-5") == (0, 1, 4, 5)
    assert parse_devices("4095") == (4095,)


@pytest.mark.parametrize("flag", ["--vllm-command", "--proxy-command"])
@pytest.mark.parametrize("command", ["python 'vllm_cli.py", 'python "x', "python x\\", "   "])
def test_serve_command_strings_that_do_not_split_are_usage_errors(flag: str, command: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # before: shlex.split's ValueError ("No closing quotation") escaped as a traceback
    _usage_error([*_SERVE, flag, command], capsys, flag)


@pytest.mark.parametrize("model", ["org/ünïcode-💥", "org/na me", "org/-x", "org/" + "x" * 97, "org/a..b"])
@pytest.mark.parametrize("network", [[], ["--allow-network"]])
def test_a_model_that_is_no_path_and_no_hub_id_is_one_line(model: str, network: list[str],
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # before: huggingface_hub's HFValidationError escaped as a traceback (exit 1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing leaves the machine even if the check were skipped
    err = _usage_error(["plan", model, *network], capsys, "MODEL", "Hugging Face id")
    assert len(err) < 400


@pytest.mark.parametrize("role", ["all", "proxy"])
def test_serve_refuses_a_blank_proxy_key_before_starting_anything(role: str, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # before: serve started P, D and a proxy that inherited the empty key, so clients needed no key
    import hybridpd.launch.serve as modes

    launched: list[Any] = []
    monkeypatch.setattr(modes, "launch", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setenv("HYBRIDPD_PROXY_API_KEY", "")
    _usage_error(["serve", "nano-fp8", "--role", role], capsys, "HYBRIDPD_PROXY_API_KEY", "--no-auth")
    assert launched == []
    # explicit: the proxy gets --no-auth and logs it
    code, _, err = _run(["serve", "nano-fp8", "--role", role, "--proxy-arg=--no-auth"], capsys)
    assert code == 0 and len(launched) == 1, err
