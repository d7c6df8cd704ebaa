"""GPU paths of the rehearsal (issue #7): device parsing, UCX transport report, coalescing (always run), and
the VRAM rehearsals themselves, which run only where torch sees a CUDA device and NIXL is installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.verify import ucx_info
from hybridpd.verify.nixl_agent import Placement, parse_device
from hybridpd.verify.rehearsal import make_setup
from hybridpd.verify.verdict import RankResult

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))  # the bench-only NIXL code lives there
from _nixl_bench import coalesce, read_sweep, sweep_addrs, sweep_region_bytes, variants  # noqa: E402

DATA = Path(__file__).parent / "data"


# ------------------------------------------------------------------------------------------ --device


@pytest.mark.parametrize("spec,p,d", [("cpu", "cpu", "cpu"), ("cuda", "cuda:0", "cuda:0"), ("CUDA:3", "cuda:3", "cuda:3"),
                                      ("cuda:0,1", "cuda:0", "cuda:1"), ("cuda:1,cuda:0", "cuda:1", "cuda:0"),
                                      ("0,1", "cuda:0", "cuda:1")])
def test_parse_device(spec: str, p: str, d: str) -> None:
    pl = parse_device(spec)
    assert (pl.p, pl.d) == (p, d)
    assert pl.on_gpu == (spec != "cpu")
    assert Placement.mem(pl.d) == ("DRAM" if spec == "cpu" else "VRAM")


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:a", "cuda:0,1,2", "cpu,cuda", ""])
def test_parse_device_rejects(spec: str) -> None:
    with pytest.raises(UsageError, match="--device"):
        parse_device(spec)


# ------------------------------------------------------------------------------- UCX protocol report


def test_ucx_report_of_a_real_dram_read() -> None:
    text = (DATA / "ucx_proto_info_dram.log").read_text()
    tables = ucx_info.parse(text)
    assert len(tables) > 10  # UCX logs one table per (endpoint config, operation)
    assert ucx_info.read_transports(text) == ["cma/memory"]
    assert ucx_info.read_operations(text) == ["remote memory read by ucp_get*(multi) into host memory from host"]
    # active messages went over TCP: the parser must not mistake them for the READ's transport
    assert any(r.config == "tcp/lo" for t in tables if not t.is_read for r in t.rows)


def test_ucx_report_of_a_real_vram_read() -> None:
    path = DATA / "ucx_proto_info_vram.log"
    if not path.exists():
        pytest.skip("no VRAM UCX log captured")
    text = path.read_text()
    assert any(t.startswith("cuda_ipc") for t in ucx_info.read_transports(text)), ucx_info.read_transports(text)
    assert all("cuda" in op for op in ucx_info.read_operations(text))


def test_ucx_warnings_and_noise() -> None:
    text = ("[1.0] [h:1:0]   ucp_context.c:1 UCX  WARN  cuda-ipc get zcopy disabled as no nvlinks detected\n"
            "[1.0] [h:1:0]   | not a table |\n"
            "garbage line\n")
    assert ucx_info.warnings(text) == ["ucp_context.c:1 UCX  WARN  cuda-ipc get zcopy disabled as no nvlinks detected"]
    assert ucx_info.read_transports(text) == []
    assert ucx_info.parse("") == []


# ------------------------------------------------------------------------------------------ coalesce


def _pairs(la: np.ndarray, ra: np.ndarray, ln: np.ndarray) -> set[tuple[int, int]]:
    return {(int(a) + k, int(b) + k) for a, b, n in zip(la, ra, ln, strict=True) for k in range(int(n))}


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    u = np.uint64
    la = np.array([100, 110, 120, 200, 210], dtype=u)
    ra = np.array([500, 510, 900, 600, 610], dtype=u)  # 3rd breaks on the remote side
    ln = np.array([10, 10, 10, 10, 5], dtype=u)
    a, b, n = coalesce(la, ra, ln)
    assert a.tolist() == [100, 120, 200] and b.tolist() == [500, 900, 600] and n.tolist() == [20, 10, 15]


def test_coalesce_keeps_every_byte_mapping() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        k = int(rng.integers(1, 12))
        ln = rng.integers(1, 6, k).astype(np.uint64)
        la = np.cumsum(ln + rng.integers(0, 2, k).astype(np.uint64)).astype(np.uint64) - ln
        ra = np.cumsum(ln + rng.integers(0, 2, k).astype(np.uint64)).astype(np.uint64) - ln + np.uint64(1000)
        perm = rng.permutation(k)
        a, b, n = coalesce(la[perm], ra[perm], ln[perm])
        assert _pairs(a, b, n) == _pairs(la, ra, ln)
        assert int(n.sum()) == int(ln.sum()) and len(n) <= k


def test_coalesced_homogeneous_ds_page_is_one_descriptor_per_mamba_block() -> None:
    """Homogeneous TP, DS layout: x|B|C|SSM of a page are one range, so 4 Mamba descriptors become 1."""
    from hybridpd.verify.rehearsal import transfer_views

    plan = build_plan("nano", prefill=EngineSettings(tp=2), decode=EngineSettings(tp=2))
    s = make_setup(plan)
    p_bases = {r: [(r + 1) << 40 | (t << 32) for t in range(s.p.num_shared_tensors)] for r in range(2)}
    d_bases = [(9 << 40) | (t << 32) for t in range(s.d.num_shared_tensors)]
    v = transfer_views(s, 0, p_bases, d_bases)[0]
    a, _, n = coalesce(v.local.addr[v.local_ids], v.remote.addr[v.remote_ids], v.remote.length[v.remote_ids])
    mamba = sum(c != "FA" for c in v.components)
    fa = len(v.components) - mamba
    assert len(n) == fa + mamba // 4  # random block ids: FA blocks stay apart; each Mamba page merges 4 -> 1
    assert int(n.sum()) == int(v.remote.length[v.remote_ids].sum())


# --------------------------------------------------------------------------------- on a GPU, for real


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need_gpu(n: int = 1) -> None:
    from hybridpd.verify.nixl_agent import nixl_available

    if _gpus() < n:
        pytest.skip(f"needs {n} CUDA device(s); torch sees {_gpus()}")
    if not nixl_available():
        pytest.skip("nixl not installed")


def _vram(model: str, ptp: int, dtp: int, device: str = "cuda", block: int | None = None, **kw: Any) -> list[RankResult]:
    from hybridpd.verify.nixl_agent import run_nixl

    plan = build_plan(model, prefill=EngineSettings(tp=ptp, block_size=block), decode=EngineSettings(tp=dtp, block_size=block))
    return run_nixl(make_setup(plan, **kw), device=parse_device(device))


@pytest.mark.parametrize("model,ptp,dtp,block", [("nano", 2, 2, None), ("nano", 1, 4, 2096), ("super", 4, 4, None)])
def test_vram_rehearsal_bit_exact(model: str, ptp: int, dtp: int, block: int | None) -> None:
    _need_gpu()
    res = _vram(model, ptp, dtp, block=block)
    assert all(r.ok for r in res), [r.mismatches for r in res]
    for r in res:
        assert r.memory == "VRAM" and r.ucx is not None
        assert r.ucx.read_transports, r.ucx
        assert all("into cuda" in op for op in r.ucx.read_operations), r.ucx


@pytest.mark.parametrize("inject", ["offset", "length"])
def test_vram_rehearsal_catches_injection(inject: str) -> None:
    _need_gpu()
    res = _vram("nano", 2, 2, inject=inject, inject_rank=1)
    assert res[0].ok and not res[1].ok
    assert any("D rank 1: region B" in m for m in res[1].mismatches), res[1].mismatches


def test_vram_rehearsal_across_two_gpus() -> None:
    _need_gpu(2)
    res = _vram("nano", 1, 4, device="cuda:0,1", block=2096)
    assert all(r.ok for r in res), [r.mismatches for r in res]


def test_vram_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    _need_gpu()
    from hybridpd_cli.main import main

    main(["verify", "nano", "--ptp", "2", "--dtp", "2", "--rehearse", "--device", "cuda", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["memory"].startswith("VRAM") and data["ucx_read_transports"]


@pytest.mark.integration
def test_bench_mode_variants_on_dram() -> None:
    """The benchmark's bare and coalesced READs leave D byte-identical to the rehearsal's READ."""
    from hybridpd.verify.nixl_agent import nixl_available, run_nixl

    if not nixl_available():
        pytest.skip("nixl not installed")
    plan = build_plan("nano", prefill=EngineSettings(tp=2), decode=EngineSettings(tp=2))
    res = run_nixl(make_setup(plan), repeat=2, bench=variants)
    for r in res:
        assert r.ok, r.mismatches
        b = r.bench
        assert b is not None and b["bare"]["identical"] and b["coalesced"]["identical"]
        assert b["bare"]["descriptors"] == r.moved_descriptors > b["coalesced"]["descriptors"]
        assert len(b["rehearsal"]["read_times_s"]) == len(b["bare"]["read_times_s"]) == 2


def test_sweep_addresses_round_robin_without_overlap() -> None:
    sizes = [4096, 1 << 20]
    per_region = sweep_region_bytes(sizes, total=8 << 20, max_descs=100, regions=3, gap=2)
    bases = [0, 1 << 40, 2 << 40]
    for size in sizes:
        n = max(4, min(100, (8 << 20) // size))
        a = sweep_addrs(bases, n, size, 2)
        assert [int(x) >> 40 for x in a[:4]] == [0, 1, 2, 0]  # round robin over the regions
        ends = [(int(x) & ((1 << 40) - 1)) + size for x in a]
        assert max(ends) <= per_region  # every descriptor fits its region
        s = sorted(int(x) for x in a)
        assert all(b - x >= 2 * size for x, b in zip(s, s[1:], strict=False))  # gaps: nothing contiguous


@pytest.mark.integration
def test_read_sweep_on_dram() -> None:
    from hybridpd.verify.nixl_agent import nixl_available

    if not nixl_available():
        pytest.skip("nixl not installed")
    out = read_sweep(Placement(), [4096, 1 << 20], total=8 << 20, max_descs=256, repeat=2, regions=3)
    assert [(r["descriptor_bytes"], r["descriptors"], r["bytes"]) for r in out["rows"]] == \
        [(4096, 256, 256 * 4096), (1 << 20, 8, 8 << 20)]
    assert all(len(r["times_s"]) == 2 and min(r["times_s"]) > 0 for r in out["rows"])
    assert out["ucx"]["read_transports"]
