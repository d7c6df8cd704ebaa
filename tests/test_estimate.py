"""Transfer-time estimate: the fit, the calibration file, the arithmetic on real plans, and `plan`'s options."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hybridpd_cli.main import cli, main
from hybridpd_cli.plan import fmt_seconds

from hybridpd.core.estimate import Calibration, estimate_request, fit_calibration, load_calibration, select
from hybridpd.core.plan import build_plan, plan_to_dict
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError

GiB = 1 << 30

ENTRY: dict[str, Any] = {
    "name": "test-link", "transport": "cuda_ipc/cuda", "memory": "VRAM", "per_descriptor_us": 10.0,
    "bandwidth_gbps": 100.0, "hardware": "test box", "software": "test sw", "measured": "today",
    "command": "none"}


def write_cal(tmp_path: Path, entries: list[dict[str, Any]], **top: Any) -> Path:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"schema": "hybridpd-calibration/1", "entries": entries, **top}))
    return path


def cal(c_s: float, bw_Bps: float, name: str = "x") -> Calibration:
    return Calibration(name=name, transport="t", memory="VRAM", per_descriptor_s=c_s, bandwidth_Bps=bw_Bps,
                       hardware="h", software="s", measured="m", command="c")


# --- fit -------------------------------------------------------------------------------------------------------

def synthetic(c: float, bw: float, noise: float = 0.0, seed: int = 0) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    pts = []
    for total in (64 << 20, GiB):
        for size in (4096, 16384, 65536, 1 << 20, 4 << 20, 16 << 20):
            n = total // size
            t = n * c + total / bw
            pts.append((n, total, t * (1 + rng.uniform(-noise, noise))))
    return pts


def test_fit_recovers_exact_parameters() -> None:
    c, bw, r2, max_rel = fit_calibration(synthetic(12e-6, 300e9))
    assert c == pytest.approx(12e-6, rel=1e-9)
    assert bw == pytest.approx(300e9, rel=1e-9)
    assert r2 == pytest.approx(1.0, abs=1e-9)
    assert max_rel < 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_fit_with_noise(seed: int) -> None:
    c, bw, r2, max_rel = fit_calibration(synthetic(5e-6, 50e9, noise=0.02, seed=seed))
    assert c == pytest.approx(5e-6, rel=0.05)
    assert bw == pytest.approx(50e9, rel=0.05)
    assert 0.98 < r2 <= 1.0
    assert 0 < max_rel < 0.05


def test_fit_minimises_relative_error() -> None:
    # noisy points over 4 orders of magnitude: the result is the minimum of the summed squared RELATIVE error
    # (an absolute fit would be set by the slowest points alone), so any small move of c or 1/bw makes it worse
    pts = synthetic(12e-6, 300e9, noise=0.2, seed=7)
    c, bw, _, _ = fit_calibration(pts)

    def rel_sse(c_: float, inv_: float) -> float:
        return sum(((n * c_ + b * inv_) / t - 1) ** 2 for n, b, t in pts)

    def abs_sse(c_: float, inv_: float) -> float:
        return sum((n * c_ + b * inv_ - t) ** 2 for n, b, t in pts)

    best = rel_sse(c, 1 / bw)
    for dc, di in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert rel_sse(c * dc, di / bw) > best
    assert any(abs_sse(c * dc, di / bw) < abs_sse(c, 1 / bw) for dc, di in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)))


def test_fit_clamps_negative_bandwidth_term() -> None:
    # the more bytes, the LESS time: unconstrained, 1/bw < 0; clamped, the bandwidth term is 0 (bw = inf)
    # and c is the one-parameter relative fit: argmin sum((c*a - 1)^2), a = n/t, i.e. sum(a) / sum(a^2)
    pts = [(10, 100 << 20, 10 * 2e-6 * 0.9), (1000, 1 << 20, 1000 * 2e-6), (100, 10 << 20, 100 * 2e-6 * 0.95)]
    c, bw, _, max_rel = fit_calibration(pts)
    assert bw == math.inf
    a = [n / t for n, _, t in pts]
    assert c == pytest.approx(sum(a) / sum(x * x for x in a), rel=1e-12)
    assert max_rel == pytest.approx(max(abs(n * c / t - 1) for n, _, t in pts), rel=1e-12)


@pytest.mark.parametrize("pts", [
    [(10, 10 << 20, 0.01)],
    [(1, 1 << 20, 0.001), (2, 2 << 20, 0.002), (8, 8 << 20, 0.01)],  # one descriptor size
    [],
])
def test_fit_degenerate_raises(pts: list[tuple[int, int, float]]) -> None:
    with pytest.raises(ValueError, match="distinct descriptor sizes"):
        fit_calibration(pts)


def test_fit_rejects_bad_points() -> None:
    with pytest.raises(ValueError, match="seconds > 0"):
        fit_calibration([(1, 4096, 0.0), (2, 1 << 20, 0.1)])


# --- calibration file ---------------------------------------------------------------------------------------------

def test_bundled_calibration_loads_and_selects() -> None:
    entries = load_calibration()
    assert entries and len({e.name for e in entries}) == len(entries)
    vram = [e for e in entries if e.memory == "VRAM"]
    assert vram, "the bundled table should have a VRAM entry for --platform cuda"
    assert select(entries, platform="cuda") is vram[0]
    assert select(entries, vram[-1].name, platform="cpu") is vram[-1]
    dram = [e for e in entries if e.memory == "DRAM"]
    assert select(entries, platform="cpu") is (dram[0] if dram else None)
    for e in entries:
        assert e.per_descriptor_s >= 0 and e.bandwidth_Bps > 0 and e.source.startswith("bundled:")


def test_bundled_notes_entry_is_the_fit_of_the_notes_points() -> None:
    entry = next((e for e in load_calibration() if e.name == "cuda_ipc-h200-notes"), None)
    if entry is None:
        pytest.skip("cuda_ipc-h200-notes was replaced")
    # nixl-notes §5: 1 GiB READs, cuda_ipc, 4 MiB 324 GB/s, 1 MiB 84, 64 KiB 5.7, 16 KiB 1.3
    pts = [(GiB // size, GiB, GiB / (gbps * 1e9)) for size, gbps in
           ((4 << 20, 324), (1 << 20, 84), (64 << 10, 5.7), (16 << 10, 1.3))]
    c, bw, r2, max_rel = fit_calibration(pts)
    assert entry.per_descriptor_s == pytest.approx(c, rel=1e-3)
    assert entry.bandwidth_Bps == pytest.approx(bw, rel=1e-3)
    assert entry.fit is not None and entry.fit.points == 4
    assert entry.fit.r2 == pytest.approx(r2, abs=1e-3)
    assert entry.fit.max_rel_err == pytest.approx(max_rel, abs=1e-3)
    for n, b, t in pts:  # the stored entry reproduces each measurement within its stated error
        d_s, b_s = entry.seconds(n, b)
        assert abs((d_s + b_s) / t - 1) <= entry.fit.max_rel_err + 1e-3


def test_load_custom_file_converts_units(tmp_path: Path) -> None:
    (e,) = load_calibration(write_cal(tmp_path, [ENTRY | {"fit": {"points": 3, "r2": 0.9}}]))
    assert e.per_descriptor_s == pytest.approx(10e-6)
    assert e.bandwidth_Bps == pytest.approx(100e9)
    assert e.fit is not None and e.fit.points == 3 and e.fit.max_rel_err is None
    assert e.source == str(tmp_path / "cal.json")


def test_select_unknown_link_lists_names() -> None:
    with pytest.raises(UsageError, match="--link.*use one of: a, b"):
        select((cal(1e-6, 1e9, "a"), cal(1e-6, 1e9, "b")), "c")


# --- estimate arithmetic -----------------------------------------------------------------------------------------

# Hand-computed per D rank, from shared/reference/vllm-hybrid-pd.md: Nano Mamba page at TP2 = 18432 + 1048576 =
# 1,067,008 B (§2.5), fp8 a1 = 256 B/token at TP>=2, block 4176 (§2.5 table), T = 6 layer slots and G = 4 Mamba
# groups (§2.5 HMA), L = cdiv(isl - 1, 4176).  0.20 (§3.3): K and V separate, kernel 16 (ratio 261):
# descriptors 2*T*L*261 + 4*T*G = 3132 + 96 = 3228.  0.32 (§9.2): one descriptor per (slot, block):
# T*L + 4*T*G; contiguous FA rows of a slot merge into one (descriptors_min = T + 4*T*G = 102).
# bytes = T*L*4176*256 + T*G*1,067,008.
HAND_CASES = [
    # model, vLLM, ptp, dtp, isl, descriptors, descriptors_min, bytes (per D rank)
    ("nano-nvfp4", "0.20", 2, 2, 1000, 3228, 3228, 6 * 1 * 1_069_056 + 24 * 1_067_008),  # L = 1
    ("nano-fp8", "0.32", 2, 2, 131072, 288, 102, 6 * 32 * 1_069_056 + 24 * 1_067_008),  # L = cdiv(131071, 4176) = 32
    ("nano-fp8", "0.32", 1, 2, 1024, 102, 102, 6 * 1 * 1_069_056 + 24 * 1_067_008),  # D rank reads its head + slices
]


@pytest.mark.parametrize("model,version,ptp,dtp,isl,desc,desc_min,nbytes", HAND_CASES)
def test_estimate_matches_hand_numbers(model: str, version: str, ptp: int, dtp: int, isl: int, desc: int,
                                       desc_min: int, nbytes: int) -> None:
    plan = build_plan(model, prefill=EngineSettings(tp=ptp), decode=EngineSettings(tp=dtp), isls=(isl,),
                      vllm_version=version)
    (t,) = plan.transfers
    c, bw, t0 = 12e-6, 200e9, 5e-3
    entry = Calibration(name="x", transport="t", memory="VRAM", per_descriptor_s=c, bandwidth_Bps=bw, per_read_s=t0,
                        hardware="h", software="s", measured="m", command="c")
    est = estimate_request(t, entry)
    assert [(r.descriptors, r.bytes) for r in est.per_rank] == [(desc, nbytes)] * dtp
    # e.g. case 1: 5e-3 + 3228 * 12e-6 + 32,022,528 / 200e9 = 0.005 + 0.038736 + 0.00016011264 = 0.04389611264 s
    want = t0 + desc * c + nbytes / bw
    assert [r.seconds for r in est.per_rank] == pytest.approx([want] * dtp, rel=1e-12)
    assert est.request_s == pytest.approx(want, rel=1e-12)
    assert est.request_s_coalesced == pytest.approx(t0 + desc_min * c + nbytes / bw, rel=1e-12)
    assert (est.fixed_s, est.descriptor_s, est.bandwidth_s) == pytest.approx((t0, desc * c, nbytes / bw), rel=1e-12)
    if model == "nano-nvfp4":
        assert est.request_s == pytest.approx(0.04389611264, rel=1e-12)


def test_coalesced_what_if_is_visible() -> None:
    # 0.32 at equal TP: whole FA pages merge, so descriptors_min < descriptors and the what-if is faster
    plan = build_plan("nano-fp8", prefill=EngineSettings(tp=2), decode=EngineSettings(tp=2), isls=(131072,))
    (t,) = plan.transfers
    assert t.descriptors_min < t.descriptors
    est = estimate_request(t, cal(12e-6, 300e9))
    assert est.request_s_coalesced < est.request_s


def test_plan_to_dict_adds_keys_only_when_asked() -> None:
    plan = build_plan("nano-fp8", prefill=EngineSettings(tp=1), decode=EngineSettings(tp=2), isls=(1024, 8192))
    base = plan_to_dict(plan)
    entry = cal(10e-6, 100e9, "lnk")
    withe = plan_to_dict(plan, estimate_with=entry)
    assert "calibration" not in base and all("estimate" not in t for t in base["transfer"])
    assert set(withe) - set(base) == {"calibration"}
    stripped = {k: v for k, v in withe.items() if k != "calibration"}
    stripped["transfer"] = [{k: v for k, v in t.items() if k != "estimate"} for t in withe["transfer"]]
    assert stripped == base
    assert withe["calibration"]["name"] == "lnk"
    for td, t in zip(withe["transfer"], plan.transfers, strict=True):
        assert td["estimate"]["request_s"] == pytest.approx(estimate_request(t, entry).request_s)


# --- CLI -----------------------------------------------------------------------------------------------------

def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point (error table included), in process."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_stable_estimate_keys(tmp_path: Path) -> None:
    path = write_cal(tmp_path, [ENTRY])
    r = CliRunner().invoke(cli, ["plan", "nano-fp8", "--ptp", "1", "--dtp", "2", "--isl", "1k,32k", "--json",
                                 "--calibration", str(path)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"name", "transport", "memory", "per_descriptor_us", "bandwidth_gbps", "hardware", "software", "measured",
            "command", "fit", "source"} <= set(d["calibration"])
    assert d["calibration"]["name"] == "test-link"
    for t in d["transfer"]:
        e = t["estimate"]
        assert {"link", "transport", "request_s", "per_rank_s", "descriptor_s", "bandwidth_s",
                "request_s_coalesced"} <= set(e)
        assert e["link"] == "test-link" and e["transport"] == "cuda_ipc/cuda"
        # 10 µs per descriptor, 100 GB/s, from the JSON's own per-rank counts
        per = [r["descriptors"] * 10e-6 + r["bytes"] / 100e9 for r in t["per_rank"]]
        assert e["per_rank_s"] == pytest.approx(per, rel=1e-9)
        assert e["request_s"] == pytest.approx(max(per), rel=1e-9)
        assert e["descriptor_s"] + e["bandwidth_s"] == pytest.approx(e["request_s"], rel=1e-9)


def test_human_output_has_column_and_note() -> None:
    r = CliRunner().invoke(cli, ["plan", "nano-fp8", "--ptp", "1", "--dtp", "2", "--isl", "1k", "--fmt", "plain"])
    assert r.exit_code == 0, r.output
    entry = select(load_calibration(), platform="cuda")
    assert entry is not None
    assert "est. time" in r.output
    note = next(ln for ln in r.output.splitlines() if ln.startswith("est. time:"))
    assert entry.name in note and entry.hardware in note and "n_desc × c + bytes / bw" in note


def test_cpu_platform_without_dram_entry_omits_estimate(tmp_path: Path) -> None:
    path = write_cal(tmp_path, [ENTRY])
    base = ["plan", "nano-fp8", "--platform", "cpu", "--no-cpu-avx512-bf16", "--isl", "1k",
            "--calibration", str(path)]
    r = CliRunner().invoke(cli, [*base, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["calibration"] is None and all("estimate" not in t for t in d["transfer"])
    r = CliRunner().invoke(cli, [*base, "--fmt", "plain"])
    assert r.exit_code == 0, r.output
    assert "est. time omitted: no DRAM entry" in r.output
    assert not any(ln.rstrip().endswith("est. time") for ln in r.output.splitlines())
    # an explicit --link still estimates
    r = CliRunner().invoke(cli, [*base, "--json", "--link", "test-link"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["transfer"][0]["estimate"]["link"] == "test-link"


def test_dram_entry_is_the_cpu_default(tmp_path: Path) -> None:
    path = write_cal(tmp_path, [ENTRY, ENTRY | {"name": "cma", "memory": "DRAM", "transport": "cma/memory"}])
    r = CliRunner().invoke(cli, ["plan", "nano-fp8", "--platform", "cpu", "--no-cpu-avx512-bf16", "--isl", "1k",
                                 "--json", "--calibration", str(path)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["calibration"]["name"] == "cma"


BAD: list[tuple[Any, str]] = [
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY | {"bandwidth_gbps": 0}]}, "entries[0].bandwidth_gbps"),
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY, ENTRY | {"name": "b", "bandwidth_gbps": -3}]},
     "entries[1].bandwidth_gbps must be > 0"),
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY | {"per_descriptor_us": "12"}]},
     "entries[0].per_descriptor_us"),
    ({"schema": "hybridpd-calibration/1", "entries": [{k: v for k, v in ENTRY.items() if k != "hardware"}]},
     "entries[0].hardware"),
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY | {"memory": "HBM"}]}, "entries[0].memory"),
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY, ENTRY]}, "entries[1].name"),
    ({"schema": "hybridpd-calibration/1", "entries": [ENTRY | {"fit": {"r2": "high"}}]}, "entries[0].fit.r2"),
    ({"schema": "hybridpd-calibration/1", "entries": []}, "entries"),
    ({"schema": "other/2", "entries": [ENTRY]}, "schema"),
    ([ENTRY], "top level"),
]


@pytest.mark.parametrize("doc,needle", BAD)
def test_bad_calibration_exit_2_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: Any,
                                         needle: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    code, out, err = run_main(capsys, "plan", "nano-fp8", "--calibration", str(path), "--json")
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --calibration:"), err
    assert needle in lines[0] and "fix:" in lines[0]
    assert out == ""


@pytest.mark.parametrize("content,needle", [(None, "cannot read"), ("{not json", "not valid JSON"),
                                            ("", "not valid JSON")])
def test_unreadable_or_malformed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
                                      needle: str) -> None:
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run_main(capsys, "plan", "nano-fp8", "--calibration", str(path))
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --calibration:") and needle in lines[0], err


def test_unknown_link_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "plan", "nano-fp8", "--link", "no-such-link", "--json")
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --link:") and "no-such-link" in lines[0]
    assert all(e.name in lines[0] for e in load_calibration())


@pytest.mark.parametrize("s,text", [(5e-6, "5.0 µs"), (999e-6, "999.0 µs"), (0.0123, "12.30 ms"), (2.5, "2.50 s")])
def test_fmt_seconds_units(s: float, text: str) -> None:
    assert fmt_seconds(s) == text
