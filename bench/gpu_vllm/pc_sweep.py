"""pc_sweep.py -- P/D requests against a live vLLM pair with prefix caching on or off; what D's vLLM reports.

  python pc_sweep.py --prefill URL --decode URL --isls 50,100,200 --repeats 3 --out FILE.json [--seed 0]

Cold requests: every prompt is fresh random token ids (3..1002, seeded per request), so no earlier request, on P or
D, shares a single block with it: a request moves what a cold request moves, whatever prefix caching does. Then the
repeat probes: one fresh 1000-token prompt sent three times, and a prompt sharing its first 600 tokens.
Per request: P's kv_transfer_params (remote_num_tokens, blocks per group), and the deltas of D's /metrics series
vllm:nixl_* (bytes, descriptors, transfers, xfer/post time), vllm:prefix_cache_*, vllm:prompt_tokens_*.
Protocol as vLLM's toy proxy: P with max_tokens=1 and do_remote_decode, then D with P's kv_transfer_params.
Stdlib only. No expectations here: the plan is compared afterwards (tests/test_h200_prefix_caching.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import tempfile
import time
import urllib.request
from typing import Any

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
KEEP = ("vllm:nixl_", "vllm:prefix_cache_", "vllm:prompt_tokens", "vllm:external_prefix_cache_")
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read().decode()))


def snapshot(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        m = LINE.match(ln.strip())
        if not m or not m.group(1).startswith(KEEP) or m.group(1).endswith(("_bucket", "_created")):
            continue
        labels = re.sub(r'(engine|model_name)="[^"]*",?', "", (m.group(2) or "")[1:-1]).strip(",")
        key = m.group(1) + ("{" + labels + "}" if labels else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def one(a: argparse.Namespace, model: str, prompt: list[int], label: str) -> dict[str, Any]:
    before = snapshot(a.decode)
    p = post(a.prefill, {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_PARAMS)})
    kv = p.get("kv_transfer_params") or {}
    d = post(a.decode, {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv})
    after = snapshot(a.decode)
    t0 = time.monotonic()
    n = "vllm:nixl_xfer_time_seconds_count"
    while after.get(n, 0) == before.get(n, 0) and time.monotonic() - t0 < a.settle_s:
        time.sleep(0.05)
        after = snapshot(a.decode)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    g = lambda k: delta.get(k, 0.0)  # noqa: E731
    blocks = kv.get("remote_block_ids")
    return {"label": label, "isl": len(prompt), "bytes": g("vllm:nixl_bytes_transferred_sum"),
            "transfers": g("vllm:nixl_bytes_transferred_count"), "descriptors": g("vllm:nixl_num_descriptors_sum"),
            "xfer_s": g("vllm:nixl_xfer_time_seconds_sum"), "post_s": g("vllm:nixl_post_time_seconds_sum"),
            "failed": g("vllm:nixl_num_failed_transfers_total"),
            "remote_num_tokens": kv.get("remote_num_tokens"),
            "remote_blocks_per_group": [len(b) for b in blocks] if isinstance(blocks, list) and blocks
            and isinstance(blocks[0], list) else (len(blocks) if isinstance(blocks, list) else None),
            "d_usage": d.get("usage"), "d_text": (d.get("choices") or [{}])[0].get("text"),
            "metric_deltas": {k: v for k, v in sorted(delta.items()) if v}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--isls", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--no-repeat-probes", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with urllib.request.urlopen(a.decode.rstrip("/") + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    counter = [0]

    def fresh(n: int) -> list[int]:
        counter[0] += 1
        rng = random.Random(a.seed * 1_000_003 + counter[0])
        return [rng.randrange(3, 1003) for _ in range(n)]

    rows: list[dict[str, Any]] = []
    one(a, model, fresh(100), "warmup")
    for rep in range(a.repeats):  # interleaved: a slow spell hits every length alike
        for isl in (int(x) for x in a.isls.split(",")):
            r = one(a, model, fresh(isl), f"cold-{rep}")
            rows.append(r)
            print(json.dumps({k: r[k] for k in ("label", "isl", "bytes", "descriptors", "transfers",
                                                "remote_blocks_per_group")}), flush=True)
    if not a.no_repeat_probes:
        base = fresh(1000)
        for i in range(3):
            rows.append(one(a, model, base, f"same-1000-#{i + 1}"))
        rows.append(one(a, model, base[:600] + fresh(400), "shared-600-of-1000"))
        for r in rows[-4:]:
            print(json.dumps({k: r[k] for k in ("label", "isl", "bytes", "descriptors", "remote_num_tokens",
                                                "remote_blocks_per_group")}), flush=True)
    doc = {"model": model, "repeats": a.repeats, "seed": a.seed, "rows": rows}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(a.out)) or ".")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
