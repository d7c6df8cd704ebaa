"""``hybridpd convert``: Mamba2 conv state between SD and DS layouts, and across TP sizes.

vLLM keeps a Mamba2 conv state as SD ``(state_len, dim)`` by default and needs DS ``(dim, state_len)``
for NIXL P/D (``VLLM_SSM_CONV_STATE_LAYOUT=DS``); per rank the DS channels are ``[x | B | C]``.
This module converts safetensors state snapshots between the two, splits a full (TP 1) state into
vLLM's per-rank shards (x, B, C and SSM heads sliced separately, B/C groups replicated when
``n_groups % TP != 0``) and merges them back, bit for bit, streaming with bounded memory.

Public API: ``ConvertOptions``, ``convert(input, output, opts) -> ConvertSummary``,
``check(input, output, opts) -> CheckResult``, ``geometry_for(model, num_spec)``.  The modules
beside it: ``header`` (the safetensors header), ``files`` (streaming reads, checksums, atomic
writes), ``plan`` (recognising tensors, per-tensor steps, the metadata keys ``hybridpd.*``),
``engine`` (the streaming transposes), ``paths`` (INPUT/OUTPUT -> jobs), ``check`` (OUTPUT vs INPUT).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpd import __version__
from hybridpd.convert.engine import Engine, counting, resolve_device
from hybridpd.convert.files import AtomicFile, Checksum, Source, Writer, new_checksum
from hybridpd.convert.header import Header, read_header
from hybridpd.convert.options import CheckResult, ConvertOptions, geometry_for, layout_arg, resolve_geometry, validated
from hybridpd.convert.paths import Job, layout_jobs, merge_jobs, split_jobs
from hybridpd.convert.plan import (
    CONV,
    DS,
    META_CONV_TENSORS,
    META_LAYOUT,
    META_SOURCE_CHECKSUM,
    META_SSM_TENSORS,
    META_STATE_LEN,
    META_TP_RANK,
    META_TP_SIZE,
    META_VERSION,
    SD,
    SSM,
    FileRoles,
    Geometry,
    StreamPlan,
    classify,
    plan_layout,
    plan_merge,
    plan_split,
)
from hybridpd.errors import HybridPDError, UsageError

__all__ = ["ConvertOptions", "ConvertSummary", "CheckResult", "Geometry", "convert", "check", "geometry_for",
           "DS", "SD"]


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    path: str
    bytes: int
    data_checksum: str | None  # "<algo>:<hex>" of the data section (the bytes after the header)
    conv_layout: str | None
    tp_size: int | None
    tp_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ConvertSummary:
    operation: str
    to: str | None
    model: str | None
    device: str
    inputs: list[FileInfo] = field(default_factory=list)
    outputs: list[FileInfo] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    layouts_before: set[str] = field(default_factory=set)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        states = [t for t in self.tensors if t["kind"] != "other"]
        return {
            "operation": self.operation, "ok": True, "to": self.to,
            "layout_before": sorted(self.layouts_before), "layout_after": self.to, "model": self.model,
            "device": self.device, "tensors_total": len(self.tensors),
            "tensors_converted": sum(t["action"] in ("transposed", "split", "merged") for t in states),
            "conv_tensors": sum(t["kind"] == CONV for t in self.tensors),
            "ssm_tensors": sum(t["kind"] == SSM for t in self.tensors),
            "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 6),
            "bytes_per_second": int(self.bytes_read / self.seconds) if self.seconds > 0 else None,
            "checksums": {f.path: f.data_checksum for f in (*self.inputs, *self.outputs) if f.data_checksum},
            "inputs": [f.to_dict() for f in self.inputs], "outputs": [f.to_dict() for f in self.outputs],
            "tensors": self.tensors, "notes": self.notes,
        }


def _check_targets(jobs: Sequence[Job], force: bool, *, mkdirs: bool) -> None:
    seen: set[Path] = set()
    sources = [s for j in jobs for s in j.sources]
    for t in (t for j in jobs for t in j.targets):
        if t.resolve() in seen:
            raise UsageError(f"two outputs would be written to {t}", field="OUTPUT", fix="use distinct names")
        seen.add(t.resolve())
        if t.exists():
            if t.is_dir():
                raise UsageError(f"{t} is a directory", field="OUTPUT", fix="pass a file name")
            if any(s.exists() and t.samefile(s) for s in sources):
                raise UsageError(f"OUTPUT {t} is the INPUT; convert never modifies its input", field="OUTPUT",
                                 fix="write to another path")
            if not force:
                raise UsageError(f"{t} exists", field="OUTPUT", fix="pass --force to overwrite")
        if not mkdirs and not t.parent.is_dir():
            raise UsageError(f"directory {t.parent} does not exist", field="OUTPUT", fix=f"mkdir -p {t.parent}")


def _tensor_rows(plan: StreamPlan, src: Path) -> list[dict[str, Any]]:
    return [{"file": str(src), "name": s.name, "kind": s.kind, "action": s.action, "dtype": s.dtype,
             "shape_in": [list(e.shape) for e in s.sources] if len(s.sources) > 1 else list(s.sources[0].shape),
             "shape_out": [list(o.shape) for o in s.outputs] if len(s.outputs) > 1 else list(s.outputs[0].shape),
             "layout_in": s.in_layouts[0], "layout_out": s.out_layouts[0], "recognised_by": s.via or None,
             "note": s.note} for s in plan.steps]


def _out_metadata(src: Header, frs: Sequence[FileRoles], plan: StreamPlan, k: int, geo: Geometry | None,
                  opts: ConvertOptions, to: str) -> dict[str, str]:
    meta = {key: v for key, v in src.metadata.items() if not key.startswith("hybridpd.")}
    conv = [s.name for s in plan.steps if s.kind == CONV]
    ssm = [s.name for s in plan.steps if s.kind == SSM]
    if geo is not None:
        meta.update(geo.to_metadata())
    if conv:
        meta[META_LAYOUT] = to
        meta[META_CONV_TENSORS] = json.dumps(conv)
        lengths = {s.length for s in plan.steps if s.kind == CONV}
        if len(lengths) == 1:
            meta[META_STATE_LEN] = str(lengths.pop())
    if ssm:
        meta[META_SSM_TENSORS] = json.dumps(ssm)
    if plan.op == "tp-split":
        meta[META_TP_SIZE], meta[META_TP_RANK] = str(plan.n_out), str(k)
    elif plan.op == "tp-merge":
        meta[META_TP_SIZE] = "1"
    else:
        if frs[0].tp is not None:
            meta[META_TP_SIZE] = str(frs[0].tp)
        if META_TP_RANK in src.metadata:
            meta[META_TP_RANK] = src.metadata[META_TP_RANK]
    meta[META_VERSION] = __version__
    if opts.checksum != "none":
        meta[META_SOURCE_CHECKSUM] = ",".join([Checksum.placeholder(opts.checksum)] * len(frs))
    return meta


def _plan_job(job: Job, opts: ConvertOptions, to: str) -> tuple[list[Header], list[FileRoles], StreamPlan,
                                                                  Geometry | None]:
    headers = [read_header(p) for p in job.sources]
    geo = resolve_geometry(opts, headers[0])
    frs = [classify(h, geo=geo, pattern=opts.pattern, from_layout=opts.from_layout) for h in headers]
    if opts.tp_split:
        plan = plan_split(frs[0], opts.tp_split, to, geo)
    elif opts.tp_merge:
        plan = plan_merge(frs, to, geo)
    else:
        plan = plan_layout(frs[0], to)
    return headers, frs, plan, geo


def convert(input: str | Path, output: str | Path, opts: ConvertOptions,
            progress: Callable[[int, int], None] | None = None) -> ConvertSummary:
    """Convert INPUT to OUTPUT per ``opts``; never touches INPUT; each output appears whole or not at all."""
    to = layout_arg(opts.to, "--to")
    if to is None:
        raise UsageError("missing --to", field="--to", fix="pass --to DS or --to SD")
    opts = validated(opts)
    op = "tp-split" if opts.tp_split else ("tp-merge" if opts.tp_merge else "convert")
    if opts.tp_split:
        jobs = split_jobs(str(input), str(output), opts.tp_split)
    elif opts.tp_merge:
        jobs = merge_jobs(str(input), str(output))
    else:
        jobs = layout_jobs(str(input), str(output))
    planned = [(job, *_plan_job(job, opts, to)) for job in jobs]  # every error before any write
    wanted = (CONV,) if op == "convert" else (CONV, SSM)
    if not any(s.kind in wanted for *_, plan, _ in planned for s in plan.steps):
        raise UsageError(f"no {' or '.join(wanted)} state found in {input} (pattern {opts.pattern or 'conv'!r})",
                         field="--pattern", fix="pass --pattern REGEX for the conv state names, or --model")
    mkdirs = op != "convert" or Path(str(input)).is_dir()  # OUTPUT names a directory (or a template)
    _check_targets(jobs, opts.force, mkdirs=mkdirs)
    device = resolve_device(opts.device)
    for t in (t for j in jobs for t in j.targets):
        try:
            t.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create directory {t.parent}: {e.strerror}", field="OUTPUT",
                             fix="choose an OUTPUT under a writable directory; nothing was written") from None
    summary = ConvertSummary(operation=op, to=to, model=opts.model or (opts.geometry.model if opts.geometry else None),
                             device=device)
    total = sum(h.data_bytes for _, headers, *_ in planned for h in headers)
    engine = Engine(device=device, chunk_bytes=opts.chunk_bytes, progress=counting(progress, total))
    if any(s.mode != "raw" for *_, plan, _ in planned for s in plan.steps):
        import torch  # noqa: F401  (imported before the clock starts: a one-off, not conversion time)
    t0 = time.perf_counter()
    for job, headers, frs, plan, geo in planned:
        _run_job(job, headers, frs, plan, geo, opts, to, engine, summary)
    summary.seconds = time.perf_counter() - t0
    return summary


def _run_job(job: Job, headers: list[Header], frs: list[FileRoles], plan: StreamPlan, geo: Geometry | None,
             opts: ConvertOptions, to: str, engine: Engine, summary: ConvertSummary) -> None:
    sources = [Source(h) for h in headers]
    in_order = [t.name for t in headers[0].tensors]
    for s, h in zip(sources, headers, strict=True):  # a hash needs the file read in its own order
        s.hasher = new_checksum(opts.checksum) if [t.name for t in h.tensors] == in_order else None
    writers: list[Writer] = []
    out_digests: list[str | None] = []
    try:
        for k, target in enumerate(job.targets):
            meta = _out_metadata(headers[0], frs, plan, k, geo, opts, to)
            writers.append(Writer(AtomicFile(target, force=opts.force), plan.out_entries(k), meta,
                                  checksum=opts.checksum))
        engine.run(plan, sources, writers)
        digests = [s.hasher.value if s.hasher else None for s in sources]
        none = Checksum.placeholder(opts.checksum) if opts.checksum != "none" else ""
        patch = {META_SOURCE_CHECKSUM: ",".join(d or none for d in digests)} if none else {}
        for w in writers:  # each commit is atomic; say exactly which happened if a later one fails
            out_digests.append(w.finish(patch))
    except BaseException as e:
        for w in writers[len(out_digests):]:
            w.abort()
        if isinstance(e, OSError):  # disk full, permissions, a vanished file: a failure, not a bug
            done = [f.path for f in summary.outputs] + [str(t) for t in job.targets[:len(out_digests)]]
            said = (f"these outputs were written whole before it: {', '.join(done)}; nothing else was written"
                    if done else "nothing was written under OUTPUT")
            raise HybridPDError(f"I/O error while converting {job.sources[0]}: {e}", field="OUTPUT",
                                fix=f"check free space and permissions; {said}") from e
        raise
    finally:
        for s in sources:
            s.close()
    for s, fr, d in zip(sources, frs, digests, strict=True):
        summary.inputs.append(FileInfo(path=str(s.header.path), bytes=s.header.file_size, data_checksum=d,
                                       conv_layout=",".join(fr.layouts) or None, tp_size=fr.tp,
                                       tp_rank=_int(s.header.metadata.get(META_TP_RANK))))
        summary.layouts_before.update(fr.layouts)
        summary.bytes_read += s.bytes_read
    for t, w, d in zip(job.targets, writers, out_digests, strict=True):
        meta = w.metadata
        summary.outputs.append(FileInfo(path=str(t), bytes=t.stat().st_size, data_checksum=d,
                                        conv_layout=meta.get(META_LAYOUT), tp_size=_int(meta.get(META_TP_SIZE)),
                                        tp_rank=_int(meta.get(META_TP_RANK))))
        summary.bytes_written += len(w.header) + w.bytes_written
    summary.tensors.extend(_tensor_rows(plan, job.sources[0]))
    notes = {s.note for s in plan.steps if s.note}
    summary.notes.extend(sorted(n for n in notes if n not in summary.notes))


def _int(v: str | None) -> int | None:
    return int(v) if v is not None and v.isdigit() else None


def check(input: str | Path, output: str | Path, opts: ConvertOptions,
          progress: Callable[[int, int], None] | None = None) -> CheckResult:
    """Verify OUTPUT against INPUT (SD vs DS, or a full state vs its shards); the first mismatch, if any."""
    from hybridpd.convert.check import run_check

    return run_check(input, output, opts, progress)
