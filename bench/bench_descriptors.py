"""Build full NIXL descriptor tables (addresses + lengths) for a large deployment, vectorised vs a loop.

Default: Nemotron-3-Super (NVFP4 checkpoint: fp8 KV) at TP4 on a 141 GB GPU, both vLLM 0.20 (K/V
separate, kernel blocks of 64) and 0.32 (K+V packed, kernel = logical block).  Prints the vectorised
build's speed as a ratio against a per-descriptor Python loop run in the same process.

    python bench/bench_descriptors.py [--model super-nvfp4] [--tp 4] [--gpu-memory 141GB]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybridpd.descriptors import local_table, loop_local_table
from hybridpd.plan import build_plan
from hybridpd.settings import EngineSettings, parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="super-nvfp4")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--gpu-memory", default="141GB")
    ap.add_argument("--versions", default="0.20,0.32")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    mem = parse_size(a.gpu_memory, field="--gpu-memory")
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
        same = len(ref) == len(table) and np.array_equal(np.fromiter((x for x, _ in ref), np.uint64, len(ref)),
                                                          table.addr)
        print(f"vLLM {ver}: {a.model} TP{a.tp} block {side.block_size} kernel {side.kernel_block_size} "
              f"ratio {side.physical_per_logical}, {n_log:,} logical blocks, T={side.num_shared_tensors}")
        print(f"  descriptors {len(table):,} ({table.num_fa_descs:,} FA + {len(table) - table.num_fa_descs:,} Mamba)")
        print(f"  vectorised {best * 1e3:,.1f} ms  ({len(table) / best / 1e6:,.1f} M desc/s)")
        print(f"  python loop {loop_s * 1e3:,.1f} ms  ({len(ref) / loop_s / 1e6:,.2f} M desc/s)")
        print(f"  speed-up x{loop_s / best:,.1f}   identical tables: {same}")
        del ref, table


if __name__ == "__main__":
    main()
