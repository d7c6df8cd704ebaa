"""Compare what the GPU runs measured with `hybridpd plan`, fit the engine-time calibration, draw Figure 1.

  python bench/gpu_vllm/analyze.py RUN_DIR[,RUN_DIR...] [--fit] [--entry-out FILE] [--figure PNG] [--md FILE]

Each RUN_DIR holds ``plan.json`` (`hybridpd plan ... --isl L1,L2,.. --json`, same settings as the servers) and
``sweep.json`` (bench/gpu_vllm/sweep.py). Per length: the plan's bytes/descriptors against every measured request
(they must be equal), vLLM's reported transfer time (median, min, max of ``vllm:nixl_xfer_time_seconds``) and post
time. ``--fit`` fits ``reads*t0 + n_desc*c + bytes/bw`` (hybridpd.core.estimate.fit_engine_calibration) to the medians
of all runs given and reports, per length, the in-sample ratio and the leave-one-length-out ratio (fitted without
that length). ``--figure``: bytes per request vs input length, naive (padded pages) vs plan vs measured, every
length of every RUN_DIR given. The expected values are the plan's; nothing here is compared with itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from hybridpd.core.estimate import fit_engine_calibration


def load(run: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    plan = json.loads((run / "plan.json").read_text())
    rows = json.loads((run / "sweep.json").read_text())["rows"]
    return plan, rows


def per_length(run: Path) -> list[dict[str, Any]]:
    plan, rows = load(run)
    out = []
    for t in plan["transfer"]:
        got = [r for r in rows if r["isl"] == t["isl"]]
        if not got:
            continue
        xfer = [r["xfer_s"] / max(r["xfer_n"], 1) for r in got]
        post = [r["post_s"] / max(r["xfer_n"], 1) for r in got]
        out.append({"run": run.parent.name if run.name == "logs" else run.name, "isl": t["isl"], "n": len(got), "reads": t["reads"],
                    "plan_bytes": t["bytes"], "plan_descriptors": t["descriptors"], "naive_bytes": t["naive_bytes"],
                    "plan_descriptors_min": t["descriptors_min"],
                    "bytes": sorted({int(r["bytes"]) for r in got}), "descriptors": sorted({int(r["descriptors"]) for r in got}),
                    "transfers": sorted({int(r["transfers"]) for r in got}), "failed": sum(r["failed"] for r in got),
                    "exact": all(int(r["bytes"]) == t["bytes"] and int(r["descriptors"]) == t["descriptors"]
                                 and int(r["transfers"]) == t["reads"] for r in got),
                    "bytes_exact": all(int(r["bytes"]) == t["bytes"] and int(r["transfers"]) == t["reads"] for r in got),
                    "descriptors_in_bounds": all(t["descriptors_min"] <= int(r["descriptors"]) <= t["descriptors"]
                                                 for r in got),
                    "xfer_median_s": statistics.median(xfer), "xfer_min_s": min(xfer), "xfer_max_s": max(xfer),
                    "post_median_s": statistics.median(post),
                    "plan_estimate_s": (t.get("estimate") or {}).get("request_s")})
    return out


def _fit_fixed_bw(pts: list[dict[str, Any]], bw: float) -> tuple[float, float, float, float, float]:
    """t0 and c with bw given: relative least squares of ``reads*t0 + n*c = t - bytes/bw`` (weight 1/t²)."""
    rows = [(p["reads"] / p["xfer_median_s"], p["plan_descriptors"] / p["xfer_median_s"],
             1.0 - p["plan_bytes"] / bw / p["xfer_median_s"]) for p in pts]
    aa = sum(a * a for a, _, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ay = sum(a * y for a, _, y in rows)
    by = sum(b * y for _, b, y in rows)
    det = aa * bb - ab * ab
    t0, c = (ay * bb - by * ab) / det, (aa * by - ab * ay) / det
    if t0 < 0 or c < 0:
        raise ValueError("fixed-bw fit left the non-negative quadrant")
    rel = [(p["reads"] * t0 + p["plan_descriptors"] * c + p["plan_bytes"] / bw) / p["xfer_median_s"] - 1 for p in pts]
    w = [1.0 / p["xfer_median_s"] ** 2 for p in pts]
    mean = sum(wi * p["xfer_median_s"] for wi, p in zip(w, pts, strict=True)) / sum(w)
    ss_tot = sum(wi * (p["xfer_median_s"] - mean) ** 2 for wi, p in zip(w, pts, strict=True))
    r2 = 1.0 - sum(x * x for x in rel) / ss_tot if ss_tot > 0 else 1.0
    return t0, c, bw, r2, max(abs(x) for x in rel)


def fit(points: list[dict[str, Any]], bw_gbps: float | None = None) -> dict[str, Any]:
    def f(pts: list[dict[str, Any]]) -> tuple[float, float, float, float, float]:
        if bw_gbps is not None:
            return _fit_fixed_bw(pts, bw_gbps * 1e9)
        return fit_engine_calibration([(p["reads"], p["plan_descriptors"], p["plan_bytes"], p["xfer_median_s"]) for p in pts])

    t0, c, bw, r2, mx = f(points)
    for p in points:
        p["fit_s"] = p["reads"] * t0 + p["plan_descriptors"] * c + p["plan_bytes"] / bw
        p["fit_ratio"] = p["xfer_median_s"] / p["fit_s"]
        rest = [q for q in points if (q["run"], q["isl"]) != (p["run"], p["isl"])]
        a0, ac, abw, _, _ = f(rest)
        p["loo_ratio"] = p["xfer_median_s"] / (p["reads"] * a0 + p["plan_descriptors"] * ac + p["plan_bytes"] / abw)
    return {"per_read_us": t0 * 1e6, "per_descriptor_us": c * 1e6, "bandwidth_gbps": bw / 1e9, "r2": r2,
            "max_rel_err": mx, "points": len(points), "bandwidth_fixed": bw_gbps is not None}


def check(points: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Ratio measured median / the given entry's estimate (out of sample when the entry was fitted elsewhere)."""
    t0, c, bw = entry["per_read_us"] * 1e-6, entry["per_descriptor_us"] * 1e-6, entry["bandwidth_gbps"] * 1e9
    for p in points:
        p["check_ratio"] = p["xfer_median_s"] / (p["reads"] * t0 + p["plan_descriptors"] * c + p["plan_bytes"] / bw)


def figure(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["isl"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    ax.plot(x, [r["naive_bytes"] / 2**20 for r in rows], "s--", color="tab:red", label="naive (padded pages)")
    ax.plot(x, [r["plan_bytes"] / 2**20 for r in rows], "o-", color="tab:blue", label="optimal (hybridpd plan)")
    for r in rows:
        ax.plot([r["isl"]] * len(r["bytes"]), [b / 2**20 for b in r["bytes"]], "x", color="black", ms=9,
                label="measured (vLLM D /metrics)" if r is rows[0] else None)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v / 1000:g}k" if v >= 1000 else str(v) for v in x])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("KV bytes per request P→D (MiB)")
    fig.suptitle(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    # the padding the plan skips is small next to the state itself: show it on its own axis
    ax2.plot(x, [(r["naive_bytes"] - r["plan_bytes"]) / 2**10 for r in rows], "o-", color="tab:blue",
             label="naive − optimal (plan)")
    for r in rows:
        ax2.plot([r["isl"]] * len(r["bytes"]), [(r["naive_bytes"] - b) / 2**10 for b in r["bytes"]], "x", color="black",
                 ms=9, label="naive − measured" if r is rows[0] else None)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(x, [f"{v / 1000:g}k" if v >= 1000 else str(v) for v in x])
    ax2.set_xlabel("input length (tokens)")
    ax2.set_ylabel("HMA padding not sent (KiB per request)")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png)


def _match(r: dict[str, Any]) -> str:
    if r["exact"]:
        return "exact"
    return "bytes exact, desc in bounds" if r["bytes_exact"] and r["descriptors_in_bounds"] else "NO"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--fix-bw", type=float, default=None, metavar="GBPS", help="fit t0 and c with bw fixed")
    ap.add_argument("--check", type=Path, default=None, metavar="ENTRY.json",
                    help="ratio of every median to this calibration entry's estimate")
    ap.add_argument("--figure", type=Path)
    ap.add_argument("--title", default="Nemotron-3-Nano-30B-A3B, P→D bytes per request")
    ap.add_argument("--json", dest="json_out", type=Path)
    a = ap.parse_args()
    rows = [r for run in a.runs.split(",") for r in per_length(Path(run))]
    res: dict[str, Any] = {"rows": rows}
    if a.fit:
        res["fit"] = fit(rows, a.fix_bw)
    if a.check:
        check(rows, json.loads(a.check.read_text()))
    hdr = ("| run | ISL | n | plan bytes | measured bytes | plan desc (min–max) | measured desc | match "
           "| vLLM xfer median (min–max) | post median | plan est. |")
    if a.fit:
        hdr += " fit ratio | leave-one-out ratio |"
    if a.check:
        hdr += " measured / entry |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        est = r["plan_estimate_s"]
        line = (f"| {r['run']} | {r['isl']:,} | {r['n']} | {r['plan_bytes']:,} | {', '.join(f'{b:,}' for b in r['bytes'])} | "
                f"{r['plan_descriptors_min']:,}–{r['plan_descriptors']:,} | {', '.join(f'{d:,}' for d in r['descriptors'])} | "
                f"{_match(r)} | "
                f"{r['xfer_median_s'] * 1e6:,.0f} µs ({r['xfer_min_s'] * 1e6:,.0f}–{r['xfer_max_s'] * 1e6:,.0f}) | "
                f"{r['post_median_s'] * 1e6:,.0f} µs | {'-' if est is None else f'{est * 1e6:,.0f} µs'} |")
        if a.fit:
            line += f" {r['fit_ratio']:.3f} | {r['loo_ratio']:.3f} |"
        if a.check:
            line += f" {r['check_ratio']:.3f} |"
        print(line)
    if a.fit:
        print("fit:", json.dumps(res["fit"]))
    if a.figure:
        figure(sorted(rows, key=lambda r: r["isl"]), a.figure, a.title)
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
