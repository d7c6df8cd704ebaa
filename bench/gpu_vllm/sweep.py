"""Probe a live P/D pair at several prompt lengths; record what D's vLLM reports per request.

  python bench/gpu_vllm/sweep.py --decode URL --prefill URL --isls 1000,2000,4000 --repeats 5 --out FILE.json
      [--model NAME] [--warmup 1000]

One request at a time, exactly as `hybridpd verify --prefill` sends it (P with do_remote_decode, then D with
P's kv_transfer_params; prompt = hybridpd.verify.live.prompt_ids(isl)); D's /metrics is read before and after and the
deltas kept per request: NIXL bytes, descriptors, transfers, failures, and vLLM's own
``vllm:nixl_xfer_time_seconds`` / ``vllm:nixl_post_time_seconds`` sums. No expectations here: the plan is compared
afterwards (bench/gpu_vllm/analyze.py). Stdlib + hybridpd (+ prometheus_client for the metrics parser).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from hybridpd.verify import live, metrics

KEYS = {"bytes": "vllm:nixl_bytes_transferred_sum", "transfers": "vllm:nixl_bytes_transferred_count",
        "descriptors": "vllm:nixl_num_descriptors_sum", "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
        "xfer_n": "vllm:nixl_xfer_time_seconds_count", "post_s": "vllm:nixl_post_time_seconds_sum",
        "failed": "vllm:nixl_num_failed_transfers_total"}


def one(decode: str, prefill: str, model: str, isl: int, settle_s: float = 3.0) -> dict[str, float]:
    before = metrics.snapshot(decode)
    t = time.monotonic()
    live.send_probe(decode, prefill, model, isl, proxy=False, token_ids=True, timeout=300)
    wall = time.monotonic() - t
    after = metrics.snapshot(decode)
    t0 = time.monotonic()
    while after.get(KEYS["xfer_n"], 0) == before.get(KEYS["xfer_n"], 0) and time.monotonic() - t0 < settle_s:
        time.sleep(0.05)
        after = metrics.snapshot(decode)
    d = metrics.delta(before, after)
    row = {k: d.get(v, 0.0) for k, v in KEYS.items()}
    row["isl"] = isl
    row["request_wall_s"] = wall
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--model", default=None, help="served model name (default: D's first /v1/models id)")
    ap.add_argument("--isls", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=0, help="one unrecorded request of this length first")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = a.model
    if model is None:
        import urllib.request

        with urllib.request.urlopen(a.decode.rstrip("/") + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
    if a.warmup:
        one(a.decode, a.prefill, model, a.warmup)
    rows = []
    for _ in range(a.repeats):  # interleaved: a slow spell hits every length alike
        for isl in (int(x) for x in a.isls.split(",")):
            r = one(a.decode, a.prefill, model, isl)
            rows.append(r)
            print(json.dumps(r), flush=True)
    doc = {"decode": a.decode, "prefill": a.prefill, "model": model, "repeats": a.repeats, "rows": rows}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(a.out)) or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
