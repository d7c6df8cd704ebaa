"""GPU paths against the hardware's limits, in one run on the same GPU(s) (issue #7).

  python bench/bench_gpu.py [--device cuda | cuda:0,1 | cpu] [--out DIR] [--quick] [--skip PARTS]

(``--device cpu`` runs parts 1-3 on DRAM: the calibration of this host's UCX DRAM transport.)

Measures, in this order, and prints each bandwidth as a fraction of the ceiling:

1. ceiling: a device-to-device copy (torch ``copy_``) on the D GPU, and with ``cuda:N,M`` the peer copy N -> M;
2. calibration: bare NIXL READs (VRAM -> VRAM, two processes) of equal-size descriptors, 4 KiB .. 4 MiB,
   fitted to ``t = n_desc * c + bytes / bw`` (``hybridpd.core.estimate.fit_calibration``); written as a
   calibration file that ``hybridpd plan --calibration`` reads;
3. rehearsals (``verify --rehearse --device ...``, bit-exact checks on): Nemotron-3-Nano 2->2, 1->4 (block
   2096, the recommended size) and Nemotron-3-Super 4->4 at an 8k-token request.  For each D rank, in
   the same processes and memory: the rehearsal's READ (vLLM's per-request work: make_prepped_xfer per
   source, post, wait), a bare ``initialize_xfer`` READ of the same descriptor list, and the what-if with
   descriptors contiguous on both sides coalesced (x|B|C|SSM of a DS page, homogeneous TP); plus plan's
   estimate from the calibration just fitted;
4. conversion: ``hybridpd.convert.gpu_transpose.channel_copy`` SD -> DS and DS -> SD (and a TP-4 channel slice)
   on a Nemotron-3-Super conv state, against a device copy of the same bytes.

Everything lands in DIR/bench_gpu.json and DIR/calibration.json.  ``--regions 1,8`` repeats the sweep over
that many registered allocations per side (the last is written); ``HYBRIDPD_PIN=1`` pins every rank process
to its own CPU.  Runs on H200s and what they showed: docs/gpu-h200-2026-11-29.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from _cuda_timing import best_time

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CASES = [  # (label, model, ptp, dtp, block size or None, isl)
    ("Nano 2->2", "nano", 2, 2, None, 8192),
    ("Nano 1->4", "nano", 1, 4, 2096, 8192),
    ("Super 4->4", "super", 4, 4, None, 8192),
]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return platform.processor() or "CPU"


def ceiling(pl: Any, nbytes: int, repeat: int) -> dict[str, Any]:
    if pl.d == "cpu":  # DRAM: one numpy copy of the same bytes
        import numpy as np

        a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        b = np.empty_like(a)
        best = float("inf")
        for _ in range(max(3, repeat // 4)):
            t0 = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t0)
        return {"bytes": nbytes, "d2d_s": best, "d2d_GBps": nbytes / best / 1e9, "gpu": _cpu_name(), "torch": None}
    import torch

    d = torch.device(pl.d)
    src = torch.empty(nbytes, dtype=torch.uint8, device=d).random_(0, 255)
    dst = torch.empty_like(src)
    torch.cuda.set_device(d)
    t = best_time(partial(dst.copy_, src), repeat)
    out: dict[str, Any] = {"bytes": nbytes, "d2d_s": t, "d2d_GBps": nbytes / t / 1e9,
                           "gpu": torch.cuda.get_device_name(d), "torch": torch.__version__}
    if pl.p != pl.d:
        psrc = torch.empty(nbytes, dtype=torch.uint8, device=pl.p).random_(0, 255)
        tp = best_time(partial(dst.copy_, psrc), repeat)
        out.update(peer_s=tp, peer_GBps=nbytes / tp / 1e9)
        del psrc
    del src, dst
    torch.cuda.empty_cache()
    return out


def calibrate(pl: Any, quick: bool, cmd: str, ceiling_Bps: float, regions: int
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from _nixl_bench import read_sweep

    from hybridpd.core.estimate import fit_calibration

    sweep = read_sweep(pl, SIZES, total=(256 if quick else 1024) << 20, max_descs=4096, repeat=3 if quick else 7,
                       regions=regions)
    rows = sweep["rows"]
    transport = (sweep["ucx"]["read_transports"] or ["unknown"])[0]
    pts = [(r["descriptors"], r["bytes"], statistics.median(r["times_s"])) for r in rows]
    c, bw, r2, err = fit_calibration(pts)
    note = (f"bare READs of {len(pts)} descriptor sizes {SIZES[0] >> 10} KiB..{SIZES[-1] >> 20} MiB over {regions} "
            "registered allocation(s) per side, median of repeats")
    if not bw < float("inf"):  # no size was large enough to show a bandwidth term: bound it by the device copy
        bw = ceiling_Bps
        note += "; bandwidth term not resolved by the points, set to the measured device copy"
    if pl.on_gpu:
        import torch

        gpu = torch.cuda.get_device_name(torch.device(pl.d))
        name = f"{transport.split('/')[0]}-{gpu.split()[-1].lower()}" + ("" if pl.p == pl.d else "-peer")
        where = "P and D processes on one GPU" if pl.p == pl.d else f"P on {pl.p}, D on {pl.d}"
        hardware = f"{gpu}, {where}, VRAM -> VRAM"
        software = (f"NIXL {_nixl_version()} (nixl-cu13), torch {torch.__version__}, UCX_CUDA_IPC_ENABLE_GET_ZCOPY="
                    f"{os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', 'y')}")
    else:
        name = f"{transport.split('/')[0]}-dram"
        hardware = f"{_cpu_name()}, P and D processes on one host, DRAM -> DRAM"
        software = f"NIXL {_nixl_version()} (nixl-cu13), UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', 'lo')}"
    entry = {"name": name, "transport": transport, "memory": "VRAM" if pl.on_gpu else "DRAM",
             "per_descriptor_us": round(c * 1e6, 3), "bandwidth_gbps": round(bw / 1e9, 2),
             "hardware": hardware, "software": software,
             "measured": time.strftime("%Y-%m-%d"), "command": cmd,
             "fit": {"points": len(pts), "r2": round(r2, 5), "max_rel_err": round(err, 4),
                     "note": note}}
    return entry, rows


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("nixl-cu13", "nixl"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"


def rehearse(pl: Any, case: tuple[Any, ...], repeat: int, entry: Any) -> dict[str, Any]:
    from _nixl_bench import variants

    from hybridpd.core.estimate import estimate_request
    from hybridpd.core.plan import build_plan
    from hybridpd.core.settings import EngineSettings
    from hybridpd.verify.nixl_agent import run_nixl
    from hybridpd.verify.rehearsal import make_setup

    label, model, ptp, dtp, block, isl = case
    plan = build_plan(model, prefill=EngineSettings(tp=ptp, block_size=block),
                      decode=EngineSettings(tp=dtp, block_size=block))
    s = make_setup(plan, isl=isl, max_rank_bytes=512 << 20)
    t0 = time.perf_counter()
    res = run_nixl(s, repeat=repeat, device=pl, bench=variants)
    wall = time.perf_counter() - t0
    est = estimate_request(plan.transfer_for(isl), entry)
    ranks = []
    for r, e in zip(res, est.per_rank, strict=True):
        b = r.bench
        assert b is not None and r.read_times_s and r.ucx is not None
        warm = b["rehearsal"]["read_times_s"]
        ranks.append({
            "rank": r.rank, "ok": r.ok, "mismatches": list(r.mismatches[:3]), "bytes": r.moved_bytes,
            "descriptors": r.moved_descriptors, "reads": r.reads,
            "rehearsal_s": statistics.median(warm), "rehearsal_first_s": r.read_times_s[0],
            "bare_s": statistics.median(b["bare"]["read_times_s"]),
            "coalesced_s": statistics.median(b["coalesced"]["read_times_s"]),
            "coalesced_descriptors": b["coalesced"]["descriptors"],
            "variants_identical": b["bare"]["identical"] and b["coalesced"]["identical"],
            "estimate_s": e.seconds, "ucx": r.ucx.as_dict()})
    req = max(x["rehearsal_s"] for x in ranks)
    return {"case": label, "model": plan.model.model_id, "ptp": ptp, "dtp": dtp, "block_size": s.p.block_size,
            "isl": isl, "num_blocks": s.n_log, "wall_s": wall, "ok": all(x["ok"] for x in ranks), "ranks": ranks,
            "request_s": req, "estimate_request_s": est.request_s,
            "bare_request_s": max(x["bare_s"] for x in ranks),
            "coalesced_request_s": max(x["coalesced_s"] for x in ranks)}


def conversion(pl: Any, nbytes: int, repeat: int) -> dict[str, Any]:
    import torch

    from hybridpd.convert.gpu_transpose import DS, SD, VARIANTS, channel_copy
    from hybridpd.core.families import model_spec
    from hybridpd.core.models import resolve

    dims = model_spec(resolve("super")).mamba
    assert dims is not None
    L = dims.conv_kernel - 1
    C = dims.intermediate_size + 2 * dims.n_groups * dims.state_size
    q = dims.intermediate_size // 4  # --tp-split 4: rank 1's quarter of x, SD -> DS shard
    rows = max(1, nbytes // (L * C * 2))
    dev = torch.device(pl.d)
    torch.cuda.set_device(dev)
    sd = torch.randint(-32768, 32767, (rows, L, C), dtype=torch.int16, device=dev)
    ds = torch.empty(rows, C, L, dtype=torch.int16, device=dev)
    back = torch.empty_like(sd)
    shard = torch.empty(rows, q, L, dtype=torch.int16, device=dev)
    out: dict[str, Any] = {"rows": rows, "L": L, "C": C, "bytes": sd.numel() * 2}
    out["d2d_s"] = best_time(partial(back.copy_, sd), repeat)
    out["torch_strided_s"] = best_time(partial(ds.copy_, sd.transpose(1, 2)), repeat)
    for v in VARIANTS:
        out[f"sd_to_ds_{v}_s"] = best_time(partial(channel_copy, ds, DS, 0, sd, SD, 0, C, variant=v), repeat)
        assert torch.equal(ds, sd.transpose(1, 2)), f"{v}: SD->DS wrong"
        out[f"ds_to_sd_{v}_s"] = best_time(partial(channel_copy, back, SD, 0, ds, DS, 0, C, variant=v), repeat)
        assert torch.equal(back, sd), f"{v}: DS->SD wrong"
        out[f"slice_{v}_s"] = best_time(partial(channel_copy, shard, DS, 0, sd, SD, q, q, variant=v), repeat)
        assert torch.equal(shard, sd[:, :, q:2 * q].transpose(1, 2)), f"{v}: slice wrong"
        out[f"slice_{v}_bytes"] = shard.numel() * 2
    del sd, ds, back, shard
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cuda:N,M (P ranks on N, D ranks on M)")
    ap.add_argument("--out", default="bench-gpu-out", help="folder for bench_gpu.json and calibration.json")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and smaller sweeps")
    ap.add_argument("--regions", default="8",
                    help="comma list: registered allocations per side in the calibration sweep (a KV cache has one "
                         "per layer-slot tensor, 6-8 for Nemotron-3); the last one listed is written as the calibration")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ceiling,calibrate,rehearse,convert")
    a = ap.parse_args()
    from hybridpd.core.estimate import parse_calibration
    from hybridpd.verify.nixl_agent import parse_device

    pl = parse_device(a.device)
    skip = set(filter(None, a.skip.split(",")))
    rep = 5 if a.quick else 20
    cmd = "python bench/bench_gpu.py " + " ".join(sys.argv[1:])
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": cmd, "device": a.device, "host": platform.node(),
                           "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}}

    def dump() -> None:
        (outdir / "bench_gpu.json").write_text(json.dumps(res, indent=1))

    if "ceiling" not in skip:
        res["ceiling"] = cl = ceiling(pl, 1 << 30, rep)
        print(f"[ceiling] {cl['gpu']}: {'device' if pl.on_gpu else 'memory'} copy {cl['d2d_GBps']:.0f} GB/s (1 GiB, best of {rep})"
              + (f"; peer copy {pl.p}->{pl.d} {cl['peer_GBps']:.0f} GB/s" if "peer_GBps" in cl else ""), flush=True)
        ceil = cl.get("peer_GBps", cl["d2d_GBps"]) * 1e9
        dump()
    else:
        ceil = float("nan")
    entry_dict = None
    if "calibrate" not in skip:
        res["sweeps"] = {}
        for k in [int(x) for x in a.regions.split(",")]:  # the last one listed becomes the calibration
            entry_dict, rows = calibrate(pl, a.quick, cmd, ceil, k)
            res["sweeps"][k] = {"rows": rows, "entry": entry_dict}
            for r in rows:
                t = statistics.median(r["times_s"])
                print(f"[sweep {k} region(s)] {r['descriptor_bytes'] >> 10:>5} KiB x {r['descriptors']:>5}: "
                      f"{t * 1e3:8.3f} ms {r['bytes'] / t / 1e9:8.2f} GB/s ({r['bytes'] / t / ceil:.1%} of ceiling), "
                      f"{t / r['descriptors'] * 1e6:.2f} us/desc", flush=True)
            print(f"[fit {k} region(s)] c = {entry_dict['per_descriptor_us']} us/descriptor, "
                  f"bw = {entry_dict['bandwidth_gbps']} GB/s ({entry_dict['fit']})", flush=True)
        dump()
    if "rehearse" not in skip:
        from hybridpd.core.estimate import load_calibration, select

        if entry_dict is not None:
            entry = parse_calibration({"schema": "hybridpd-calibration/1", "entries": [entry_dict]}, source="bench")[0]
        else:
            entry = select(load_calibration(), platform="cuda" if pl.on_gpu else "cpu")
        res["cases"] = []
        for case in CASES:
            r = rehearse(pl, case, 6 if a.quick else 12, entry)
            res["cases"].append(r)
            tr = sorted({t for x in r["ranks"] for t in x["ucx"]["read_transports"]})
            ops = sorted({t for x in r["ranks"] for t in x["ucx"]["read_operations"]})
            b = sum(x["bytes"] for x in r["ranks"]) / len(r["ranks"])
            print(f"[rehearse] {r['case']} ISL {r['isl']} block {r['block_size']}: {'PASS' if r['ok'] else 'FAIL'}, "
                  f"variants identical {all(x['variants_identical'] for x in r['ranks'])}, UCX {tr} {ops}", flush=True)
            for x in r["ranks"]:
                print(f"    D rank {x['rank']}: {x['bytes']:,} B, {x['descriptors']} descs, {x['reads']} READs: "
                      f"rehearsal {x['rehearsal_s'] * 1e3:.3f} ms ({x['bytes'] / x['rehearsal_s'] / 1e9:.2f} GB/s, "
                      f"{x['bytes'] / x['rehearsal_s'] / ceil:.2%} of ceiling), bare {x['bare_s'] * 1e3:.3f} ms "
                      f"(rehearsal/bare speed {x['bare_s'] / x['rehearsal_s']:.1%}), coalesced "
                      f"{x['coalesced_descriptors']} descs {x['coalesced_s'] * 1e3:.3f} ms, estimate "
                      f"{x['estimate_s'] * 1e3:.3f} ms (measured/estimate {x['rehearsal_s'] / x['estimate_s']:.2f}), "
                      f"cold {x['rehearsal_first_s'] * 1e3:.1f} ms", flush=True)
            print(f"    request (slowest rank): rehearsal {r['request_s'] * 1e3:.3f} ms, bare {r['bare_request_s'] * 1e3:.3f}"
                  f" ms, coalesced {r['coalesced_request_s'] * 1e3:.3f} ms, estimate {r['estimate_request_s'] * 1e3:.3f} ms"
                  f" -> measured/estimate {r['request_s'] / r['estimate_request_s']:.2f}; per-rank mean {b:,.0f} B",
                  flush=True)
            dump()
    if entry_dict is not None:
        (outdir / "calibration.json").write_text(json.dumps({"schema": "hybridpd-calibration/1",
                                                             "entries": [entry_dict]}, indent=1) + "\n")
    if "convert" not in skip and pl.on_gpu:
        res["convert"] = cv = conversion(pl, 1 << 30, rep)
        base = cv["d2d_s"]
        print(f"[convert] conv state {cv['rows']} x {cv['L']} x {cv['C']} int16 ({cv['bytes'] / 2**30:.2f} GiB): device "
              f"copy {cv['bytes'] / base / 1e9:.0f} GB/s; torch strided transpose {base / cv['torch_strided_s']:.2f}x",
              flush=True)
        for k in [k for k in cv if k.endswith("_s") and k not in ("d2d_s", "torch_strided_s")]:
            nb = cv.get(k[:-2] + "_bytes", cv["bytes"])
            print(f"    {k[:-2]}: {nb / cv[k] / 1e9:.0f} GB/s = {(nb / cv[k]) / (cv['bytes'] / base):.2f}x of device copy",
                  flush=True)
        dump()
    dump()


if __name__ == "__main__":
    main()
