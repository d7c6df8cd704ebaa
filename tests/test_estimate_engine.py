"""The engine-time term of the transfer estimate (issue #22): ``reads × t0`` on top of ``n_desc × c + bytes / bw``,
its 3-coefficient fit, the calibration field, and the bundled entry fitted to what vLLM 0.24.0 reported on an H200.

The bundled entry is checked against the measured medians transcribed from docs/gpu-vllm-2026-12-01.md (the H200
run's own numbers, not recomputed from the code), including a second machine's run at lengths the fit never saw."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from hybridpd.core.estimate import Calibration, estimate_request, fit_engine_calibration, load_calibration, select
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError

GiB = 1 << 30


def entry(**kw: Any) -> dict[str, Any]:
    e = {"name": "e", "transport": "cuda_ipc/cuda", "memory": "VRAM", "per_descriptor_us": 3.0, "bandwidth_gbps": 100.0,
         "hardware": "h", "software": "s", "measured": "m", "command": "c"}
    e.update(kw)
    return e


def write(tmp_path: Path, *entries: dict[str, Any]) -> Path:
    p = tmp_path / "cal.json"
    p.write_text(json.dumps({"schema": "hybridpd-calibration/1", "entries": list(entries)}))
    return p


# --- fit ---------------------------------------------------------------------------------------------------------

def test_engine_fit_recovers_three_coefficients() -> None:
    t0, c, bw = 450e-6, 2.5e-6, 800e9
    pts = [(r, n, b, r * t0 + n * c + b / bw)
           for r, n, b in [(1, 20, 85_760), (1, 134, 552_704), (1, 1668, 64_094_208), (2, 6384, 102_727_680),
                           (1, 25_248, 257_261_568), (2, 500, 900_000_000)]]
    ft0, fc, fbw, r2, mx = fit_engine_calibration(pts)
    assert ft0 == pytest.approx(t0, rel=1e-6) and fc == pytest.approx(c, rel=1e-6) and fbw == pytest.approx(bw, rel=1e-6)
    assert r2 == pytest.approx(1.0) and mx < 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_fit_with_noise_stays_close(seed: int) -> None:
    rng = random.Random(seed)
    t0, c, bw = 400e-6, 3e-6, 500e9
    pts = [(1, n, 40_000 * n, (t0 + n * c + 40_000 * n / bw) * rng.uniform(0.97, 1.03))
           for n in (20, 60, 200, 1000, 4000, 16000)]
    pts += [(1, n, 2_000_000 * n, (t0 + n * c + 2_000_000 * n / bw) * rng.uniform(0.97, 1.03)) for n in (10, 100)]
    ft0, fc, _, _, mx = fit_engine_calibration(pts)
    assert ft0 == pytest.approx(t0, rel=0.25) and fc == pytest.approx(c, rel=0.15) and mx < 0.1


def test_engine_fit_keeps_coefficients_non_negative() -> None:
    # times fall with more descriptors at fixed bytes: the free optimum has c < 0; the fit clamps it to 0
    pts = [(1, 10, 1_000_000, 2e-3), (1, 100, 1_000_000, 1.9e-3), (1, 1000, 1_000_000, 1.8e-3)]
    t0, c, bw, _, _ = fit_engine_calibration(pts)
    assert t0 >= 0 and c >= 0 and bw > 0


@pytest.mark.parametrize("pts", [[(1, 1, 1, 1e-3), (1, 2, 2, 2e-3)], [(0, 1, 1, 1e-3)] * 3, [(1, 1, 1, 0.0)] * 3])
def test_engine_fit_rejects_too_few_or_bad_points(pts: list[tuple[int, int, int, float]]) -> None:
    with pytest.raises(ValueError):
        fit_engine_calibration(pts)


# --- calibration field and arithmetic ------------------------------------------------------------------------------

def test_per_read_us_is_optional_and_read_in_microseconds(tmp_path: Path) -> None:
    a, b = load_calibration(write(tmp_path, entry(name="a"), entry(name="b", per_read_us=350.0)))
    assert a.per_read_s == 0.0
    assert b.per_read_s == pytest.approx(350e-6)
    assert b.as_dict()["per_read_us"] == pytest.approx(350.0)


@pytest.mark.parametrize("bad", [-1.0, "1", float("nan"), True])
def test_bad_per_read_us_names_the_field(tmp_path: Path, bad: Any) -> None:
    doc = {"schema": "hybridpd-calibration/1", "entries": [entry(per_read_us=bad)]}
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(doc, allow_nan=True))
    with pytest.raises(UsageError, match=r"entries\[0\]\.per_read_us"):
        load_calibration(p)


@pytest.mark.parametrize("ptp,dtp", [(1, 1), (2, 1), (1, 2)])
def test_fixed_term_counts_once_per_read(ptp: int, dtp: int) -> None:
    plan = build_plan("nano-fp8", prefill=EngineSettings(tp=ptp), decode=EngineSettings(tp=dtp), isls=(8192,))
    (t,) = plan.transfers
    e = Calibration(name="x", transport="t", memory="VRAM", per_descriptor_s=2e-6, bandwidth_Bps=1e12, hardware="h",
                    software="s", measured="m", command="c", per_read_s=1e-3)
    est = estimate_request(t, e)
    for r, got in zip(t.per_rank, est.per_rank, strict=True):
        assert got.fixed_s == pytest.approx(r.reads * 1e-3)
        assert got.seconds == pytest.approx(r.reads * 1e-3 + r.descriptors * 2e-6 + r.bytes / 1e12)
    assert est.as_dict()["fixed_s"] == pytest.approx(est.slowest.fixed_s)
    if ptp == 2 and dtp == 1:  # one D rank reads from two P ranks: two READs, two fixed terms
        assert t.per_rank[0].reads == 2


# --- the bundled entry against the H200 run -------------------------------------------------------------------------

# (isl, vLLM's median vllm:nixl_xfer_time_seconds in µs) for Nemotron-3-Nano-30B-A3B bf16, dummy weights, vLLM 0.24.0,
# P and D on one H200, --kv-cache-memory 2GiB --max-model-len 32768 --no-enable-prefix-caching
# (docs/gpu-vllm-2026-12-01.md, runs nano24 = fit, nano24b = second machine, lengths never fitted)
FITTED = [(1000, 9781), (2000, 10210), (4000, 13854), (8000, 22287), (16000, 42114), (32000, 82439)]
HELD_OUT = [(1500, 10287), (3000, 15745), (6000, 17407), (12000, 34315), (24000, 63948)]


@pytest.mark.parametrize("isl,measured_us", FITTED + HELD_OUT)
def test_bundled_cuda_default_is_within_20_percent_of_vllm(isl: int, measured_us: float) -> None:
    e = select(load_calibration(), platform="cuda")
    assert e is not None and e.name == "vllm-nixl-h200" and e.per_read_s > 0
    s = EngineSettings(tp=1, kv_cache_memory=2 * GiB, max_model_len=32768, enable_prefix_caching=False)
    plan = build_plan("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", prefill=s, decode=s, isls=(isl,), vllm_version="0.24")
    (t,) = plan.transfers
    ratio = measured_us * 1e-6 / estimate_request(t, e).request_s
    assert 0.8 <= ratio <= 1.2, ratio
    assert math.isfinite(ratio)
