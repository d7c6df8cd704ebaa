"""Compare what the GPU runs measured with `hybridpd plan`, fit the engine-time calibration, draw Figure 1.

  python bench/gpu_vllm/analyze.py RUN_DIR[,RUN_DIR...] [--fit] [--entry-out FILE] [--figure PNG] [--md FILE]

Each RUN_DIR holds ``plan.json`` (`hybridpd plan ... --isl L1,L2,.. --json`, same settings as the servers) and
``sweep.json`` (bench/gpu_vllm/sweep.py). Per length: the plan's bytes/descriptors against every measured request
(they must be equal), vLLM's reported transfer time (median, min, max of ``vllm:nixl_xfer_time_seconds``) and post
time. ``--fit`` fits ``reads*t0 + n_desc*c + bytes/bw`` (hybridpd.estimate.fit_engine_calibration) to the medians
of all runs given and reports, per length, the in-sample ratio and the leave-one-length-out ratio (fitted without
that length). ``--figure``: bytes per request vs input length, naive (padded pages) vs plan vs measured, for the
first RUN_DIR. The expected values are the plan's; nothing here is compared with itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from hybridpd.estimate import fit_engine_calibration


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
                    "bytes": sorted({int(r["bytes"]) for r in got}), "descriptors": sorted({int(r["descriptors"]) for r in got}),
                    "transfers": sorted({int(r["transfers"]) for r in got}), "failed": sum(r["failed"] for r in got),
                    "exact": all(int(r["bytes"]) == t["bytes"] and int(r["descriptors"]) == t["descriptors"]
                                 and int(r["transfers"]) == t["reads"] for r in got),
                    "xfer_median_s": statistics.median(xfer), "xfer_min_s": min(xfer), "xfer_max_s": max(xfer),
                    "post_median_s": statistics.median(post),
                    "plan_estimate_s": (t.get("estimate") or {}).get("request_s")})
    return out


def fit(points: list[dict[str, Any]]) -> dict[str, Any]:
    def f(pts: list[dict[str, Any]]) -> tuple[float, float, float, float, float]:
        return fit_engine_calibration([(p["reads"], p["plan_descriptors"], p["plan_bytes"], p["xfer_median_s"]) for p in pts])

    t0, c, bw, r2, mx = f(points)
    for p in points:
        p["fit_s"] = p["reads"] * t0 + p["plan_descriptors"] * c + p["plan_bytes"] / bw
        p["fit_ratio"] = p["xfer_median_s"] / p["fit_s"]
        rest = [q for q in points if (q["run"], q["isl"]) != (p["run"], p["isl"])]
        a0, ac, abw, _, _ = f(rest)
        p["loo_ratio"] = p["xfer_median_s"] / (p["reads"] * a0 + p["plan_descriptors"] * ac + p["plan_bytes"] / abw)
    return {"per_read_us": t0 * 1e6, "per_descriptor_us": c * 1e6, "bandwidth_gbps": bw / 1e9, "r2": r2,
            "max_rel_err": mx, "points": len(points)}


def figure(rows: list[dict[str, Any]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["isl"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(x, [r["naive_bytes"] / 2**20 for r in rows], "s--", color="tab:red", label="naive (padded pages)")
    ax.plot(x, [r["plan_bytes"] / 2**20 for r in rows], "o-", color="tab:blue", label="optimal (hybridpd plan)")
    for r in rows:
        ax.plot([r["isl"]] * len(r["bytes"]), [b / 2**20 for b in r["bytes"]], "x", color="black", ms=9,
                label="measured (vLLM D /metrics)" if r is rows[0] else None)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v // 1000}k" if v >= 1000 else str(v) for v in x])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("KV bytes per request P→D (MiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--figure", type=Path)
    ap.add_argument("--title", default="Nemotron-3-Nano-30B-A3B, P→D bytes per request")
    ap.add_argument("--json", dest="json_out", type=Path)
    a = ap.parse_args()
    rows = [r for run in a.runs.split(",") for r in per_length(Path(run))]
    res: dict[str, Any] = {"rows": rows}
    if a.fit:
        res["fit"] = fit(rows)
    hdr = ("| run | ISL | n | plan bytes | measured bytes | plan desc | measured desc | exact "
           "| vLLM xfer median (min–max) | post median | plan est. |")
    if a.fit:
        hdr += " fit ratio | leave-one-out ratio |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in rows:
        est = r["plan_estimate_s"]
        line = (f"| {r['run']} | {r['isl']:,} | {r['n']} | {r['plan_bytes']:,} | {', '.join(f'{b:,}' for b in r['bytes'])} | "
                f"{r['plan_descriptors']:,} | {', '.join(f'{d:,}' for d in r['descriptors'])} | {'yes' if r['exact'] else 'NO'} | "
                f"{r['xfer_median_s'] * 1e6:,.0f} µs ({r['xfer_min_s'] * 1e6:,.0f}–{r['xfer_max_s'] * 1e6:,.0f}) | "
                f"{r['post_median_s'] * 1e6:,.0f} µs | {'-' if est is None else f'{est * 1e6:,.0f} µs'} |")
        if a.fit:
            line += f" {r['fit_ratio']:.3f} | {r['loo_ratio']:.3f} |"
        print(line)
    if a.fit:
        print("fit:", json.dumps(res["fit"]))
    if a.figure:
        first = a.runs.split(",")[0]
        figure([r for r in rows if r["run"] == Path(first).name], a.figure, a.title)
    if a.json_out:
        a.json_out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
