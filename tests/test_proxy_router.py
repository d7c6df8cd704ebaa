"""`serve --router vllm-router`: the argv handed to vllm-router carries the same P and D URLs as hybridpd's proxy
would get (pure: no process starts here; tests/test_router_live.py runs it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.launch.commands import LaunchOptions, build_launch_plan
from hybridpd.launch.entry import entry_for
from hybridpd.launch.proxy.router import find_vllm_router, vllm_router_argv

CUDA_ENTRY = entry_for("/venv/bin/python", "vllm", "0.32.0")
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def plan(**opts: object):  # type: ignore[no-untyped-def]
    return build_launch_plan(MODEL, prefill=EngineSettings(tp=1), decode=EngineSettings(tp=1),
                             options=LaunchOptions(**opts),  # type: ignore[arg-type]
                             entry=CUDA_ENTRY, vllm_version="0.32", platform="cuda")


def test_vllm_router_gets_the_same_urls_as_the_hybridpd_proxy() -> None:
    ours = plan(num_prefill=2, num_decode=2)
    theirs = plan(num_prefill=2, num_decode=2, router="vllm-router", router_executable="/opt/bin/vllm-router")
    p_urls = [p.url for p in ours.by_role("prefill")]
    d_urls = [p.url for p in ours.by_role("decode")]
    assert p_urls == [p.url for p in theirs.by_role("prefill")] and len(p_urls) == 2
    assert ours.proxy is not None and theirs.proxy is not None
    a = list(theirs.proxy.argv)
    assert a[0] == "/opt/bin/vllm-router" and "--vllm-pd-disaggregation" in a
    assert [a[i + 1] for i, x in enumerate(a) if x == "--prefill"] == p_urls
    assert [a[i + 1] for i, x in enumerate(a) if x == "--decode"] == d_urls
    assert a[a.index("--port") + 1] == "8000" and a[a.index("--host") + 1] == "127.0.0.1"
    assert a[a.index("--policy") + 1] == "round_robin"
    assert theirs.proxy.health_url == ours.proxy.health_url == "http://127.0.0.1:8000/health"
    # the P/D servers themselves do not depend on the router
    assert [p.argv for p in ours.servers] == [p.argv for p in theirs.servers]


def test_router_policy_mapping_and_refusals() -> None:
    a = vllm_router_argv("vr", host="h", port=1, prefill_urls=["http://p"], decode_urls=["http://d"],
                         policy="least_outstanding")
    assert a[a.index("--policy") + 1] == "power_of_two"
    with pytest.raises(UsageError):
        vllm_router_argv("vr", host="h", port=1, prefill_urls=[], decode_urls=["http://d"])
    with pytest.raises(UsageError, match="router"):
        plan(router="nginx")
    with pytest.raises(UsageError, match="do not apply to vllm-router"):  # never dropped silently
        plan(router="vllm-router", router_executable="/x/vllm-router", proxy_args=("--prefill-timeout", "600"))


def test_find_vllm_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDPD_VLLM_ROUTER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UsageError) as info:
        find_vllm_router()
    assert "pip install vllm-router" in str(info.value.fix)
    exe = tmp_path / "venv" / "bin" / "vllm-router"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert find_vllm_router(vllm_python=str(exe.parent / "python")) == str(exe)
    monkeypatch.setenv("HYBRIDPD_VLLM_ROUTER", str(exe))
    assert find_vllm_router() == str(exe)
    with pytest.raises(UsageError):
        find_vllm_router(str(tmp_path / "nope"))
    assert os.access(exe, os.X_OK)
