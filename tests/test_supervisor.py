"""The supervisor with fake children: /health wait, log prefixes, fail fast, SIGTERM leaves no process behind."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import alive, free_port_run, free_ports

from hybridpd.launch import LaunchOptions, LaunchPlan, build_launch_plan, command_entry
from hybridpd.settings import EngineSettings
from hybridpd.supervisor import Supervisor

FAKE = r'''
import os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
host, port = opt("--host", "127.0.0.1"), int(opt("--port"))
print(f"fake start port={port} side={os.environ.get('VLLM_NIXL_SIDE_CHANNEL_PORT')} "
      f"bind={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} argv={args}", flush=True)
if "--fake-exit" in args:
    print("fatal: boom (fake engine died)", flush=True)
    sys.exit(3)
if "--fake-grandchild" in args:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild {g.pid}", flush=True)
time.sleep(float(opt("--fake-delay", "0")))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
srv = ThreadingHTTPServer((host, port), H)
print("ready", flush=True)
srv.serve_forever()
'''


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    p = tmp_path / "fake_vllm.py"
    p.write_text(FAKE)
    return p


def port_opts() -> dict[str, int]:
    pp, dp, xp = free_ports(3)
    return dict(prefill_port=pp, decode_port=dp, proxy_port=xp, side_channel_port=free_port_run(2))


def make_plan(model: Path, fake: Path, *, role: str = "all", extra: tuple[str, ...] = (),
              prefill_args: tuple[str, ...] = ()) -> LaunchPlan:
    opts = LaunchOptions(role=role, extra_args=extra, prefill_args=prefill_args,
                         proxy_command=(sys.executable, str(fake)), devices=(0, 1), **port_opts())
    return build_launch_plan(str(model), prefill=EngineSettings(), decode=EngineSettings(), options=opts,
                             entry=command_entry([sys.executable, str(fake)]), vllm_version="0.32",
                             platform="cpu")


def test_supervisor_ready_logs_and_stop(tiny_models: dict[str, Path], fake: Path) -> None:
    lp = make_plan(tiny_models["llama"], fake, extra=("--fake-grandchild",))
    out = io.StringIO()
    seen: dict[str, Any] = {}

    def on_ready(sup: Supervisor) -> None:
        seen["pids"] = [c.pid for c in sup.children]
        seen["names"] = [c.spec.name for c in sup.children]
        sup.request_stop("test done")

    code = Supervisor(lp, out=out, grace_s=5, poll_s=0.1, on_ready=on_ready).run(
        install_signals=False)
    assert code == 0
    assert seen["names"] == ["prefill-0", "decode-0", "proxy"]
    text = out.getvalue()
    side = lp.servers[0].side_channel_port
    assert f"[prefill-0] fake start port={lp.servers[0].port} side={side} bind=0" in text
    assert f"[decode-0] fake start port={lp.servers[1].port} side={side + 1} bind=1" in text
    assert "[proxy] fake start" in text and "--prefill" in text
    grand = [int(g) for g in re.findall(r"grandchild (\d+)", text)]
    assert len(grand) == 2  # pass-through args reach P and D, not the proxy
    time.sleep(0.2)
    assert not [p for p in seen["pids"] + grand if alive(p)]


def test_fail_fast_with_last_lines(tiny_models: dict[str, Path], fake: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    lp = make_plan(tiny_models["llama"], fake, extra=("--fake-grandchild", "--fake-delay", "30"),
                   prefill_args=("--fake-exit",))
    out = io.StringIO()
    t0 = time.monotonic()
    code = Supervisor(lp, out=out, grace_s=5, poll_s=0.1).run(install_signals=False)
    assert code == 1
    assert time.monotonic() - t0 < 15  # did not wait for decode's 30 s start-up
    err = capsys.readouterr().err
    assert "prefill-0 exited with code 3" in err
    assert "[prefill-0] fatal: boom (fake engine died)" in err
    grand = [int(g) for g in re.findall(r"grandchild (\d+)", out.getvalue())]
    time.sleep(0.2)
    assert not [p for p in grand if alive(p)]


def test_health_timeout(tiny_models: dict[str, Path], fake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lp = make_plan(tiny_models["llama"], fake, role="decode", extra=("--fake-delay", "30"))
    code = Supervisor(lp, out=io.StringIO(), grace_s=2, poll_s=0.1,
                      health_timeout_s=1.5).run(install_signals=False)
    assert code == 1 and "decode-0 not healthy after 2 s" in capsys.readouterr().err


def _cli(model: Path, fake: Path, ports: dict[str, int], *extra: str) -> list[str]:
    return [sys.executable, "-m", "hybridpd_cli.main", "serve", str(model), "--platform", "cpu",
            "--vllm-version", "0.32", "--cpus", "0-1", "--vllm-command", f"{sys.executable} {fake}",
            "--proxy-command", f"{sys.executable} {fake}", "--grace", "5",
            *(x for k, v in ports.items() for x in (f"--{k.replace('_', '-')}", str(v))), *extra]


def test_sigterm_leaves_no_process(tiny_models: dict[str, Path], fake: Path, tmp_path: Path) -> None:
    ports = port_opts()
    log = tmp_path / "out.log"
    errlog = tmp_path / "err.log"
    with open(log, "w") as fo, open(errlog, "w") as fe:
        proc = subprocess.Popen(_cli(tiny_models["llama"], fake, ports, "--", "--fake-grandchild"), stdout=fo,
                                stderr=fe)
        try:
            deadline = time.monotonic() + 60
            while "all healthy" not in errlog.read_text() or len(re.findall("grandchild", log.read_text())) < 2:
                assert proc.poll() is None, errlog.read_text()
                assert time.monotonic() < deadline, errlog.read_text()
                time.sleep(0.1)
            children = [int(p) for p in re.findall(r"pid (\d+)", errlog.read_text())]
            grand = [int(g) for g in re.findall(r"grandchild (\d+)", log.read_text())]
            assert len(children) == 3 and len(grand) == 2
            assert all(alive(p) for p in children + grand)
            assert all(os.getpgid(p) == p for p in children)  # own process group each
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    time.sleep(0.3)
    assert not [p for p in children + grand if alive(p)], "orphans left behind"
    assert "SIGTERM: stopping 3 process group(s)" in errlog.read_text()


def test_cli_port_conflict_starts_nothing(tiny_models: dict[str, Path], fake: Path) -> None:
    ports = port_opts()
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports["side_channel_port"] + 1))
        s.listen()
        r = subprocess.run(_cli(tiny_models["llama"], fake, ports), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"127.0.0.1:{ports['side_channel_port'] + 1} (decode-0 NIXL side channel)" in r.stderr
    assert "started" not in r.stderr


def test_cli_dry_run_json_with_fake(tiny_models: dict[str, Path], fake: Path) -> None:
    r = subprocess.run(_cli(tiny_models["llama"], fake, port_opts(), "--dry-run", "--json"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [p["role"] for p in json.loads(r.stdout)["processes"]] == ["prefill", "decode", "proxy"]
