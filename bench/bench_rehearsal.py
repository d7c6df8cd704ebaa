"""Rehearsal transfer throughput (NIXL READs between rank processes) vs plain numpy copies of the same bytes.

  python bench/bench_rehearsal.py [MODEL] [--ptp 1] [--dtp 1] [--blocks 8] [--repeat 3]

Both are measured in the same run: the NIXL figure is the D rank's READ time (and NIXL telemetry's
xferDuration); the baselines are (a) the same descriptor gather done with numpy slices, (b) one contiguous
numpy copy of the same number of bytes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybridpd.nixl_agent import run_nixl
from hybridpd.plan import build_plan
from hybridpd.rehearsal import fill_prefill, init_decode, make_setup, numpy_read, transfer_views
from hybridpd.settings import EngineSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="nano-fp8")
    ap.add_argument("--ptp", type=int, default=1)
    ap.add_argument("--dtp", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=8, help="request length in attention blocks")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    plan = build_plan(a.model, prefill=EngineSettings(tp=a.ptp), decode=EngineSettings(tp=a.dtp))
    isl = a.blocks * plan.prefill.block_size
    s = make_setup(plan, isl=isl, max_rank_bytes=256 << 20)
    best = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        res = run_nixl(s, repeat=5)
        wall = time.perf_counter() - t0
        assert all(r["ok"] for r in res), [r["mismatches"] for r in res]
        best.append((max(r["elapsed_s"] for r in res), sum(r["moved_bytes"] for r in res), res, wall))
    el, nbytes, res, wall = min(best, key=lambda x: x[0])
    tel = sum((r["telemetry"] or {}).get("xfer_us", 0) for r in res)
    # numpy gather over the same descriptors (rank 0's view), in this process
    p_t = {r: fill_prefill(s, r) for r in range(s.p.tp)}
    p_b = {r: [t.ctypes.data for t in ts] for r, ts in p_t.items()}
    d_t = init_decode(s)
    d_b = [t.ctypes.data for t in d_t]
    views = transfer_views(s, 0, p_b, d_b)
    g = []
    for _ in range(5):
        t0 = time.perf_counter()
        numpy_read(views, p_t, p_b, d_t, d_b)
        g.append(time.perf_counter() - t0)
    rank0 = res[0]["moved_bytes"]
    src = np.random.default_rng(0).integers(0, 256, rank0, dtype=np.uint8)
    dst = np.empty_like(src)
    c = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        c.append(time.perf_counter() - t0)
    n_desc = res[0]["moved_descriptors"]
    print(f"model {plan.model.model_id} P TP{a.ptp} -> D TP{a.dtp}, ISL {isl}, {s.n_log} blocks/rank, "
          f"{n_desc} descs/rank, {rank0:,} B per D rank, {nbytes:,} B total; rehearsal wall {wall:.2f} s")
    first = max(r["first_elapsed_s"] for r in res)
    print(f"NIXL first (cold) READ incl. prep: {first * 1e3:.2f} ms = {rank0 / first / 1e9:.2f} GB/s per rank")
    print(f"NIXL warm READ incl. prep (slowest D rank, 5th READ, best of {a.repeat} runs): {el * 1e3:.2f} ms = "
          f"{rank0 / el / 1e9:.2f} GB/s per rank"
          + (f"; telemetry xferDuration {tel / len(res) / 1e3:.2f} ms" if tel else ""))
    print(f"numpy gather, same descriptors: {min(g) * 1e3:.2f} ms = {rank0 / min(g) / 1e9:.2f} GB/s")
    print(f"numpy contiguous copy, same bytes: {min(c) * 1e3:.2f} ms = {rank0 / min(c) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
