"""Per-request NIXL transfer-time estimate from a calibration table.

Model (nixl-notes §5): a D rank's ``reads`` READs of ``n_desc`` descriptors moving ``bytes`` take

    t = reads × t0 + n_desc × c + bytes / bw

with ``t0`` seconds per READ, ``c`` seconds per descriptor and ``bw`` bytes per second, one set per transport
(UCX cuda_ipc on VRAM, cma on DRAM, ...). ``t0`` (``per_read_us``, optional, default 0) is what a bare NIXL READ
does not show but vLLM's own ``vllm:nixl_xfer_time_seconds`` does: the READ is timed from its post until the
engine's next poll sees it done, a fixed ~0.3-0.5 ms per request on an H200 (docs/gpu-vllm-2026-12-01.md). Entries
fitted by bench/bench_gpu.py (bare READs) have t0 = 0 and predict the wire time; the ``vllm-nixl-h200`` entry is
fitted to what vLLM itself reports and predicts that. On H200s over cuda_ipc the per-descriptor cost
(5-8 µs, docs/gpu-h200-2026-11-29.md) dominates for the small conv B/C slices of hybrid models, so the
descriptor count matters more than the byte count.

The calibration file (``hybridpd/data/calibration.json`` bundled; ``--calibration FILE`` in the CLI;
``bench/bench_gpu.py`` writes one), with illustrative values::

    {"schema": "hybridpd-calibration/1",
     "entries": [{"name": "cuda_ipc-h200", "transport": "cuda_ipc/cuda", "memory": "VRAM",
                  "per_descriptor_us": 12.0, "bandwidth_gbps": 400.0,          # GB/s = 1e9 B/s
                  "per_read_us": 0.0,                                          # optional
                  "hardware": "...", "software": "...", "measured": "...", "command": "...",
                  "fit": {"points": 4, "r2": 0.99, "max_rel_err": 0.05}}]}  # fit: optional

``fit_calibration`` turns measured ``(n_desc, nbytes, seconds)`` points into ``c`` and ``bw``.
Pure Python: ``plan`` must not import numpy or torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.core.transfer import RequestTransfer
from hybridpd.errors import UsageError

SCHEMA = "hybridpd-calibration/1"
BUNDLED = "bundled:hybridpd/data/calibration.json"
# beside the package, read directly: importlib.resources (with tempfile, shutil, zipfile) cost `plan` ~6 ms
_BUNDLED_FILE = Path(__file__).parent.parent / "data" / "calibration.json"
MODEL = "reads × t0 + n_desc × c + bytes / bw"
MEMORY_OF_PLATFORM = {"cuda": "VRAM", "cpu": "DRAM"}
_FIELD = "--calibration"
_FIX = "see the format in hybridpd/core/estimate.py (schema hybridpd-calibration/1)"


@dataclass(frozen=True, kw_only=True)
class Fit:
    """How well the entry's two numbers reproduce the points they were fitted to (all optional)."""

    points: int | None = None
    r2: float | None = None  # weighted by 1/seconds² (relative error), see fit_calibration
    max_rel_err: float | None = None
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"points": self.points, "r2": self.r2, "max_rel_err": self.max_rel_err, "note": self.note}


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One transport's cost model: ``per_descriptor_s`` (c), ``bandwidth_Bps`` (bw) and ``per_read_s`` (t0)."""

    name: str  # e.g. "cuda_ipc-h200"; what --link selects
    transport: str  # UCX transport, e.g. "cuda_ipc/cuda", "cma/memory"
    memory: str  # "VRAM" | "DRAM"
    per_descriptor_s: float
    bandwidth_Bps: float
    hardware: str
    software: str
    measured: str
    command: str
    fit: Fit | None = None
    source: str = BUNDLED  # the file the entry came from
    per_read_s: float = 0.0  # t0: fixed cost of one READ as the engine times it (0 for bare-NIXL fits)

    def seconds(self, descriptors: int, nbytes: int) -> tuple[float, float]:
        """(descriptor part, bandwidth part) of one READ set."""
        return descriptors * self.per_descriptor_s, nbytes / self.bandwidth_Bps

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "transport": self.transport, "memory": self.memory,
                "per_descriptor_us": self.per_descriptor_s * 1e6, "bandwidth_gbps": self.bandwidth_Bps / 1e9,
                "per_read_us": self.per_read_s * 1e6,
                "hardware": self.hardware, "software": self.software, "measured": self.measured,
                "command": self.command, "fit": self.fit.as_dict() if self.fit else None, "source": self.source,
                "model": MODEL}


def _bad(msg: str, fix: str = _FIX) -> UsageError:
    return UsageError(f"{_FIELD}: {msg}", field=_FIELD, fix=fix)


# Accepted calibration ranges (#15): wide enough for any link, narrow enough that times stay finite in JSON.
_RANGES = {"per_descriptor_us": (0.0, 1e9), "bandwidth_gbps": (1e-6, 1e6)}


def _num(e: dict[str, Any], key: str, where: str, *, positive: bool) -> float:
    v = e.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"{where}.{key} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise _bad(f"{where}.{key} must be > 0, got {v!r}")
    if v < 0:
        raise _bad(f"{where}.{key} must be >= 0, got {v!r}")
    lo, hi = _RANGES.get(key, (-math.inf, math.inf))
    if not lo <= v <= hi:
        raise _bad(f"{where}.{key} must be in {lo:g}..{hi:g}, got {v!r}")
    return float(v)


def _str(e: dict[str, Any], key: str, where: str) -> str:
    v = e.get(key)
    if not isinstance(v, str) or not v.strip():
        raise _bad(f"{where}.{key} must be a non-empty string, got {v!r}")
    return v


def _fit(v: Any, where: str) -> Fit | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(f"{where}.fit must be an object or absent, got {type(v).__name__}")
    unknown = set(v) - {"points", "r2", "max_rel_err", "note"}
    if unknown:
        raise _bad(f"{where}.fit has unknown keys {sorted(unknown)}", fix="use points, r2, max_rel_err, note")
    pts = v.get("points")
    if pts is not None and (isinstance(pts, bool) or not isinstance(pts, int) or pts < 0):
        raise _bad(f"{where}.fit.points must be a non-negative integer, got {pts!r}")
    out: dict[str, float | None] = {}
    for k in ("r2", "max_rel_err"):
        x = v.get(k)
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)):
            raise _bad(f"{where}.fit.{k} must be a finite number, got {x!r}")
        out[k] = None if x is None else float(x)
    note = v.get("note")
    if note is not None and not isinstance(note, str):
        raise _bad(f"{where}.fit.note must be a string, got {note!r}")
    return Fit(points=pts, r2=out["r2"], max_rel_err=out["max_rel_err"], note=note)


def parse_calibration(data: Any, *, source: str) -> tuple[Calibration, ...]:
    """Validate a decoded calibration document; every error names the offending field."""
    if not isinstance(data, dict):
        raise _bad(f"top level must be an object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise _bad(f"schema must be {SCHEMA!r}, got {data.get('schema')!r}", fix=f'set "schema": "{SCHEMA}"')
    entries = data.get("entries")
    if not isinstance(entries, list) or not entries:
        raise _bad("entries must be a non-empty list")
    out: list[Calibration] = []
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"entries[{i}]"
        if not isinstance(e, dict):
            raise _bad(f"{where} must be an object, got {type(e).__name__}")
        name = _str(e, "name", where)
        if name in seen:
            raise _bad(f"{where}.name {name!r} is used twice", fix="give every entry its own name")
        seen.add(name)
        memory = _str(e, "memory", where)
        if memory not in ("VRAM", "DRAM"):
            raise _bad(f"{where}.memory must be VRAM or DRAM, got {memory!r}", fix="use VRAM or DRAM")
        out.append(Calibration(
            name=name, transport=_str(e, "transport", where), memory=memory,
            per_descriptor_s=_num(e, "per_descriptor_us", where, positive=False) * 1e-6,
            bandwidth_Bps=_num(e, "bandwidth_gbps", where, positive=True) * 1e9,
            hardware=_str(e, "hardware", where), software=_str(e, "software", where),
            measured=_str(e, "measured", where), command=_str(e, "command", where),
            fit=_fit(e.get("fit"), where), source=source,
            per_read_s=_num(e, "per_read_us", where, positive=False) * 1e-6 if "per_read_us" in e else 0.0))
    return tuple(out)


def load_calibration(path: str | Path | None = None) -> tuple[Calibration, ...]:
    """Entries of a calibration JSON file; ``None`` reads the bundled ``hybridpd/data/calibration.json``."""
    try:
        if path is None:
            text = _BUNDLED_FILE.read_text(encoding="utf-8")
            source = BUNDLED
        else:  # a regular file of bounded size only; strict JSON (#15: a FIFO must not block, no NaN/Infinity)
            from hybridpd.fsutil import parse_json_bytes, read_bounded

            raw = read_bounded(path, field=_FIELD, limit=1 << 20)
            return parse_calibration(parse_json_bytes(raw, where=str(path), field=_FIELD, fix="fix the JSON syntax"),
                                     source=str(path))
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _bad(f"cannot read {path or BUNDLED}: {reason}", fix="pass a readable JSON file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(f"{source} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})",
                   fix="fix the JSON syntax") from None
    return parse_calibration(data, source=source)


def select(calibrations: Sequence[Calibration], link: str | None = None, *, platform: str = "cuda") -> Calibration | None:
    """``link`` by name (must exist), else the first VRAM entry for cuda / DRAM entry for cpu, else None."""
    if link is not None:
        for c in calibrations:
            if c.name == link:
                return c
        names = ", ".join(c.name for c in calibrations) or "(none)"
        raise UsageError(f"--link: no calibration entry named {link!r}", field="--link",
                         fix=f"use one of: {names}")
    memory = MEMORY_OF_PLATFORM.get(platform)
    return next((c for c in calibrations if c.memory == memory), None)


def fit_calibration(points: Iterable[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """Least-squares ``seconds = n_desc*c + nbytes/bw`` over (n_desc, nbytes, seconds) points.

    Residuals are relative (weight 1/seconds²): measured times span orders of magnitude and an absolute fit
    would only see the slowest point.  ``c >= 0`` and ``1/bw >= 0``; ``bw`` is ``inf`` when the bandwidth
    term fits to zero.  Returns ``(c, bw, r2, max_rel_err)``, ``r2`` weighted like the fit.

    ``c`` and ``bw`` are separable only when the points use at least two descriptor sizes (``nbytes/n_desc``);
    with one size the two terms are proportional and any split fits.
    """
    pts = [(float(n), float(b), float(t)) for n, b, t in points]
    for n, b, t in pts:
        if not (n >= 1 and b >= 0 and t > 0 and math.isfinite(n + b + t)):
            raise ValueError(f"bad point (n_desc={n:g}, nbytes={b:g}, seconds={t:g}): "
                             "need n_desc >= 1, nbytes >= 0, seconds > 0")
    sizes = {b / n for n, b, _ in pts}
    if len(sizes) < 2:
        raise ValueError(f"need points with at least 2 distinct descriptor sizes (nbytes/n_desc) to separate c from bw, "
                         f"got {len(pts)} point(s) with {len(sizes)} size(s)")
    # rows (n/t, b/t) -> target 1; columns scaled to max 1 so the normal equations stay well conditioned
    rows = [(n / t, b / t) for n, b, t in pts]
    sa = max(a for a, _ in rows)
    sb = max(b for _, b in rows) or 1.0
    rows = [(a / sa, b / sb) for a, b in rows]

    def loss(x: float, y: float) -> float:
        return sum((x * a + y * b - 1.0) ** 2 for a, b in rows)

    aa = sum(a * a for a, _ in rows)
    ab = sum(a * b for a, b in rows)
    bb = sum(b * b for _, b in rows)
    ay = sum(a for a, _ in rows)
    by = sum(b for _, b in rows)
    det = aa * bb - ab * ab
    cands: list[tuple[float, float]] = []
    if det > 1e-12 * aa * bb:
        x, y = (ay * bb - by * ab) / det, (aa * by - ab * ay) / det
        if x >= 0 and y >= 0:
            cands.append((x, y))
    if not cands:  # the unconstrained optimum is outside the quadrant: best fit on one of its edges
        cands.append((max(ay / aa, 0.0), 0.0))
        if bb > 0:
            cands.append((0.0, max(by / bb, 0.0)))
    x, y = min(cands, key=lambda v: loss(*v))
    c, inv_bw = x / sa, y / sb
    if c == 0 and inv_bw == 0:
        raise ValueError("fit degenerated to zero cost; check the points")
    bw = math.inf if inv_bw == 0 else 1.0 / inv_bw
    rel = [(n * c + b * inv_bw) / t - 1.0 for n, b, t in pts]
    w = [1.0 / (t * t) for _, _, t in pts]
    mean = sum(wi * t for wi, (_, _, t) in zip(w, pts, strict=True)) / sum(w)
    ss_tot = sum(wi * (t - mean) ** 2 for wi, (_, _, t) in zip(w, pts, strict=True))
    ss_res = sum(r * r for r in rel)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return c, bw, r2, max(abs(r) for r in rel)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_engine_calibration(points: Iterable[tuple[int, int, int, float]]) -> tuple[float, float, float, float, float]:
    """Least-squares ``seconds = reads*t0 + n_desc*c + nbytes/bw`` over (reads, n_desc, nbytes, seconds) points.

    For times the engine reports (``vllm:nixl_xfer_time_seconds``), which add a fixed per-READ term to the wire
    time. Relative residuals (weight 1/seconds²) as in ``fit_calibration``; every coefficient >= 0 (the best of
    all subsets of free coefficients, each solved by its normal equations). Returns ``(t0, c, bw, r2, max_rel_err)``,
    ``bw`` = ``inf`` when the bandwidth term fits to zero.
    """
    pts = [(float(r), float(n), float(b), float(t)) for r, n, b, t in points]
    for r, n, b, t in pts:
        if not (r >= 1 and n >= 1 and b >= 0 and t > 0 and math.isfinite(r + n + b + t)):
            raise ValueError(f"bad point (reads={r:g}, n_desc={n:g}, nbytes={b:g}, seconds={t:g}): "
                             "need reads >= 1, n_desc >= 1, nbytes >= 0, seconds > 0")
    if len(pts) < 3:
        raise ValueError(f"need at least 3 points to fit 3 coefficients, got {len(pts)}")
    raw = [(r / t, n / t, b / t) for r, n, b, t in pts]
    scale = [max(row[j] for row in raw) or 1.0 for j in range(3)]
    rows = [[row[j] / scale[j] for j in range(3)] for row in raw]

    def loss(x: list[float]) -> float:
        return sum((sum(xj * rj for xj, rj in zip(x, row, strict=True)) - 1.0) ** 2 for row in rows)

    best: list[float] | None = None
    for mask in range(1, 8):
        free = [j for j in range(3) if mask >> j & 1]
        m = [[sum(row[i] * row[j] for row in rows) for j in free] for i in free]
        v = [sum(row[i] for row in rows) for i in free]
        sol = _solve(m, v)
        if sol is None or min(sol) < 0:
            continue
        x = [0.0, 0.0, 0.0]
        for j, val in zip(free, sol, strict=True):
            x[j] = val
        if best is None or loss(x) < loss(best):
            best = x
    if best is None:
        raise ValueError("fit degenerated; check the points")
    t0, c, inv_bw = (best[j] / scale[j] for j in range(3))
    rel = [(r * t0 + n * c + b * inv_bw) / t - 1.0 for r, n, b, t in pts]
    w = [1.0 / (t * t) for *_, t in pts]
    mean = sum(wi * p[3] for wi, p in zip(w, pts, strict=True)) / sum(w)
    ss_tot = sum(wi * (p[3] - mean) ** 2 for wi, p in zip(w, pts, strict=True))
    ss_res = sum(x * x for x in rel)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return t0, c, math.inf if inv_bw == 0 else 1.0 / inv_bw, r2, max(abs(x) for x in rel)


@dataclass(frozen=True, kw_only=True)
class RankEstimate:
    rank: int
    descriptors: int
    bytes: int
    descriptor_s: float  # descriptors × c
    bandwidth_s: float  # bytes / bw
    descriptor_s_coalesced: float  # descriptors_min × c
    fixed_s: float = 0.0  # reads × t0

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.descriptor_s + self.bandwidth_s

    @property
    def seconds_coalesced(self) -> float:
        return self.fixed_s + self.descriptor_s_coalesced + self.bandwidth_s


@dataclass(frozen=True, kw_only=True)
class TransferEstimate:
    """One request's estimate: D ranks read in parallel (one GPU each), so the request takes the slowest rank."""

    isl: int
    calibration: Calibration
    per_rank: tuple[RankEstimate, ...]

    @property
    def slowest(self) -> RankEstimate:
        return max(self.per_rank, key=lambda r: r.seconds)

    @property
    def request_s(self) -> float:
        return self.slowest.seconds

    @property
    def descriptor_s(self) -> float:
        """Descriptor part of the slowest rank."""
        return self.slowest.descriptor_s

    @property
    def bandwidth_s(self) -> float:
        """Bandwidth part of the slowest rank."""
        return self.slowest.bandwidth_s

    @property
    def fixed_s(self) -> float:
        """Per-READ part (reads × t0) of the slowest rank."""
        return self.slowest.fixed_s

    @property
    def request_s_coalesced(self) -> float:
        """What-if: every contiguous run merged into one descriptor (``descriptors_min``)."""
        return max(r.seconds_coalesced for r in self.per_rank)

    def as_dict(self) -> dict[str, Any]:
        return {"link": self.calibration.name, "transport": self.calibration.transport,
                "request_s": self.request_s, "per_rank_s": [r.seconds for r in self.per_rank],
                "descriptor_s": self.descriptor_s, "bandwidth_s": self.bandwidth_s, "fixed_s": self.fixed_s,
                "request_s_coalesced": self.request_s_coalesced,
                "per_rank_s_coalesced": [r.seconds_coalesced for r in self.per_rank]}


def estimate_request(transfer: RequestTransfer, entry: Calibration) -> TransferEstimate:
    """Per D rank ``reads × t0 + descriptors × c + bytes / bw``; the request takes the slowest rank.

    ``descriptors`` is the count vLLM hands to ``make_prepped_xfer`` (one index per region, block and
    sub-region; vLLM never merges).  NIXL may merge dense consecutive FA rows inside ``makeXferReq``
    (docs/vllm-0.32-nixl-audit.md §3; ``descriptors_min`` counts that), but the calibration points do not show
    what a merged row costs, so the default is the un-merged count (an upper bound on the descriptor part)
    and ``*_coalesced`` is the what-if with every contiguous run merged.
    ``reads`` is one READ per source P rank; ``t0`` is 0 for bare-NIXL entries (their points are single READs,
    so the per-READ overhead sits inside ``c``) and the engine's fixed per-READ time for entries fitted to vLLM.
    """
    if not transfer.per_rank:
        raise ValueError("transfer has no D ranks")
    ranks = []
    for r in transfer.per_rank:
        d_s, b_s = entry.seconds(r.descriptors, r.bytes)
        ranks.append(RankEstimate(rank=r.rank, descriptors=r.descriptors, bytes=r.bytes, descriptor_s=d_s,
                                  bandwidth_s=b_s, descriptor_s_coalesced=r.descriptors_min * entry.per_descriptor_s,
                                  fixed_s=r.reads * entry.per_read_s))
    return TransferEstimate(isl=transfer.isl, calibration=entry, per_rank=tuple(ranks))
