"""Build full NIXL descriptor tables (addresses + lengths) for a large deployment, vectorised vs a loop.

Default: Nemotron-3-Super (NVFP4 checkpoint: fp8 KV) at TP4 on a 141 GB GPU, for every vLLM profile
(K/V separate with kernel blocks of 64 through 0.24, K+V packed from 0.26, strided rows in 0.33).  Prints
the vectorised build's speed as a ratio against a per-descriptor Python loop run in the same process; for
profiles that register strided rows (0.33) also the direct row build, checked against the flat table.

    python bench/bench_descriptors.py [--model super-nvfp4] [--tp 4] [--gpu-memory 141GB]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hybridpd.core.descriptors import local_table, strided_rows
from hybridpd.core.layout import SideLayout
from hybridpd.core.plan import build_plan
from hybridpd.core.profiles import PROFILES
from hybridpd.core.settings import EngineSettings, parse_size


def loop_local_table(side: SideLayout, bases: list[int], n_log: int) -> list[tuple[int, int]]:
    """The baseline: ``local_table`` one descriptor at a time, in plain Python."""
    kvd = side.profile.kv_descs_per_block
    n_phys = n_log * side.physical_per_logical
    kp = side.kernel_page_bytes
    out: list[tuple[int, int]] = []
    if side.attention_groups:
        for base in bases:
            for half in range(kvd):
                for blk in range(n_phys):
                    out.append((base + blk * kp + half * (kp // kvd), kp // kvd))
    if side.mamba is not None and side.mamba_groups:
        spans = side.mamba.desc_spans()
        for base in bases[:side.num_ssm_slots]:
            for off, ln in spans:
                for blk in range(n_log):
                    out.append((base + blk * side.page_size_bytes + off, ln))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="super-nvfp4")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--gpu-memory", default="141GB")
    ap.add_argument("--versions", default=",".join(p.name for p in PROFILES))
    ap.add_argument("--repeat", type=int, default=3, help="vectorised builds per profile, best kept (default 3)")
    ap.add_argument("--min-speedup", type=float, default=30.0, help="goal per profile (issue #21; default 30)")
    a = ap.parse_args()
    mem = parse_size(a.gpu_memory, field="--gpu-memory")
    summary = []
    for ver in a.versions.split(","):
        s = EngineSettings(tp=a.tp, gpu_memory=mem, gpu_memory_utilization=0.9)
        plan = build_plan(a.model, prefill=s, decode=s, vllm_version=ver)
        side = plan.prefill
        n_log = side.num_blocks or 0
        bases = [(i + 1) << 40 for i in range(side.num_shared_tensors)]
        best = float("inf")
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            table = local_table(side, bases, n_log)
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = loop_local_table(side, bases, n_log)
        loop_s = time.perf_counter() - t0
        same = (len(ref) == len(table)
                and np.array_equal(np.fromiter((x for x, _ in ref), np.uint64, len(ref)), table.addr)
                and np.array_equal(np.fromiter((n for _, n in ref), np.uint64, len(ref)), table.length))
        print(f"vLLM {ver}: {a.model} TP{a.tp} block {side.block_size} kernel {side.kernel_block_size} "
              f"ratio {side.physical_per_logical}, {n_log:,} logical blocks, T={side.num_shared_tensors}")
        print(f"  descriptors {len(table):,} ({table.num_fa_descs:,} FA + {len(table) - table.num_fa_descs:,} Mamba)")
        print(f"  vectorised {best * 1e3:,.1f} ms  ({len(table) / best / 1e6:,.1f} M desc/s)")
        print(f"  python loop {loop_s * 1e3:,.1f} ms  ({len(ref) / loop_s / 1e6:,.2f} M desc/s)")
        print(f"  speed-up x{loop_s / best:,.1f}   identical tables: {same}")
        if side.profile.strided_descriptors:
            best_rows = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                rows = strided_rows(side, bases, n_log)
                best_rows = min(best_rows, time.perf_counter() - t0)
            addr, length = rows.expanded()
            ok = np.array_equal(addr, table.addr) and np.array_equal(length, table.length)
            print(f"  strided rows {len(rows):,} built directly in {best_rows * 1e6:,.0f} µs: x{loop_s / best_rows:,.0f} "
                  f"the loop; expanded == flat table: {ok}")
            same = same and ok
        summary.append((ver, len(table), best, loop_s, same))
        del ref, table
    failed = False
    for ver, n, best, loop_s, same in summary:
        ok = same and loop_s / best >= a.min_speedup
        failed |= not ok
        print(f"SUMMARY descriptors vLLM {ver}: {n:,} descriptors, vectorised {best * 1e3:.1f} ms, loop "
              f"{loop_s * 1e3:.0f} ms, speed-up x{loop_s / best:.1f} (goal x{a.min_speedup:g}) "
              f"{'ok' if ok else 'FAIL' if same else 'FAIL (tables differ)'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
