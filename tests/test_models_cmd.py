"""`hybridpd models`: listing, stable JSON keys, P/D support per profile."""

from __future__ import annotations

import json
import time

from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd.core.catalog import catalog, profile_names
from hybridpd.core.models import ALIASES, bundled_ids

KEYS = ["id", "aliases", "family", "architecture", "mamba_layers", "attention_layers", "mamba_type", "n_groups",
        "pd_support", "hetero_tp"]


def _json() -> list[dict]:
    res = CliRunner().invoke(cli, ["models", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _by_id() -> dict[str, dict]:
    return {e["id"]: e for e in _json()}


def test_json_has_every_bundled_model_with_stable_keys() -> None:
    data = _json()
    assert [e["id"] for e in data] == bundled_ids()
    profiles = profile_names()
    for e in data:
        assert list(e) == KEYS
        assert list(e["pd_support"]) == profiles
        for s in e["pd_support"].values():
            assert set(s) == {"supported", "reason"}
            assert isinstance(s["supported"], bool)
            assert (s["reason"] is None) == s["supported"]


def test_aliases_match_alias_table() -> None:
    data = _by_id()
    for alias, target in ALIASES.items():
        assert alias in data[target]["aliases"]
    assert data["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"]["aliases"] == ["nano", "nano-bf16"]


def test_nemotron_nano_supported_everywhere() -> None:
    e = _by_id()["nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8"]
    assert e["family"] == "nemotron_h" and e["mamba_type"] == "mamba2"
    assert e["mamba_layers"] == 23 and e["attention_layers"] == 6 and e["n_groups"] == 8
    assert all(s["supported"] for s in e["pd_support"].values())


def test_unsupported_models_carry_reason_codes() -> None:
    data = _by_id()
    mamba1 = data["ai21labs/Jamba-v0.1"]
    assert mamba1["mamba_type"] == "mamba1"
    # derive_mamba_conv_split's _supported gains MAMBA1 in 0.25 (read from the wheels): before, vLLM refuses
    for name, s in mamba1["pd_support"].items():
        before = tuple(map(int, name.split("-")[0].split("."))) < (0, 25)
        want = {"supported": False, "reason": "unsupported-mamba-type"} if before else {"supported": True, "reason": None}
        assert s == want, name
    gdn = data["Qwen/Qwen3-Next-80B-A3B-Instruct"]
    # GDN_ATTN joins derive_mamba_conv_split's _supported in 0.22
    assert gdn["mamba_type"] == "gdn"
    for name, s in gdn["pd_support"].items():
        assert s["supported"] is (tuple(map(int, name.split("-")[0].split("."))) >= (0, 22)), name
    free = data["state-spaces/mamba2-2.7b"]
    assert free["attention_layers"] == 0
    assert all(s == {"supported": False, "reason": "attention-free"} for s in free["pd_support"].values())


def test_dense_model_has_no_mamba() -> None:
    e = _by_id()["meta-llama/Llama-3.1-8B-Instruct"]
    assert e["mamba_layers"] == 0 and e["mamba_type"] is None and e["n_groups"] is None


def test_human_table_shows_release_ranges_and_reasons() -> None:
    res = CliRunner().invoke(cli, ["models", "--fmt", "plain"])
    assert res.exit_code == 0, res.output
    names = profile_names()
    assert f"yes {names[0]}-{names[-1]}" in res.output  # e.g. Nemotron: every profile, one range
    # Jamba: refused before 0.25 (no Mamba-1 split), moved from 0.25
    assert "no 0.20-0.24 (unsupported-mamba-type); yes 0.25-0.33" in res.output
    assert "nano-fp8" in res.output and "23M / 6A" in res.output


def test_heterogeneous_tp_is_not_hidden_behind_tp_1_1() -> None:
    """Item 11: n_groups = 1 models pass at TP 1/1 but P TP 1 -> D TP 2 corrupts their conv state
    (B/C groups are replicated, vLLM's remote offsets assume they shard); n_groups = 8 / 2 models are fine."""
    data = _by_id()
    for mid in ("ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-0.5B-Instruct", "Zyphra/Zamba2-2.7B"):
        e = data[mid]
        assert e["n_groups"] == 1
        assert all(s["supported"] for s in e["pd_support"].values()), mid
        assert e["hetero_tp"]["supported"] is False and e["hetero_tp"]["reason"] == "conv-state-corruption", mid
        assert (e["hetero_tp"]["prefill_tp"], e["hetero_tp"]["decode_tp"]) == (1, 2)
    for mid in ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8", "tiiuae/Falcon-H1-34B-Instruct"):
        assert data[mid]["hetero_tp"]["supported"] is True, mid
    out = CliRunner().invoke(cli, ["models", "--fmt", "plain"]).output
    tiny = next(ln for ln in out.splitlines() if ln.startswith("ibm-granite/granite-4.0-h-tiny"))
    assert "no (conv-state-corruption)" in tiny


def test_supported_only_filters() -> None:
    res = CliRunner().invoke(cli, ["models", "--supported-only", "--json"])
    ids = {e["id"] for e in json.loads(res.output)}
    assert "state-spaces/mamba2-2.7b" not in ids and "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8" in ids


def test_fast() -> None:
    t = time.perf_counter()
    catalog()
    assert time.perf_counter() - t < 5.0
