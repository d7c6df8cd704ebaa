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

from hybridpd.core.settings import EngineSettings
from hybridpd.launch.commands import LaunchOptions, LaunchPlan, build_launch_plan
from hybridpd.launch.entry import command_entry
from hybridpd.launch.supervisor import Supervisor

FAKE = r'''
import os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
host, port = opt("--host", "127.0.0.1"), int(opt("--port"))
print(f"fake start port={port} side={os.environ.get('VLLM_NIXL_SIDE_CHANNEL_PORT')} "
      f"bind={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} argv={args}", flush=True)
if "--prefill" in args and os.environ.get("FAKE_PROXY_SAY"):  # the fake as the proxy
    print(os.environ["FAKE_PROXY_SAY"], flush=True)
if "--fake-exit" in args:
    print("fatal: boom (fake engine died)", flush=True)
    sys.exit(3)
if "--fake-grandchild" in args:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild {g.pid}", flush=True)
if "--fake-setsid-grandchild" in args:  # double fork + setsid: leaves both the process group and the session
    code = ("import os, sys, time\nif os.fork(): os._exit(0)\nos.setsid()\n"
            "print('escaped', os.getpid(), os.getpgid(0), flush=True)\ntime.sleep(600)")
    subprocess.run([sys.executable, "-c", code])
if "--fake-shm" in args:  # a segment held mapped, never unlinked (as vLLM's psm_* when SIGKILLed)
    from multiprocessing import shared_memory, resource_tracker
    seg = shared_memory.SharedMemory(create=True, size=1 << 16)
    resource_tracker.unregister(seg._name, "shared_memory")
    print(f"shm /dev/shm/{seg.name}", flush=True)
import signal
if "--fake-ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def _term(s, f):
        print(f"got SIGTERM at {time.time():.6f}", flush=True)
        time.sleep(float(opt("--fake-term-delay", "0")))
        os._exit(0)
    signal.signal(signal.SIGTERM, _term)
once = opt("--fake-die-once")
if once and not os.path.exists(once):
    open(once, "w").close()
    time.sleep(1)
    print("fatal: dying once", flush=True)
    sys.exit(4)
if "--fake-die-always" in args:
    print("fatal: dying always", flush=True)
    sys.exit(5)
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
    while True:  # the HTTP ports and the side-channel run are picked separately: they must not overlap
        pp, dp, xp = free_ports(3)
        sp = free_port_run(2)
        if not {pp, dp, xp} & {sp, sp + 1}:
            return dict(prefill_port=pp, decode_port=dp, proxy_port=xp, side_channel_port=sp)


def make_plan(model: Path, fake: Path, *, role: str = "all", extra: tuple[str, ...] = (),
              prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()) -> LaunchPlan:
    opts = LaunchOptions(role=role, extra_args=extra, prefill_args=prefill_args, decode_args=decode_args,
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
            "--deployment-file", str(model.parent / "deployment.json"),
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
    assert "SIGTERM: stopping 3 process tree(s)" in errlog.read_text()
    rec = json.loads((tiny_models["llama"].parent / "deployment.json").read_text())
    assert rec["state"] == "stopped" and rec["platform"] == "cpu"
    assert {n: p["port"] for n, p in rec["processes"].items()} == {
        "prefill-0": ports["prefill_port"], "decode-0": ports["decode_port"], "proxy": ports["proxy_port"]}
    assert rec["urls"]["proxy"] == f"http://127.0.0.1:{ports['proxy_port']}"


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


# --- nothing outlives the supervisor; drain order; restarts; liveness ------------------------------------------


def _start_cli(model: Path, fake: Path, tmp_path: Path, *extra: str, vllm_args: tuple[str, ...] = (),
               n_lines: dict[str, int] | None = None) -> tuple[subprocess.Popen[bytes], Path, Path, dict[str, int]]:
    ports = port_opts()
    log, errlog = tmp_path / "out.log", tmp_path / "err.log"
    with open(log, "w") as fo, open(errlog, "w") as fe:
        proc = subprocess.Popen(_cli(model, fake, ports, *extra, "--", *vllm_args), stdout=fo, stderr=fe)
    deadline = time.monotonic() + 60
    while "all healthy" not in errlog.read_text() or any(
            len(re.findall(k, log.read_text())) < n for k, n in (n_lines or {}).items()):
        assert proc.poll() is None, errlog.read_text()
        assert time.monotonic() < deadline, errlog.read_text()
        time.sleep(0.1)
    return proc, log, errlog, ports


def _bound(port: int) -> bool:
    """Bound the way `serve`'s own port check sees it (SO_REUSEADDR: TIME_WAIT leftovers do not count)."""
    from hybridpd.launch.probes import port_in_use

    return port_in_use("127.0.0.1", port)


def test_sigkill_of_supervisor_leaves_no_process_or_port(tiny_models: dict[str, Path], fake: Path,
                                                         tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to clean up: the keepers see the watchdog pipe close and stop their
    trees, including a grandchild that double-forked and called setsid (outside every process group we know)."""
    proc, log, errlog, ports = _start_cli(tiny_models["llama"], fake, tmp_path,
                                          vllm_args=("--fake-grandchild", "--fake-setsid-grandchild"),
                                          n_lines={"grandchild": 2, "escaped": 2})
    try:
        keepers = [int(p) for p in re.findall(r"pid (\d+)", errlog.read_text())]
        grand = [int(g) for g in re.findall(r"grandchild (\d+)", log.read_text())]
        escaped = [(int(a), int(b)) for a, b in re.findall(r"escaped (\d+) (\d+)", log.read_text())]
        assert len(keepers) == 3 and len(grand) == 2 and len(escaped) == 2
        assert all(pgid == pid for pid, pgid in escaped)  # really its own group (and session)
        pids = keepers + grand + [pid for pid, _ in escaped]
        assert all(alive(p) for p in pids)
        http_ports = [ports["prefill_port"], ports["decode_port"], ports["proxy_port"]]
        assert all(_bound(p) for p in http_ports)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and ([p for p in pids if alive(p)] or [p for p in http_ports if _bound(p)]):
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], "processes outlived the supervisor"
        assert not [p for p in http_ports if _bound(p)], "ports still bound"
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stop_order_proxy_then_decode_then_prefill(tiny_models: dict[str, Path], fake: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lp = make_plan(tiny_models["llama"], fake, extra=("--fake-term-delay", "0.3"))
    out = io.StringIO()
    code = Supervisor(lp, out=out, grace_s=5, poll_s=0.1, subreaper=False,
                      on_ready=lambda sup: sup.request_stop("test done")).run(install_signals=False)
    assert code == 0
    at = {name: float(t) for name, t in re.findall(r"\[(\S+)\] got SIGTERM at (\S+)", out.getvalue())}
    assert sorted(at) == ["decode-0", "prefill-0", "proxy"]
    # each stage starts only after the previous one has exited (P and D take 0.3 s to stop, the proxy none)
    assert at["proxy"] < at["decode-0"] and at["decode-0"] + 0.3 <= at["prefill-0"]
    assert "no SIGKILL needed" in capsys.readouterr().err


def test_sigterm_ignored_gets_sigkill_and_shm_cleanup(tiny_models: dict[str, Path], fake: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    lp = make_plan(tiny_models["llama"], fake, decode_args=("--fake-ignore-term", "--fake-shm"))
    out = io.StringIO()
    seen: dict[str, Any] = {}

    def ready(sup: Supervisor) -> None:
        time.sleep(1.5)  # the keeper notes the segments at its first scan (after 1 s)
        seen["seg"] = re.findall(r"\[decode-0\] shm (\S+)", out.getvalue())
        sup.request_stop("test done")

    t0 = time.monotonic()
    code = Supervisor(lp, out=out, grace_s=1, poll_s=0.1, subreaper=False, on_ready=ready).run(
        install_signals=False)
    assert code == 0 and time.monotonic() - t0 < 20
    (seg,) = seen["seg"]
    assert not os.path.exists(seg), "the leaked segment was not removed"
    err = capsys.readouterr().err
    # the fake and its multiprocessing resource tracker (which ignores SIGTERM, as vLLM's do)
    assert "SIGKILL needed for decode-0 (2 process(es))" in err
    assert "removed 1 leaked /dev/shm segment(s)" in err


def test_restart_on_failure_recovers(tiny_models: dict[str, Path], fake: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "died-once"
    lp = make_plan(tiny_models["llama"], fake, decode_args=("--fake-die-once", str(marker)))
    seen: dict[str, Any] = {}

    def ready(sup: Supervisor) -> None:
        seen["restarts"] = {c.spec.name: c.restarts for c in sup.children}
        sup.request_stop("test done")

    code = Supervisor(lp, out=io.StringIO(), grace_s=2, poll_s=0.1, restart="on-failure", backoff_s=0.2,
                      subreaper=False, on_ready=ready).run(install_signals=False)
    assert code == 0
    assert seen["restarts"] == {"prefill-0": 0, "decode-0": 1, "proxy": 0}
    err = capsys.readouterr().err
    assert "decode-0 exited with code 4; restarting in 0.2 s (restart 1 of 5)" in err


def test_restart_limit_then_fail(tiny_models: dict[str, Path], fake: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    lp = make_plan(tiny_models["llama"], fake, decode_args=("--fake-die-always",))
    t0 = time.monotonic()
    code = Supervisor(lp, out=io.StringIO(), grace_s=2, poll_s=0.05, restart="on-failure", restart_limit=2,
                      backoff_s=0.1, subreaper=False).run(install_signals=False)
    assert code == 1
    err = capsys.readouterr().err
    assert "restarting in 0.1 s (restart 1 of 2)" in err and "restarting in 0.2 s (restart 2 of 2)" in err
    assert "decode-0 exited with code 5 (restart limit 2 reached)" in err
    assert time.monotonic() - t0 >= 0.3  # the backoff was waited


def test_sigstopped_child_is_dead(tiny_models: dict[str, Path], fake: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A child that stops answering /health (SIGSTOP: the process exists, the port is bound) is killed."""
    lp = make_plan(tiny_models["llama"], fake)
    out = io.StringIO()
    seen: dict[str, Any] = {}

    def ready(sup: Supervisor) -> None:
        d = next(c for c in sup.children if c.spec.name == "decode-0")
        (server,) = [p for p in _kids(d.pid)]
        seen["server"] = server
        os.kill(server, signal.SIGSTOP)

    t0 = time.monotonic()
    code = Supervisor(lp, out=out, grace_s=2, poll_s=0.1, health_interval_s=0.3, liveness_timeout_s=1.5,
                      probe_timeout_s=0.5, subreaper=False, on_ready=ready).run(install_signals=False)
    assert code == 1 and time.monotonic() - t0 < 30
    assert "decode-0 stopped answering" in capsys.readouterr().err
    time.sleep(0.2)
    assert not alive(seen["server"])


def _kids(pid: int) -> list[int]:
    from hybridpd.launch.keeper import descendants

    return descendants(pid)


def test_orphans_of_a_killed_keeper_are_swept(tiny_models: dict[str, Path], fake: Path) -> None:
    """The keeper itself SIGKILLed: its child is re-parented to the supervisor (a subreaper), which kills it."""
    lp = make_plan(tiny_models["llama"], fake, role="decode")
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, json.dumps(lp.to_dict()), str(w)],
                            pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as f:
        line = f.readline()
    assert proc.wait(timeout=60) == 0 and line, line
    seen = json.loads(line)
    assert seen["swept"] == [seen["server"]] and not alive(seen["server"])


_ORPHAN_SCRIPT = r"""
import io, json, os, signal, sys, time
from hybridpd.launch.supervisor import Supervisor
from hybridpd.launch.commands import LaunchPlan, ProcessSpec
from hybridpd.launch.entry import VllmEntry
d = json.loads(sys.argv[1])
procs = tuple(ProcessSpec(name=p["name"], role=p["role"], argv=tuple(p["argv"]), env=tuple(p["env"].items()),
                          host=p["host"], port=p["port"], health_url=p["health_url"]) for p in d["processes"])
lp = LaunchPlan(model=d["model"], role=d["role"], platform=d["platform"], vllm_profile=d["vllm_profile"],
                entry=VllmEntry(kind="cli", prefix=()), processes=procs, block_size=None, findings=())
out = os.fdopen(int(sys.argv[2]), "w")
res = {}
def ready(sup):
    from hybridpd.launch.keeper import descendants
    c = sup.children[0]
    (server,) = descendants(c.pid)
    res["server"] = server
    os.kill(c.pid, signal.SIGKILL)
    c.proc.wait()
    deadline = time.monotonic() + 10
    res["swept"] = []
    while not res["swept"] and time.monotonic() < deadline:
        time.sleep(0.2)
        res["swept"] = sup._sweep_orphans()
    sup.request_stop("done")
code = Supervisor(lp, out=io.StringIO(), grace_s=1, poll_s=0.1, on_ready=ready).run(install_signals=False)
out.write(json.dumps(res) + "\n")
out.flush()
"""


def test_kv_lease_warning_reaches_the_operator(tiny_models: dict[str, Path], fake: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    line = ("WARNING hybridpd.launch.proxy: KV lease expired on prefill backend http://127.0.0.1:1: 1 expired. Decode may "
            "have read KV blocks P had already freed")
    monkeypatch.setenv("FAKE_PROXY_SAY", line)
    lp = make_plan(tiny_models["llama"], fake)
    out = io.StringIO()

    def ready(sup: Supervisor) -> None:
        time.sleep(0.3)
        sup.request_stop("test done")

    assert Supervisor(lp, out=out, grace_s=2, poll_s=0.1, subreaper=False, on_ready=ready).run(
        install_signals=False) == 0
    assert f"[proxy] {line}" in out.getvalue()
    assert f"hybridpd: warning: {line}" in capsys.readouterr().err


def test_restart_waits_for_the_ports_of_the_failed_process(tiny_models: dict[str, Path], fake: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A restart does not start into a port that is still bound (it would fail at bind, or hang like vLLM's
    NIXL handshake listener does): it waits until the port is free."""
    marker = tmp_path / "died-once"
    lp = make_plan(tiny_models["llama"], fake, decode_args=("--fake-die-once", str(marker)))
    d = next(p for p in lp.servers if p.name == "decode-0")
    holder = socket.socket()
    holder.bind(("127.0.0.1", d.side_channel_port))
    holder.listen()

    class Sup(Supervisor):
        def status(self, msg: str) -> None:
            super().status(msg)
            if "still in use" in msg:  # the wait was seen: now free the port
                holder.close()

    seen: dict[str, Any] = {}

    def ready(sup: Supervisor) -> None:
        seen["restarts"] = {c.spec.name: c.restarts for c in sup.children}
        sup.request_stop("test done")

    code = Sup(lp, out=io.StringIO(), grace_s=2, poll_s=0.1, restart="on-failure", backoff_s=0.2,
               subreaper=False, on_ready=ready).run(install_signals=False)
    assert code == 0 and seen["restarts"]["decode-0"] == 1
    err = capsys.readouterr().err
    assert f"decode-0: port(s) {d.side_channel_port} still in use; waiting up to 30 s before the restart" in err
    assert err.count("still in use") == 1
