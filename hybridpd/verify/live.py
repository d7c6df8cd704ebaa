"""`verify --decode URL`: probe a running P/D deployment and diff D's NIXL counters against the plan.

One probe at a time: snapshot D's /metrics, send a prompt of exactly ``isl`` tokens (through the proxy,
or P with ``do_remote_decode`` then D with P's ``kv_transfer_params`` unchanged), snapshot again, diff.
vLLM pools the NIXL metrics across D's TP ranks, so the deltas are compared with the plan's total.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridpd.core.findings import errors
from hybridpd.core.layout import cdiv
from hybridpd.core.plan import max_model_len
from hybridpd.core.profiles import format_version
from hybridpd.kv_params import PREFILL_KV_TRANSFER_PARAMS
from hybridpd.verify import metrics


@dataclass(frozen=True, kw_only=True)
class LiveProbe:
    """One probe of ``isl`` prompt tokens: D's counter deltas against ``plan.transfer_for(isl)``."""

    isl: int
    tokens_transferred: int
    comparison: metrics.Comparison

    @property
    def ok(self) -> bool:
        return self.comparison.ok

    @property
    def mismatches(self) -> tuple[str, ...]:
        return self.comparison.mismatches

    def as_dict(self) -> dict[str, Any]:
        return {**self.comparison.as_dict(), "isl": self.isl, "tokens_transferred": self.tokens_transferred}


@dataclass(frozen=True, kw_only=True)
class LiveResult:
    """`verify --decode URL`: every probe's verdict; healthy when all are."""

    model: str
    decode: str
    via: str  # "proxy" or "prefill"
    note: str
    plan_errors: tuple[str, ...]
    probes: tuple[LiveProbe, ...]
    block_size: int
    block_sizes_not_told_apart: tuple[int, ...]

    mode: ClassVar[str] = "live"

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.probes)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "model": self.model, "decode": self.decode, "via": self.via, "note": self.note,
                "plan_errors": list(self.plan_errors), "probes": [p.as_dict() for p in self.probes],
                "block_size": self.block_size, "block_sizes_not_told_apart": list(self.block_sizes_not_told_apart),
                "ok": self.ok}


@dataclass(frozen=True, kw_only=True)
class PassiveResult:
    """`verify --passive`: counter deltas over a window against the plan's bounds for the prompt lengths seen
    (approximate: the lengths come from histogram buckets)."""

    window_s: float
    requests: int
    expected_bytes_min: int
    expected_bytes_max: int
    moved_bytes: int
    failures: Mapping[str, int]
    note: str
    plan_errors: tuple[str, ...]
    mismatches: tuple[str, ...]

    mode: ClassVar[str] = "passive"
    approximate: ClassVar[bool] = True

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "approximate": self.approximate, "window_s": self.window_s,
                "requests": self.requests, "expected_bytes_min": self.expected_bytes_min,
                "expected_bytes_max": self.expected_bytes_max, "moved_bytes": self.moved_bytes,
                "failures": dict(self.failures), "note": self.note, "plan_errors": list(self.plan_errors),
                "mismatches": list(self.mismatches), "ok": self.ok}


NONCE_TOKENS = 8  # 500**8 ≈ 4e21 starts: no earlier probe or request shares a probe's first block
_RNG = random.SystemRandom()


def new_nonce() -> list[int]:
    """A fresh random start for one probe prompt (per run and per probe), in the same id range as the filler."""
    return [_RNG.randrange(100, 600) for _ in range(NONCE_TOKENS)]


def prompt_ids(n: int, nonce: list[int] | None = None) -> list[int]:
    """``n`` token ids starting with ``nonce``: with prefix caching on, D can hold no block of it from an earlier
    probe, run or request (a fixed prompt would be served from D's cache and move fewer bytes on the next run)."""
    head = list(nonce or [])[:n]
    return head + [100 + i % 500 for i in range(len(head), n)]


def prompt_text(n: int, nonce: list[int] | None = None) -> str:
    head = "".join(f"{t:03d}" for t in (nonce or []))[:n]
    return head + "a" * (n - len(head))


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    raw = metrics.fetch(req, timeout)
    try:
        return dict(json.loads(raw.decode()))
    except (ValueError, TypeError):
        from hybridpd.errors import ExternalToolError

        raise ExternalToolError(f"{req.full_url} did not answer a JSON completion: {raw[:80]!r}",
                                fix="point --decode/--prefill/--proxy at vLLM's (or hybridpd's proxy's) HTTP port") from None


def send_probe(decode_url: str, other_url: str, model_name: str, isl: int, *, proxy: bool = False,
               token_ids: bool = True, timeout: float = 120.0) -> dict[str, Any]:
    nonce = new_nonce()
    prompt: Any = prompt_ids(isl, nonce) if token_ids else prompt_text(isl, nonce)
    if proxy:
        return {"proxy": _post(other_url, {"model": model_name, "prompt": prompt, "max_tokens": 1}, timeout)}
    p_body = {"model": model_name, "prompt": prompt, "max_tokens": 1,
              "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)}
    p_resp = _post(other_url, p_body, timeout)
    params = p_resp.get("kv_transfer_params")
    if params is None:
        raise RuntimeError("prefill returned no kv_transfer_params: is it running with NixlConnector?")
    d_resp = _post(decode_url, {"model": model_name, "prompt": prompt, "max_tokens": 1,
                                "kv_transfer_params": params}, timeout)
    return {"prefill": p_resp, "decode": d_resp}


def _plan_errors(plan: Any) -> list[str]:
    return [f"{f.code}: {f.message}" for f in errors(plan.findings)]


def run_probe(decode_url: str, other_url: str, plan: Any, isl: int, model_name: str, *, proxy: bool = False,
              token_ids: bool = True, settle_s: float = 0.5) -> LiveProbe:
    """One probe of ``isl`` tokens: D's metric deltas compared with plan.transfer_for(isl)."""
    before = metrics.snapshot(decode_url)
    send_probe(decode_url, other_url, model_name, isl, proxy=proxy, token_ids=token_ids)
    after = metrics.snapshot(decode_url)
    t0 = time.monotonic()
    while after.get("vllm:nixl_bytes_transferred_count", 0) == before.get("vllm:nixl_bytes_transferred_count", 0) \
            and time.monotonic() - t0 < settle_s:
        time.sleep(0.05)
        after = metrics.snapshot(decode_url)
    errs = _plan_errors(plan)
    res = metrics.compare(metrics.delta(before, after), metrics.expected_for(plan, isl), plan_ok=not errs,
                          plan_errors=errs)
    return LiveProbe(isl=isl, tokens_transferred=plan.transfer_for(isl).tokens_transferred, comparison=res)


def _padded(tokens: int, block: int) -> int:
    return cdiv(tokens, block) * block


def confusable_block_sizes(block: int) -> list[int]:
    """Block sizes a deployment might run instead of the planned one: every multiple of 16 up to 4x the planned
    size, plus half and double (vLLM's kernels take multiples of 16; hybrid alignment can give any of them)."""
    out = set(range(16, 4 * block + 1, 16)) | {block // 2, 2 * block}
    return sorted(x for x in out if x >= 1 and x != block)


def choose_isls(plan: Any, *, max_probes: int = 3) -> tuple[list[int], list[int]]:
    """Probe lengths such that a wrong block size changes the moved bytes of at least one probe.

    A probe of ``n`` tokens moves the KV of ``t`` tokens (``t = n`` or ``n - 1``, from the plan) padded to whole
    blocks; with block ``b`` that is ``ceil(t/b)*b`` tokens' worth. Candidate lengths sit at block boundaries of
    the planned size (``t = k*b`` and ``k*b + 1``); a greedy cover picks the fewest (up to ``max_probes``) that
    tell the planned size from every confusable one. A wrong dtype or TP changes the bytes per token (or the
    READs per request) at every length, so any probe catches those. Returns (lengths, block sizes no chosen
    probe can tell apart from the planned one).
    """
    b = plan.prefill.block_size
    if plan.routes is None:
        return [b + b // 2], []
    cap = (max_model_len(plan.model, plan.prefill.settings) or 1 << 30) - 8  # limit unknown: lengths uncapped
    off = max(0, (b + 2) - plan.transfer_for(b + 2).tokens_transferred)  # P's backoff (hybrid: 1 token)
    cands: dict[int, int] = {}
    for k in range(1, 9):
        for t in (k * b, k * b + 1, b // 2 + 1):
            n = t + off
            if 2 <= n <= cap:
                cands[n] = plan.transfer_for(n).tokens_transferred
    if not cands:
        return [max(2, min(b + b // 2, cap))], []
    todo = set(confusable_block_sizes(b))
    chosen: list[int] = []

    def covers(n: int, left: set[int]) -> set[int]:
        return {x for x in left if _padded(cands[n], x) != _padded(cands[n], b)}

    while todo and len(chosen) < max_probes:
        best = max(sorted(cands), key=lambda n: (len(covers(n, todo)), -n))
        got = covers(best, todo)
        if not got:
            break
        chosen.append(best)
        todo -= got
    if not chosen:
        chosen = [min(cands)]
    return sorted(chosen), sorted(todo)


def default_isls(plan: Any) -> list[int]:
    """The probe lengths `verify` sends when none are given (see ``choose_isls``)."""
    return choose_isls(plan)[0]


def run_probes(decode_url: str, plan: Any, model_name: str, *, isls: list[int] | None = None,
               prefill_url: str | None = None, proxy_url: str | None = None,
               token_ids: bool = True) -> LiveResult:
    from hybridpd.errors import UsageError

    if not (prefill_url or proxy_url):
        raise UsageError("live mode needs --prefill URL or --proxy URL", field="--prefill/--proxy")
    if plan.routes is None:
        raise UsageError("the plan has no transfer routes for this combination", fix="run `hybridpd plan`")
    blind: list[int] = []
    if not isls:
        isls, blind = choose_isls(plan)
    probes = [run_probe(decode_url, proxy_url or prefill_url or "", plan, n, model_name, proxy=bool(proxy_url),
                        token_ids=token_ids) for n in isls]
    return LiveResult(model=plan.model.model_id, decode=decode_url, via="proxy" if proxy_url else "prefill",
                      note=metrics.POOLING_NOTE, plan_errors=tuple(_plan_errors(plan)), probes=tuple(probes),
                      block_size=plan.prefill.block_size, block_sizes_not_told_apart=tuple(blind))


def run_passive(decode_url: str, plan: Any, window: float) -> PassiveResult:
    before = metrics.snapshot(decode_url)
    time.sleep(window)
    after = metrics.snapshot(decode_url)
    d = metrics.delta(before, after)
    return passive_verdict(d, plan, window)


def passive_verdict(d: dict[str, float], plan: Any, window: float) -> PassiveResult:
    hist = metrics.prompt_histogram(d)
    max_len = max_model_len(plan.model, plan.prefill.settings) or 131072  # unknown: a finite top for +Inf bucket
    n, lo, hi = metrics.passive_bounds(plan, hist, max_len)
    moved = int(round(d.get("vllm:nixl_bytes_transferred_sum", 0.0)))
    fails = {k: int(round(d.get(k, 0.0))) for k in metrics.FAILURE_SERIES}
    mism = [f"{k} rose by {v}" for k, v in fails.items() if v]
    if not lo <= moved <= hi:
        mism.append(f"bytes: moved {moved:,}, plan predicts {lo:,}..{hi:,} for {n} requests (approximate: from "
                    "the prompt-length histogram buckets)")
    errs = _plan_errors(plan)
    if errs:
        mism.append("the plan has error findings: not healthy even if the counters match")
    return PassiveResult(window_s=window, requests=n, expected_bytes_min=lo, expected_bytes_max=hi, moved_bytes=moved,
                         failures=fails, note=metrics.POOLING_NOTE, plan_errors=tuple(errs), mismatches=tuple(mism))


def _get(url: str, timeout: float = 5.0) -> str | None:
    from hybridpd.errors import ExternalToolError

    try:
        return metrics.fetch(url, timeout).decode(errors="replace")
    except ExternalToolError:  # no such endpoint: nothing read, the plan's value stays assumed
        return None


def read_assumptions(decode_url: str, plan: Any, *, from_record: bool = False) -> dict[str, dict[str, Any]]:
    """What the plan assumed (vLLM version, platform, block size), where each came from, and what D itself
    reports: ``GET /version`` and the ``vllm:cache_config_info`` labels of ``/metrics`` (None where D says
    nothing). ``source`` is "record" (--deployment), the flag, or "assumed (default)"."""
    import re

    ver = _get(decode_url.rstrip("/") + "/version")
    reported_version = None
    if ver:
        try:
            reported_version = str(json.loads(ver).get("version")) or None
        except (ValueError, AttributeError):
            reported_version = None
    text = _get(decode_url.rstrip("/") + "/metrics") or ""
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
    reported_block = labels.get("block_size")
    src_v = "record" if from_record else ("--vllm-version" if plan.target.source == "--vllm-version"
                                          else f"assumed ({plan.target.source})")
    src_p = "record" if from_record else "--platform"
    src_b = "record" if from_record else ("--block-size" if plan.prefill.settings.block_size else
                                          "assumed (the planner's default for this model and release)")
    out = {
        "vllm_version": {"value": format_version(plan.target.version), "source": src_v, "deployment_reports": reported_version,
                         "read_from": "/version" if reported_version else None},
        "platform": {"value": plan.platform.name, "source": src_p, "deployment_reports": None, "read_from": None},
        "block_size": {"value": plan.prefill.block_size, "source": src_b,
                       "deployment_reports": int(reported_block) if reported_block and reported_block.isdigit()
                       else None,
                       "read_from": "/metrics vllm:cache_config_info" if reported_block else None},
    }
    for k, v in out.items():  # versions: the release line (0.32 = D's 0.32.1 or 0.32.0+cpu), as profiles go
        n = 2 if k == "vllm_version" else 99
        rep, val = v["deployment_reports"], str(v["value"]).split(".")[:n]
        v["differs"] = rep is not None and re.split(r"[.+]", str(rep))[:len(val)] != val
    return out


def assumption_lines(a: Mapping[str, Mapping[str, Any]]) -> list[str]:
    out = []
    for k, v in a.items():
        said = (f"; D reports {v['deployment_reports']} ({v['read_from']})" if v["deployment_reports"] is not None
                else "; D does not report it")
        out.append(f"assumed {k.replace('_', ' ')} {v['value']} (from {v['source']}){said}"
                   + (": DIFFERS, re-run with what D reports" if v.get("differs") else ""))
    return out
