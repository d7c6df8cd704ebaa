"""Hypothesis invariants over the layout engine, and fuzzed malformed configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.core import families, layout, models, profiles
from hybridpd.core.descriptors import local_table, request_desc_ids
from hybridpd.core.models import RawModel
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings as E
from hybridpd.errors import HybridPDError

HYBRIDS = ["nano", "super", "nano-nvfp4", "granite-tiny", "granite-micro", "granite-small", "nemotron-h-8b",
           "nano-9b-v2", "falcon-h1-0.5b", "falcon-h1-34b", "zamba2-2.7b", "nemotron-h-56b"]
TPS = [1, 2, 4, 8]

side_args = st.fixed_dictionaries({
    "model": st.sampled_from(HYBRIDS), "tp": st.sampled_from(TPS),
    "kv": st.sampled_from(["auto", "fp8", "bfloat16"]), "ssm": st.sampled_from(["auto", "float32", "float16"]),
    "block": st.one_of(st.none(), st.sampled_from([16, 32, 64, 128, 256, 400, 1024])),
    "version": st.sampled_from(["0.20", "0.21", "0.22.1", "0.32"]), "platform": st.sampled_from(["cuda", "cpu"]),
    "backend": st.sampled_from([None, "flashinfer", "triton"]), "prefix": st.sampled_from([None, False, True]),
})


def _side(a: dict) -> layout.SideLayout | None:  # type: ignore[type-arg]
    spec = families.model_spec(models.resolve(a["model"]))
    backend = a["backend"] if a["platform"] == "cuda" else None
    s = E(tp=a["tp"], kv_cache_dtype=a["kv"], mamba_ssm_cache_dtype=a["ssm"], block_size=a["block"],
          attention_backend=backend, enable_prefix_caching=a["prefix"])
    return layout.side_layout(spec, s, profiles.profile_for(a["version"]), profiles.platform_for(a["platform"]),
                              role="prefill")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(side_args)
def test_page_equality_after_padding(a: dict) -> None:  # type: ignore[type-arg]
    s = _side(a)
    assert s is not None
    if s.mamba is None:
        return  # TP does not divide the Mamba heads: reported as an error
    assert s.page_size_bytes == s.block_size * s.attn_bytes_per_token
    assert s.page_size_bytes == s.mamba_page_bytes + s.padding_bytes
    assert s.padding_bytes >= 0
    assert s.block_size % s.kernel_block_size == 0
    assert s.physical_per_logical * s.kernel_block_size == s.block_size
    if a["block"] is not None:
        assert s.block_size >= a["block"]
    # the block is minimal: one alignment step less would not hold the Mamba page
    if a["block"] is None and s.mamba_cache_mode != "all" and s.platform.name == "cuda":
        step = max(s.kernel_sizes.min_base, 16) if s.kernel_sizes else 16
        assert (s.block_size - step) * s.attn_bytes_per_token < s.mamba_page_bytes


@settings(max_examples=120, deadline=None)
@given(side_args, st.integers(min_value=1, max_value=40), st.data())
def test_desc_ids_unique_and_in_range(a: dict, n_log: int, data: st.DataObject) -> None:  # type: ignore[type-arg]
    s = _side(a)
    assert s is not None
    if s.mamba is None or s.page_size_bytes > 1 << 26:
        return
    table = local_table(s, [(i + 1) << 40 for i in range(s.num_shared_tensors)], n_log)
    # all groups share one block pool: a block id belongs to at most one group at a time
    wanted = [1 if g.kind == "mamba" else data.draw(st.integers(0, 4)) for g in s.groups]
    if sum(wanted) > n_log:
        return
    pool = data.draw(st.permutations(range(n_log)))
    ids_per_group, at = [], 0
    for k in wanted:
        ids_per_group.append(list(pool[at:at + k]))
        at += k
    ids = request_desc_ids(s, table, ids_per_group)
    assert len(np.unique(ids)) == len(ids)
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < len(table))
    # descriptors never overlap within one rank's registered memory
    order = np.argsort(table.addr[ids])
    ends = table.addr[ids][order] + table.length[ids][order]
    assert np.all(ends[:-1] <= table.addr[ids][order][1:])
    # padding is never inside a Mamba descriptor
    mam = ids[ids >= table.num_fa_descs]
    assert np.all(table.length[mam] > 0)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(HYBRIDS + ["llama-3.1-8b"]), st.sampled_from(TPS), st.sampled_from(["0.20", "0.32"]),
       st.lists(st.integers(2, 300_000), min_size=2, max_size=6))
def test_bytes_monotone_in_isl(model: str, tp: int, version: str, isls: list[int]) -> None:
    try:
        plan = build_plan(model, prefill=E(tp=tp), decode=E(tp=tp), vllm_version=version, isls=tuple(sorted(isls)))
    except HybridPDError:
        return
    b = [t.bytes for t in plan.transfers]
    d = [t.descriptors for t in plan.transfers]
    assert b == sorted(b) and d == sorted(d)
    for t in plan.transfers:
        assert t.naive_bytes >= t.bytes
        assert t.descriptors_min <= t.descriptors


BASE = json.loads(json.dumps(models.load_bundled("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16").config))
junk = st.one_of(st.none(), st.text(max_size=5), st.integers(-5, 5), st.floats(allow_nan=False),
                 st.lists(st.integers(), max_size=3), st.booleans(), st.dictionaries(st.text(max_size=3),
                                                                                     st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(BASE)), junk, st.booleans())
def test_malformed_config_is_a_typed_error(key: str, value: object, delete: bool) -> None:
    cfg = dict(BASE)
    if delete:
        cfg.pop(key, None)
    else:
        cfg[key] = value
    try:
        spec = families.model_spec(RawModel(model_id="fuzz", source="path", location="x", config=cfg))
        build_plan(spec, prefill=E(tp=2), decode=E(tp=2))
    except HybridPDError:
        pass  # typed, mapped to one line by the CLI


def test_malformed_configs_cli_exit_2(tmp_path: Path) -> None:
    cases = {"not_json": "{", "list": "[1,2]", "no_type": json.dumps({"num_hidden_layers": 2}),
             "bad_pattern": json.dumps({**BASE, "hybrid_override_pattern": "MX"}),
             "neg_heads": json.dumps({**BASE, "mamba_num_heads": -4}),
             "str_layers": json.dumps({**BASE, "num_hidden_layers": "52"})}
    for name, text in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(text)
        r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "plan", str(d)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (name, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
