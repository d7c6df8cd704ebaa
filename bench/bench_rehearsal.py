"""Rehearsal READ throughput on DRAM as a ratio to a memcpy of the same bytes, both timed in one run.

  UCX_NET_DEVICES=lo python bench/bench_rehearsal.py [MODEL] [--ptp 1] [--dtp 1] [--blocks 8] [--repeat 2]
      [--rounds 20] [--alt-ucx K=V[,K=V]] [--ucx K=V[,K=V]] ... [--json]

Each of ``--repeat`` runs starts fresh P and D rank processes (``run_nixl``, bit-exact check on).  Then, in
each D rank process, ``--rounds`` rounds run back to back (bench/_nixl_bench.py ``variants``):

* ``rehearsal``: the rehearsal's READ, vLLM's per-request work (make_prepped_xfer with the request's desc
  ids on the lists prepped at handshake, one per source P rank, post, poll until DONE) -- the figure;
* ``rehearsal_alt``: the same READ from a second D agent made under ``--alt-ucx`` (default
  UCX_CMA_SEG_SIZE=512k, UCX's own cma segment, i.e. what the rehearsal did before it set 64m);
* ``bare``: the same descriptors as one initialize_xfer READ made once and re-posted (no per-request make);
* ``coalesced``: bare, with descriptors contiguous on both sides merged (a what-if; vLLM does not do it);
* ``vm_readv``: a raw process_vm_readv of the request's descriptors (the kernel copy UCX's cma uses);
* ``memcpy``: numpy copy of the same number of bytes in the D process (the baseline);
* ``memcpy_descs``: memmove of the request's descriptors one by one in the D process, from a local shadow of
  P's tensors to D's addresses: the READ's scatter/gather pattern without a second process.

The rehearsal's figures are its READ time (first make_prepped_xfer to the last DONE, as ``verify`` reports
it); ``+release`` rows count the same calls with the telemetry read-out and the handle release after DONE.

A round's ratio is memcpy time / variant time; the table gives the median over every round of every run
and D rank, and the spread (min..max, and the middle half).  ``--ucx`` runs the whole thing again under
other UCX settings (runs alternate between the settings); "" is the rehearsal's own environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
from _nixl_bench import variants

from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.verify.nixl_agent import run_nixl
from hybridpd.verify.rehearsal import make_setup
from hybridpd.verify.verdict import RankResult

ORDER = ("rehearsal", "rehearsal_alt", "bare", "coalesced", "vm_readv", "memcpy_descs", "memcpy")
UCX_DEFAULT = "UCX_CMA_SEG_SIZE=512k"  # UCX's own cma segment; the rehearsal sets 64m (hybridpd.verify.nixl_wrap)


def _env_of(spec: str) -> dict[str, str]:
    out = {}
    for kv in filter(None, (x.strip() for x in spec.split(","))):
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"--ucx: {kv!r} is not K=V")
        out[k] = v
    return out


def _run(s: Any, rounds: int, env: dict[str, str], alt: dict[str, str]) -> tuple[list[RankResult], float]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned rank processes inherit it; the rehearsal only sets defaults
    try:
        t0 = time.perf_counter()
        res = run_nixl(s, repeat=rounds, bench=partial(variants, alt_ucx=alt or None))
        return res, time.perf_counter() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(runs: list[list[RankResult]]) -> dict[str, Any]:
    ratios: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}
    nbytes = 0
    for res in runs:
        for r in res:
            b = r.bench
            assert b is not None
            nbytes = r.moved_bytes
            base = b["memcpy"]["read_times_s"]
            for name in ORDER:
                if name not in b:
                    continue
                ts = b[name]["read_times_s"]
                times.setdefault(name, []).extend(ts)
                ratios.setdefault(name, []).extend(m / t for m, t in zip(base, ts, strict=True))
                if "call_times_s" in b[name]:  # the same READs counted with their bookkeeping
                    cs = b[name]["call_times_s"]
                    times.setdefault(name + "+release", []).extend(cs)
                    ratios.setdefault(name + "+release", []).extend(m / t for m, t in zip(base, cs, strict=True))
    out: dict[str, Any] = {}
    for name, rs in ratios.items():
        q = np.quantile(rs, [0.0, 0.25, 0.5, 0.75, 1.0])
        med_t = statistics.median(times[name])
        out[name] = {"ratio_median": float(q[2]), "ratio_min": float(q[0]), "ratio_q1": float(q[1]),
                     "ratio_q3": float(q[3]), "ratio_max": float(q[4]), "rounds": len(rs),
                     "median_s": med_t, "median_GBps": nbytes / med_t / 1e9}
    return out


def _speedup(runs: list[list[RankResult]]) -> dict[str, float] | None:
    """Per round, rehearsal_alt time / rehearsal time (the two READs ran back to back)."""
    xs = [a / b for res in runs for r in res if r.bench and "rehearsal_alt" in r.bench
          for a, b in zip(r.bench["rehearsal_alt"]["read_times_s"], r.bench["rehearsal"]["read_times_s"], strict=True)]
    if not xs:
        return None
    q = np.quantile(xs, [0.0, 0.25, 0.5, 0.75, 1.0])
    return {"median": float(q[2]), "q1": float(q[1]), "q3": float(q[3]), "min": float(q[0]), "max": float(q[4])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="nano-fp8")
    ap.add_argument("--ptp", type=int, default=1)
    ap.add_argument("--dtp", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=8, help="request length in attention blocks")
    ap.add_argument("--repeat", type=int, default=2, help="rehearsal runs (fresh processes) per UCX setting")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds of every variant per D rank per run")
    ap.add_argument("--ucx", action="append", default=None,
                    help='UCX settings "K=V,K=V" to measure ("" = the rehearsal\'s own); repeatable')
    ap.add_argument("--alt-ucx", default=UCX_DEFAULT,
                    help=f'UCX settings of the rehearsal_alt agent (default "{UCX_DEFAULT}"; "" leaves it out)')
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    configs = a.ucx if a.ucx is not None else [""]
    envs = [_env_of(c) for c in configs]
    plan = build_plan(a.model, prefill=EngineSettings(tp=a.ptp), decode=EngineSettings(tp=a.dtp))
    isl = a.blocks * plan.prefill.block_size
    s = make_setup(plan, isl=isl, max_rank_bytes=256 << 20)
    runs: dict[str, list[list[RankResult]]] = {c: [] for c in configs}
    walls: dict[str, list[float]] = {c: [] for c in configs}
    first: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(a.repeat):
        for c, env in zip(configs, envs, strict=True):
            res, wall = _run(s, a.rounds, env, _env_of(a.alt_ucx))
            bad = [m for r in res for m in r.mismatches]
            if bad:
                raise SystemExit(f"rehearsal FAILED under {c!r}: {bad[:3]}")
            differ = sorted({k for r in res for k, v in (r.bench or {}).items() if v.get("identical") is False})
            if differ:
                raise SystemExit(f"variants {differ} left D different from the rehearsal's READ under {c!r}")
            runs[c].append(res)
            walls[c].append(wall)
            first[c].extend(r.first_elapsed_s for r in res if r.first_elapsed_s is not None)
    r0 = runs[configs[0]][0][0]
    assert r0.bench is not None  # run_nixl(bench=...) gives every verdict its hook's answer
    head = {"model": plan.model.model_id, "ptp": a.ptp, "dtp": a.dtp, "isl": isl, "num_blocks": s.n_log,
            "bytes_per_d_rank": r0.moved_bytes, "descriptors_per_d_rank": r0.moved_descriptors,
            "telemetry_descriptors": (r0.telemetry or {}).get("descriptors"),
            "coalesced_descriptors": r0.bench["coalesced"]["descriptors"], "reads_per_d_rank": r0.reads,
            "alt_ucx": _env_of(a.alt_ucx),
            "repeat": a.repeat, "rounds": a.rounds, "load_avg": os.getloadavg()[0]}
    figures = {c or "default": {"ucx": envs[i], "variants": summarize(runs[c]), "wall_s": walls[c],
                                "first_read_s": first[c], "alt_speedup": _speedup(runs[c])} for i, c in enumerate(configs)}
    if a.json:
        print(json.dumps({**head, "configs": figures}, indent=1))
        return
    print(f"model {head['model']} P TP{a.ptp} -> D TP{a.dtp}, ISL {isl}, {s.n_log} blocks/rank; per D rank "
          f"{head['bytes_per_d_rank']:,} B in {head['descriptors_per_d_rank']} descriptors (NIXL merges them to "
          f"{head['telemetry_descriptors']}; {head['coalesced_descriptors']} if coalesced), {head['reads_per_d_rank']} "
          f"READ(s); {a.repeat} runs x {a.rounds} rounds per setting; load average {head['load_avg']:.1f}")
    for name, f in figures.items():
        print(f"\n[{name}] {f['ucx'] or 'rehearsal defaults'}; run wall {', '.join(f'{w:.1f}' for w in f['wall_s'])} s; "
              f"first (cold) READ {statistics.median(f['first_read_s']) * 1e3:.1f} ms")
        w = max(len(v) for v in f["variants"])
        print(f"  {'variant':<{w}} {'median':>9} {'GB/s':>7}   ratio to memcpy: median [middle half] (min..max)")
        for v, x in f["variants"].items():
            print(f"  {v:<{w}} {x['median_s'] * 1e3:7.2f}ms {x['median_GBps']:7.2f}   {x['ratio_median']:6.1%} "
                  f"[{x['ratio_q1']:.1%}..{x['ratio_q3']:.1%}] ({x['ratio_min']:.1%}..{x['ratio_max']:.1%})")
        if (sp := f["alt_speedup"]) is not None:
            print(f"  rehearsal is x{sp['median']:.3f} faster than rehearsal_alt ({head['alt_ucx']}) per round, median "
                  f"[middle half x{sp['q1']:.3f}..x{sp['q3']:.3f}] (x{sp['min']:.2f}..x{sp['max']:.2f})")


if __name__ == "__main__":
    main()
