"""vLLM /metrics: parse, snapshot, diff, and compare NIXL counters with the plan.

vLLM pools these counters across TP ranks (and engines) on one server: the D server's
``vllm:nixl_bytes_transferred_sum`` is the sum over all of its ranks' READs, so it is compared with the
plan's total over D ranks, never with one rank.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NIXL_SERIES = (
    "vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count", "vllm:nixl_num_descriptors_sum",
    "vllm:nixl_num_descriptors_count", "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total", "vllm:nixl_num_kv_expired_reqs_total",
)
FAILURE_SERIES = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total",
                  "vllm:nixl_num_kv_expired_reqs_total")
PROMPT_HIST = "vllm:request_prompt_tokens_bucket"
POOLING_NOTE = ("vLLM pools NIXL metrics across the TP ranks of one server: deltas are compared with the plan's "
                "total over all D ranks, not per rank")


def parse(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (``*_created`` skipped). Histogram buckets keep ``le``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            key = s.name
            if s.name.endswith("_bucket") and "le" in s.labels:
                key = f"{s.name}{{le={s.labels['le']}}}"
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def fetch(req: str | urllib.request.Request, timeout: float) -> bytes:
    """GET/POST a deployment URL; an unreachable or failing server is a clear failure, never a traceback."""
    from hybridpd.errors import ExternalToolError

    url = req if isinstance(req, str) else req.full_url
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - user-given URL
            return bytes(r.read())
    except urllib.error.HTTPError as e:
        raise ExternalToolError(f"{url} answered HTTP {e.code} {e.reason}",
                                fix="check the server's log; is the model name and URL right?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ExternalToolError(f"cannot reach {url}: {reason}",
                                fix="check the URL and that the server is up (`hybridpd serve` prints its URLs)") from None


def snapshot(url: str, timeout: float = 10.0) -> dict[str, float]:
    return parse(fetch(f"{url.rstrip('/')}/metrics", timeout).decode())


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


@dataclass(frozen=True)
class Expected:
    bytes: int
    descriptors_min: int
    descriptors: int
    reads: int


def expected_for(plan: Any, isl: int) -> Expected:
    t = plan.transfer_for(isl)
    return Expected(bytes=t.bytes, descriptors_min=t.descriptors_min, descriptors=t.descriptors, reads=t.reads)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """D's NIXL counter deltas over one (or ``requests``) probe(s) against the plan's prediction."""

    expected_bytes: int
    moved_bytes: int
    expected_descriptors: int
    expected_descriptors_min: int
    moved_descriptors: int
    expected_transfers: int
    transfers: int
    failures: Mapping[str, int]
    mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        return {"expected_bytes": self.expected_bytes, "moved_bytes": self.moved_bytes,
                "expected_descriptors": self.expected_descriptors,
                "expected_descriptors_min": self.expected_descriptors_min, "moved_descriptors": self.moved_descriptors,
                "expected_transfers": self.expected_transfers, "transfers": self.transfers,
                "failures": dict(self.failures), "mismatches": list(self.mismatches), "ok": self.ok}


def compare(d: dict[str, float], exp: Expected, *, plan_ok: bool = True, plan_errors: list[str] | None = None,
            requests: int = 1) -> Comparison:
    """Deltas of one (or ``requests``) probe(s) against the plan. ``ok`` unless there are mismatches."""
    moved = int(round(d.get("vllm:nixl_bytes_transferred_sum", 0.0)))
    count = int(round(d.get("vllm:nixl_bytes_transferred_count", 0.0)))
    descs = int(round(d.get("vllm:nixl_num_descriptors_sum", 0.0)))
    fails = {k: int(round(d.get(k, 0.0))) for k in FAILURE_SERIES}
    mism: list[str] = []
    if moved != exp.bytes * requests:
        mism.append(f"bytes: moved {moved:,}, plan predicts {exp.bytes * requests:,}")
    if not exp.descriptors_min * requests <= descs <= exp.descriptors * requests:
        mism.append(f"descriptors: {descs}, plan predicts [{exp.descriptors_min * requests}, "
                    f"{exp.descriptors * requests}]")
    if count != exp.reads * requests:
        mism.append(f"transfers: {count} READs, plan predicts {exp.reads * requests}")
    for k, v in fails.items():
        if v:
            mism.append(f"{k} rose by {v}")
    if not plan_ok:
        mism.append("the plan has error findings (" + "; ".join(plan_errors or []) + "): not healthy even if the "
                    "counters match")
    return Comparison(expected_bytes=exp.bytes * requests, moved_bytes=moved,
                      expected_descriptors=exp.descriptors * requests,
                      expected_descriptors_min=exp.descriptors_min * requests, moved_descriptors=descs,
                      expected_transfers=exp.reads * requests, transfers=count, failures=fails,
                      mismatches=tuple(mism))


def prompt_histogram(d: dict[str, float]) -> list[tuple[float, float]]:
    """(upper bound, count in bucket) from a delta of cumulative ``le`` buckets, in order."""
    pts: list[tuple[float, float]] = []
    for k, v in d.items():
        if k.startswith(PROMPT_HIST + "{le="):
            le_s = k[len(PROMPT_HIST) + 4:-1]
            pts.append((math.inf if le_s in ("+Inf", "inf") else float(le_s), v))
    pts.sort()
    out: list[tuple[float, float]] = []
    prev = 0.0
    for le, cum in pts:
        out.append((le, cum - prev))
        prev = cum
    return out


def passive_bounds(plan: Any, hist: list[tuple[float, float]], max_len: int) -> tuple[int, int, int]:
    """(requests, lower, upper) bytes the plan predicts for requests whose prompt lengths fall in the buckets."""
    lo = hi = 0
    n = 0
    prev = 0.0
    for le, cnt in hist:
        c = int(round(cnt))
        if c <= 0:
            prev = le
            continue
        a = max(1, int(prev) + 1)
        b = int(min(le, max_len))
        b = max(a, b)
        lo += c * plan.transfer_for(a).bytes
        hi += c * plan.transfer_for(b).bytes
        n += c
        prev = le
    return n, lo, hi
