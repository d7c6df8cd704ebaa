"""`serve --dry-run` as data: --json pinned to what the reference says a P/D pair needs, and --fmt tables.

Facts from shared/reference/vllm-hybrid-pd.md §5 ("kv-transfer-config", "Env and flags used for hybrid") and the
Nano config (max_position_embeddings 262144); none is read back from hybridpd.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd.core.families import model_spec
from hybridpd.core.models import resolve
from hybridpd.core.plan import max_model_len
from hybridpd.core.settings import EngineSettings

NANO_FP8_2_2 = ["serve", "nano-fp8", "--ptp", "2", "--dtp", "2", "--vllm-command", "vllm", "--platform", "cuda",
                "--dry-run"]


def serve(*args: str) -> Any:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_json_pair_has_what_the_reference_requires() -> None:
    d = json.loads(serve(*NANO_FP8_2_2, "--vllm-version", "0.20", "--json").stdout)
    servers = [p for p in d["processes"] if p["role"] in ("prefill", "decode")]
    assert [(p["name"], p["role"]) for p in d["processes"]] == [
        ("prefill-0", "prefill"), ("decode-0", "decode"), ("proxy", "proxy")]
    for p in servers:
        argv = p["argv"]
        assert argv[:3] == ["vllm", "serve", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8"]
        kvt = json.loads(flag(argv, "--kv-transfer-config"))
        assert kvt["kv_connector"] == "NixlConnector" and kvt["kv_role"] == "kv_both"  # §5: "use kv_both" (0.20)
        assert "--no-disable-hybrid-kv-cache-manager" in argv  # §5: required for hybrids
        assert flag(argv, "--tensor-parallel-size") == "2"
        assert flag(argv, "--max-model-len") == "262144"  # the model's max_position_embeddings
        assert p["env"]["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"  # §5: required on both P and D
        assert int(flag(argv, "--port")) == p["port"]
        assert p["health_url"] == f"http://127.0.0.1:{p['port']}/health"
        assert int(p["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == p["side_channel_port"]
    # §5: the side-channel port must be unique per instance on a host; no HTTP port may collide with any of them
    side = [p["side_channel_port"] for p in servers]
    http = [p["port"] for p in d["processes"]]
    assert len(set(side)) == len(side) and len(set(http)) == len(http) and not set(side) & set(http)
    proxy = d["processes"][-1]["argv"]
    assert [proxy[i + 1] for i, a in enumerate(proxy) if a == "--prefill"] == [servers[0]["url"]]
    assert [proxy[i + 1] for i, a in enumerate(proxy) if a == "--decode"] == [servers[1]["url"]]
    assert d["ok"] is True and isinstance(d["notes"], list)
    assert all(set(f) == {"severity", "code", "message", "fix"} for f in d["findings"])


def test_json_release_without_kv_both_gets_producer_and_consumer() -> None:
    d = json.loads(serve(*NANO_FP8_2_2, "--vllm-version", "0.32", "--json").stdout)
    roles = {p["role"]: json.loads(flag(p["argv"], "--kv-transfer-config"))["kv_role"] for p in d["processes"]
             if p["role"] != "proxy"}
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    assert {p["role"]: p["kv_role"] for p in d["processes"] if p["role"] != "proxy"} == roles


def test_fmt_json_is_the_json() -> None:
    assert json.loads(serve(*NANO_FP8_2_2, "--fmt", "json").stdout) == json.loads(
        serve(*NANO_FP8_2_2, "--json").stdout)


@pytest.mark.parametrize("fmt", ["markdown", "plain"])
def test_fmt_gives_tables_not_a_script(fmt: str) -> None:
    out = serve(*NANO_FP8_2_2, "--vllm-version", "0.20", "--fmt", fmt).stdout
    assert "#!/bin/sh" not in out and "setsid" not in out
    assert out.splitlines()[0].startswith("hybridpd serve nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8 --role all: "
                                          "3 process(es)")
    for name, port in (("prefill-0", 8100), ("decode-0", 8200), ("proxy", 8000)):
        assert name in out and f"http://127.0.0.1:{port}/health" in out
    assert "VLLM_SSM_CONV_STATE_LAYOUT=DS" in out and "NixlConnector" in out
    assert " 5600 " in out and "5,600" not in out  # ports are ids: never thousands-separated
    if fmt == "markdown":
        assert "### processes" in out and "| process " in out


def test_default_dry_run_is_the_script() -> None:
    out = serve(*NANO_FP8_2_2).stdout.splitlines()
    assert out[0] == "#!/bin/sh" and sum(line.endswith(" &") for line in out) == 3


def test_max_model_len_one_rule() -> None:
    spec = model_spec(resolve("nano-fp8"))  # config: max_position_embeddings 262144
    assert max_model_len(spec, EngineSettings()) == 262144
    assert max_model_len(spec, EngineSettings(), cap=4096) == 4096
    assert max_model_len(spec, EngineSettings(max_model_len=8192), cap=4096) == 8192  # the flag wins over a cap
    assert max_model_len(spec, EngineSettings(max_model_len=300000)) == 300000


def test_cpu_launch_caps_max_model_len_with_a_note() -> None:
    """serve's own cpu default (not a vLLM rule): at most 4096 tokens unless --max-model-len says otherwise."""
    base = ["serve", "qwen3-8b", "--platform", "cpu", "--vllm-command", "vllm", "--dry-run", "--json"]
    d = json.loads(serve(*base).stdout)  # Qwen3-8B config: max_position_embeddings 40960
    assert {flag(p["argv"], "--max-model-len") for p in d["processes"] if p["role"] != "proxy"} == {"4096"}
    assert sum("--max-model-len 4096 on cpu (model allows 40960" in n for n in d["notes"]) == 2
    d = json.loads(serve(*base, "--max-model-len", "8192").stdout)
    assert {flag(p["argv"], "--max-model-len") for p in d["processes"] if p["role"] != "proxy"} == {"8192"}
    assert not any("on cpu (model allows" in n for n in d["notes"])
