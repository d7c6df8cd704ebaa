"""``convert --check``: verify an existing pair (SD vs DS, or a full state vs its TP shards).

The reference (the full state, or INPUT of a layout pair) is streamed through the same plan and
engine as a conversion, but each output chunk is compared with the existing file instead of being
written; the first differing element is reported with its tensor, index and both values.  The
compared file's layout is read from its shapes, so a pair converted either way checks the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridpd.convert.engine import CompareSink, Engine, Mismatch, counting, resolve_device
from hybridpd.convert.files import Source
from hybridpd.convert.header import Header, read_header
from hybridpd.convert.options import CheckResult, ConvertOptions, layout_arg, resolve_geometry, validated
from hybridpd.convert.paths import check_jobs
from hybridpd.convert.plan import (
    CONV,
    DS,
    META_CONV_TENSORS,
    META_LAYOUT,
    SD,
    Geometry,
    StreamPlan,
    classify,
    plan_layout,
    plan_split,
)
from hybridpd.errors import UsageError


def _swap(shape: Sequence[int]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


def _hint_from_target(ref: Header, tgt: Header) -> str | None:
    """Layout of the reference implied by a target that records its own (same shape: same layout)."""
    lay, listed = tgt.metadata.get(META_LAYOUT), tgt.metadata.get(META_CONV_TENSORS)
    if META_LAYOUT in ref.metadata or lay not in (SD, DS) or not listed:
        return None
    import json

    refs, tgts = ref.by_name(), tgt.by_name()
    for name in json.loads(listed):
        if name in refs and name in tgts:
            a, b = refs[name].shape, tgts[name].shape
            if len(a) >= 2 and a[-1] != a[-2]:
                if a == b:
                    return lay
                if _swap(a) == b:
                    return DS if lay == SD else SD
    return None


def _target_layouts(draft: StreamPlan, tgt: Header, k: int, to: str | None) -> tuple[dict[str, str], dict | None]:
    """Per conv tensor, the layout the target holds it in (from its shape); or the first structural mismatch."""
    tensors = tgt.by_name()
    out: dict[str, str] = {}
    expected = {s.name for s in draft.steps}
    for s in draft.steps:
        e = tensors.get(s.name)
        base = {"file": str(tgt.path), "tensor": s.name, "index": None}
        if e is None:
            return out, {**base, "reason": "missing from the compared file"}
        if e.dtype != s.dtype:
            return out, {**base, "reason": f"dtype {e.dtype}, expected {s.dtype}"}
        ds_shape = s.outputs[k].shape
        if s.kind != CONV:
            if e.shape != ds_shape:
                return out, {**base, "reason": f"shape {list(e.shape)}, expected {list(ds_shape)}"}
            continue
        forms = [lay for lay, shp in ((DS, ds_shape), (SD, _swap(ds_shape))) if e.shape == shp]
        if not forms:
            return out, {**base, "reason": f"shape {list(e.shape)} is neither the DS {list(ds_shape)} nor the SD "
                                           f"{list(_swap(ds_shape))} form"}
        lay = forms[0] if len(forms) == 1 else tgt.metadata.get(META_LAYOUT, to)
        if lay is None:
            raise UsageError(f"{tgt.path.name}: tensor {s.name!r} is square; its layout cannot be told",
                             field="--to", fix="pass --to with the compared file's layout")
        if to is not None and lay != to:
            return out, {**base, "reason": f"conv layout is {lay}, --to asks for {to}"}
        out[s.name] = lay
    for name in tensors:
        if name not in expected:
            return out, {"file": str(tgt.path), "tensor": name, "index": None, "reason": "not in the reference"}
    return out, None


def run_check(input: str | Path, output: str | Path, opts: ConvertOptions,
              progress: Callable[[int, int], None] | None = None) -> CheckResult:
    to = layout_arg(opts.to, "--to")
    opts = validated(opts)
    jobs = check_jobs(str(input), str(output))
    device = resolve_device(opts.device)
    result = CheckResult()
    t0 = time.perf_counter()
    plans: list[tuple[Any, ...]] = []
    for job in jobs:
        ref, tgts = read_header(job.sources[0]), [read_header(t) for t in job.targets]
        geo: Geometry | None = resolve_geometry(opts, ref) or Geometry.from_metadata(tgts[0].metadata)
        hint = opts.from_layout or (_hint_from_target(ref, tgts[0]) if geo is None and len(tgts) == 1 else None)
        fr = classify(ref, geo=geo, pattern=opts.pattern, from_layout=hint)
        n = len(tgts)
        draft = plan_layout(fr, DS) if n == 1 else plan_split(fr, n, DS, geo)
        maps: list[Mapping[str, str]] = []
        for k, tgt in enumerate(tgts):
            lays, bad = _target_layouts(draft, tgt, k, to)
            if bad is not None:
                result.mismatch = bad
                result.seconds = time.perf_counter() - t0
                return result
            maps.append(lays)
        plan = plan_layout(fr, maps[0]) if n == 1 else plan_split(fr, n, maps, geo)
        plans.append((job, ref, tgts, fr, plan, maps))
    total = sum(ref.data_bytes for _, ref, *_ in plans)
    engine = Engine(device=device, chunk_bytes=opts.chunk_bytes, progress=counting(progress, total))
    for job, ref, tgts, fr, plan, maps in plans:
        src, targets = Source(ref), [Source(t) for t in tgts]
        try:
            engine.run(plan, [src], [CompareSink(t) for t in targets])
        except Mismatch as e:
            result.mismatch = e.info
        finally:
            for s in (src, *targets):
                s.close()
        result.pairs.append({"reference": str(job.sources[0]), "compared": [str(t) for t in job.targets],
                             "kind": "layout" if len(tgts) == 1 else "tp-shards", "tensors": len(plan.steps),
                             "bytes": sum(t.data_bytes for t in tgts), "layout_reference": list(fr.layouts),
                             "layout_compared": sorted({v for m in maps for v in m.values()}),
                             "ok": result.mismatch is None})
        if result.mismatch is not None:
            break
    result.seconds = time.perf_counter() - t0
    return result
