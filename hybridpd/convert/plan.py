"""What ``convert`` will do to each tensor, decided from headers alone (pure: no tensor bytes read).

``Geometry`` wraps a model's Mamba2 dims and answers the conv/SSM shape questions per TP size, using
``hybridpd.core.mamba`` as the one definition of per-rank conv geometry and of which global channels and
heads rank r holds.  ``classify`` decides, for every tensor of a file, whether it is a conv state
(and which way it lies), an SSM state, or something to copy; ``plan_layout``, ``plan_split`` and
``plan_merge`` turn those roles into ``Step``s the engine streams.

A conv state of a rank is ``[x | B | C]`` channels, each ``state_len`` long: SD stores it
``(..., state_len, dim)``, DS ``(..., dim, state_len)``.  Every operation is expressed on the DS
view as a channel gather (split) or scatter (merge) of contiguous channel runs; SSM states
``(..., heads, head_dim, state)`` are the same with heads as channels and no transpose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from math import prod
from pathlib import Path

from hybridpd.convert.header import STATE_DTYPES, Header, TensorEntry
from hybridpd.core.families import MambaDims
from hybridpd.core.mamba import DS, SD, MambaRankState, global_conv_channel_index, rank_channels
from hybridpd.errors import UsageError

CONV, SSM, OTHER = "conv", "ssm", "other"
DEFAULT_PATTERN = "conv"

# Metadata keys written into every output (all values are strings, as safetensors requires).
META_LAYOUT = "hybridpd.conv_layout"  # "SD" | "DS": layout of every conv tensor in the file
META_TP_SIZE = "hybridpd.tp_size"  # TP size the states belong to
META_TP_RANK = "hybridpd.tp_rank"  # rank of this shard (split outputs; preserved otherwise)
META_STATE_LEN = "hybridpd.state_len"  # conv_kernel - 1 + speculative tokens
META_CONV_TENSORS = "hybridpd.conv_tensors"  # JSON list: names of the conv states
META_SSM_TENSORS = "hybridpd.ssm_tensors"  # JSON list: names of the SSM states
META_DIMS = "hybridpd.mamba_dims"  # JSON MambaDims: lets merge/check work without --model
META_NUM_SPEC = "hybridpd.num_speculative_tokens"
META_MODEL = "hybridpd.model"  # --model when given: a Hub id as given, a local path by its folder name only
META_SOURCE_CHECKSUM = "hybridpd.source_checksum"  # "<algo>:<hex>" of each source's data section, comma-joined
META_VERSION = "hybridpd.version"

Run = tuple[int, int]  # [start, stop) channel run


def _ranges(idx: Sequence[int]) -> tuple[Run, ...]:
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


def model_label(model: str) -> str:
    """What the output file records of ``--model``: a Hub id unchanged, a local path only by its last component.

    An absolute path would make the output depend on where the user (or pytest) keeps the model: the header, and so
    the shard sizes, would change with the path's length, and the file would carry the user's directory layout."""
    path = Path(model).expanduser()
    if path.is_absolute() or path.exists():
        return path.resolve().name or model
    return model


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """A model's Mamba2 dims plus speculative tokens: everything needed to recognise and shard states."""

    dims: MambaDims
    num_spec: int = 0
    model: str | None = None

    @property
    def state_len(self) -> int:
        return self.dims.conv_kernel - 1 + self.num_spec

    def rank_state(self, tp: int, elem: int = 2) -> MambaRankState:
        return MambaRankState(dims=self.dims, tp=tp, num_spec=self.num_spec, conv_dtype="", conv_elem=elem,
                              ssm_dtype="", ssm_elem=elem)

    @cached_property
    def tps(self) -> tuple[int, ...]:
        """TP sizes vLLM can run this model at (x, heads, conv_dim divisible; groups shardable)."""
        out = []
        for t in range(1, self.dims.num_heads + 1):
            try:
                st = self.rank_state(t)
                _ = st.conv, st.heads
                rank_channels(self.dims, t, 0)
            except UsageError:
                continue
            out.append(t)
        return tuple(out)

    @cached_property
    def tp_by_conv_dim(self) -> dict[int, int]:
        return {self.rank_state(t).conv.dim: t for t in self.tps}

    @cached_property
    def tp_by_heads(self) -> dict[int, int]:
        return {self.dims.num_heads // t: t for t in self.tps}

    def conv_runs(self, tp: int, rank: int) -> tuple[Run, ...]:
        """Rank ``rank``'s conv channels as runs of TP=1 channels, in the rank's local order."""
        return _ranges(global_conv_channel_index(self.dims, rank_channels(self.dims, tp, rank)))

    def head_runs(self, tp: int, rank: int) -> tuple[Run, ...]:
        return _ranges(rank_channels(self.dims, tp, rank).heads)

    def ssm_tail(self, tp: int) -> tuple[int, int, int]:
        return self.rank_state(tp).ssm_shape

    def describe(self) -> str:
        d = self.dims
        dims = ", ".join(f"{self.rank_state(t).conv.dim} (TP {t})" for t in self.tps[:6])
        return (f"{self.model or 'the model'}: state_len {self.state_len} (conv_kernel {d.conv_kernel} - 1 + "
                f"{self.num_spec} speculative), conv dim per rank {dims}")

    def to_metadata(self) -> dict[str, str]:
        d = self.dims
        meta = {META_DIMS: json.dumps({"num_heads": d.num_heads, "head_dim": d.head_dim, "n_groups": d.n_groups,
                                       "state_size": d.state_size, "conv_kernel": d.conv_kernel,
                                       "intermediate_size": d.intermediate_size}, sort_keys=True),
                META_NUM_SPEC: str(self.num_spec), META_STATE_LEN: str(self.state_len)}
        if self.model:
            meta[META_MODEL] = model_label(self.model)
        return meta

    @staticmethod
    def from_metadata(meta: Mapping[str, str]) -> Geometry | None:
        if META_DIMS not in meta:
            return None
        try:
            dims = MambaDims(**{k: int(v) for k, v in json.loads(meta[META_DIMS]).items()})
            return Geometry(dims=dims, num_spec=int(meta.get(META_NUM_SPEC, "0")), model=meta.get(META_MODEL))
        except (TypeError, ValueError):
            raise UsageError(f"metadata {META_DIMS} is malformed: {meta[META_DIMS]!r}", field=META_DIMS,
                             fix="pass --model") from None


@dataclass(frozen=True, kw_only=True)
class Role:
    kind: str  # CONV | SSM | OTHER
    via: str = ""  # "pattern" | "shape" | "metadata" for states
    layout: str | None = None  # conv: SD | DS
    channels: int = 0  # conv: dim; ssm: heads
    length: int = 0  # conv: state_len; ssm: head_dim * state (elements per channel)
    tp: int | None = None
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class FileRoles:
    header: Header
    roles: Mapping[str, Role]
    tp: int | None

    @property
    def layouts(self) -> tuple[str, ...]:
        return tuple(sorted({r.layout for r in self.roles.values() if r.layout}))


def _err(entry: TensorEntry, header: Header, msg: str, fix: str, fld: str = "--model") -> UsageError:
    return UsageError(f"{header.path.name}: tensor {entry.name!r} {list(entry.shape)} {msg}", field=fld, fix=fix)


def _meta_int(header: Header, key: str) -> int | None:
    v = header.metadata.get(key)
    return int(v) if v is not None and v.isdigit() and len(v) < 10 else None


def _conv_role(entry: TensorEntry, header: Header, geo: Geometry | None, hint: str | None, via: str,
               hint_from_metadata: bool = False, meta_state_len: int | None = None) -> Role:
    a, b = entry.shape[-2:]
    if geo is None:
        if hint is None:
            sq = " (square: its shape cannot say)" if a == b else ""
            raise _err(entry, header, f"is a conv state, but is it SD (state_len, dim) or DS (dim, state_len)?{sq}",
                       "pass --from SD|DS, or --model so the shape can be recognised", "--from")
        dim, length = (b, a) if hint == SD else (a, b)
        # a conv state has conv_kernel - 1 (+ spec) rows and many channels; hybridpd's own files record state_len
        wrong = (length != meta_state_len and dim == meta_state_len) if meta_state_len else length > dim
        if wrong and hint_from_metadata:
            other = DS if hint == SD else SD
            raise _err(entry, header, f"read as {hint}, as the file's {META_LAYOUT} metadata says, gives state_len "
                       f"{length} > dim {dim}: the shape is that of a conv state in {other} layout, and converting it as {hint} "
                       "would transpose it wrongly", f"pass --from {other} if the metadata is wrong, or --model so the "
                       "shape decides", "--from")
        note = (f"state_len {length} > dim {dim}: check --from" if length > dim else None)
        return Role(kind=CONV, via=via, layout=hint, channels=dim, length=length, note=note)
    L, dims = geo.state_len, geo.tp_by_conv_dim
    if a == b and hint is not None and a == L and a in dims:  # square, but the file or --from says which way
        return Role(kind=CONV, via=via, layout=hint, channels=a, length=L, tp=dims[a])
    if a == b:
        raise _err(entry, header, "is square, so its layout is ambiguous and it cannot be a conv state of "
                   + geo.describe(), "pass --from SD|DS and check --model / --num-speculative-tokens")
    sd, ds = a == L and b in dims, b == L and a in dims
    if not (sd or ds):
        fix = "check --model, or narrow --pattern so it selects only conv states"
        for d_, l_ in ((b, a), (a, b)):
            if d_ in dims and l_ != L and l_ > geo.dims.conv_kernel - 1:
                fix = f"state_len {l_} means --num-speculative-tokens {l_ - geo.dims.conv_kernel + 1}"
        raise _err(entry, header, "does not match " + geo.describe(), fix)
    layout = SD if sd else DS
    if hint is not None and hint != layout:
        raise _err(entry, header, f"lies {layout} for {geo.model or 'the model'} but the file/--from says {hint}",
                   "drop --from or fix the file's hybridpd.conv_layout metadata", "--from")
    dim = b if sd else a
    return Role(kind=CONV, via=via, layout=layout, channels=dim, length=L, tp=dims[dim])


def _ssm_role(entry: TensorEntry, geo: Geometry | None) -> Role | None:
    if geo is None or entry.dtype not in STATE_DTYPES or len(entry.shape) < 3:
        return None
    h, hd, ss = entry.shape[-3:]
    if hd == geo.dims.head_dim and ss == geo.dims.state_size and h in geo.tp_by_heads:
        return Role(kind=SSM, via="shape", channels=h, length=hd * ss, tp=geo.tp_by_heads[h])
    return None


def _conv_shape_match(entry: TensorEntry, geo: Geometry | None) -> bool:
    if geo is None or entry.dtype not in STATE_DTYPES or len(entry.shape) < 2:
        return False
    a, b = entry.shape[-2:]
    dims, L = geo.tp_by_conv_dim, geo.state_len
    return a != b and ((a == L and b in dims) or (b == L and a in dims))


def classify(header: Header, *, geo: Geometry | None, pattern: str | None, from_layout: str | None) -> FileRoles:
    """Roles of every tensor. Conv states are chosen by ``pattern`` (default: names containing 'conv'),
    by the file's own ``hybridpd.conv_tensors`` list when no pattern is given, or, with a model, by shape."""
    declared = header.metadata.get(META_LAYOUT)
    if declared is not None and declared not in (SD, DS):
        raise UsageError(f"{header.path.name}: metadata {META_LAYOUT}={declared!r}", field=META_LAYOUT,
                         fix="must be SD or DS")
    if from_layout and declared and from_layout != declared:
        raise UsageError(f"--from {from_layout} but {header.path.name} records {META_LAYOUT}={declared}",
                         field="--from", fix=f"drop --from or pass --from {declared}")
    hint = from_layout or declared
    listed: set[str] | None = None
    if pattern is None and META_CONV_TENSORS in header.metadata:
        listed = set(json.loads(header.metadata[META_CONV_TENSORS]))
    try:
        rx = re.compile(pattern or DEFAULT_PATTERN)
    except re.error as e:
        raise UsageError(f"--pattern {pattern!r} is not a regular expression: {e}", field="--pattern") from None
    roles: dict[str, Role] = {}
    for t in header.tensors:
        chosen, via = (t.name in listed, "metadata") if listed is not None else (bool(rx.search(t.name)), "pattern")
        ssm = _ssm_role(t, geo)
        if not chosen and listed is None and _conv_shape_match(t, geo):
            if ssm is not None:
                raise _err(t, header, "fits both a conv state and an SSM state", "select conv states with --pattern",
                           "--pattern")
            chosen, via = True, "shape"
        if chosen and (t.dtype not in STATE_DTYPES or len(t.shape) < 2):
            if via == "metadata":
                raise _err(t, header, f"is listed in {META_CONV_TENSORS} but is {t.dtype} with < 2 dims or not float",
                           "fix the file's metadata", META_CONV_TENSORS)
            roles[t.name] = Role(kind=OTHER, note=f"name matches, but {t.dtype} {list(t.shape)} is no conv state")
        elif chosen:
            roles[t.name] = _conv_role(t, header, geo, hint, via, hint_from_metadata=from_layout is None and
                                       declared is not None, meta_state_len=_meta_int(header, META_STATE_LEN))
        else:
            roles[t.name] = ssm or Role(kind=OTHER)
    tps = {r.tp for r in roles.values() if r.tp is not None}
    if len(tps) > 1:
        raise UsageError(f"{header.path.name} mixes states of TP sizes {sorted(tps)}", field="INPUT",
                         fix="convert files of one TP size at a time, or narrow --pattern")
    tp = tps.pop() if tps else None
    meta_tp = header.metadata.get(META_TP_SIZE)
    if meta_tp is not None and tp is not None and meta_tp != str(tp):
        raise UsageError(f"{header.path.name} records {META_TP_SIZE}={meta_tp} but its states are TP {tp} shaped",
                         field="--model", fix="check --model and --num-speculative-tokens")
    if tp is None and meta_tp is not None and meta_tp.isdigit():
        tp = int(meta_tp)
    return FileRoles(header=header, roles=roles, tp=tp)


@dataclass(frozen=True, kw_only=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Step:
    """One tensor's work. ``gather``: 1 source -> N outputs, output r takes source channels ``runs[r]``;
    ``scatter``: N sources -> 1 output, source r fills output channels ``runs[r]`` (``place[r][i]`` False
    means a replica: compare, don't write); ``raw``: bytes copied (N outputs) or verified equal (N sources)."""

    name: str
    kind: str
    mode: str  # "raw" | "gather" | "scatter"
    action: str  # unchanged | transposed | split | merged | copied | replicated
    dtype: str
    elem: int
    rows: int  # product of the leading dims
    length: int  # elements per channel (state_len for conv)
    sources: tuple[TensorEntry, ...]
    in_layouts: tuple[str | None, ...]
    in_channels: tuple[int, ...]
    outputs: tuple[OutTensor, ...]
    out_layouts: tuple[str | None, ...]
    out_channels: tuple[int, ...]
    runs: tuple[tuple[Run, ...], ...] = ()
    place: tuple[tuple[bool, ...], ...] = ()
    via: str = ""
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class StreamPlan:
    op: str
    steps: tuple[Step, ...]
    n_out: int

    def out_entries(self, i: int) -> list[tuple[str, str, tuple[int, ...], int]]:
        return [(s.outputs[i].name, s.dtype, s.outputs[i].shape, s.outputs[i].nbytes) for s in self.steps]


def _shape(lead: tuple[int, ...], channels: int, length: int, layout: str | None,
           tail: tuple[int, ...]) -> tuple[int, ...]:
    if layout == SD:
        return (*lead, length, channels)
    if layout == DS:
        return (*lead, channels, length)
    return (*lead, channels, *tail)  # ssm: heads, head_dim, state


def _out(name: str, dtype: str, shape: tuple[int, ...], elem: int) -> OutTensor:
    return OutTensor(name=name, dtype=dtype, shape=shape, nbytes=prod(shape) * elem)


def _raw(entries: Sequence[TensorEntry], n_out: int, note: str | None, kind: str = OTHER) -> Step:
    e = entries[0]
    action = "copied" if len(entries) == 1 and n_out == 1 else ("replicated" if n_out > 1 else "merged")
    out = OutTensor(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes)
    return Step(name=e.name, kind=kind, mode="raw", action=action, dtype=e.dtype, elem=e.elem or 1, rows=1,
                length=e.nbytes, sources=tuple(entries), in_layouts=(None,) * len(entries),
                in_channels=(1,) * len(entries), outputs=(out,) * n_out, out_layouts=(None,) * n_out,
                out_channels=(1,) * n_out, note=note)


def _lead(entry: TensorEntry, kind: str) -> tuple[int, ...]:
    return entry.shape[:-2] if kind == CONV else entry.shape[:-3]


def plan_layout(fr: FileRoles, to: str | Mapping[str, str]) -> StreamPlan:
    """One file to one file: conv states to ``to`` (a layout, or per-tensor layouts for --check)."""
    steps = []
    for e in fr.header.tensors:
        r = fr.roles[e.name]
        target = to if isinstance(to, str) else to.get(e.name, r.layout or SD)
        if r.kind != CONV or r.layout == target:
            steps.append(replace(_raw([e], 1, r.note, r.kind), action="unchanged" if r.kind == CONV else "copied",
                                 in_layouts=(r.layout,), out_layouts=(r.layout,), via=r.via))
            continue
        lead = _lead(e, CONV)
        shape = _shape(lead, r.channels, r.length, target, ())
        steps.append(Step(name=e.name, kind=CONV, mode="gather", action="transposed", dtype=e.dtype,
                          elem=e.elem or 1, rows=prod(lead), length=r.length, sources=(e,), in_layouts=(r.layout,),
                          in_channels=(r.channels,), outputs=(_out(e.name, e.dtype, shape, e.elem or 1),),
                          out_layouts=(target,), out_channels=(r.channels,), runs=(((0, r.channels),),),
                          via=r.via, note=r.note))
    return StreamPlan(op="convert", steps=tuple(steps), n_out=1)


def _need_geo(geo: Geometry | None, op: str) -> Geometry:
    if geo is None:
        raise UsageError(f"{op} needs the model's x|B|C split and head count", field="--model",
                         fix="pass --model MODEL (or use files written by hybridpd, which record the dims)")
    return geo


def plan_split(fr: FileRoles, n: int, to: str | Sequence[Mapping[str, str]], geo: Geometry | None) -> StreamPlan:
    """A full (TP 1) state to ``n`` per-rank states, vLLM's sharding (group replication included)."""
    geo = _need_geo(geo, "--tp-split")
    if n not in geo.tps or n < 2:
        valid = ", ".join(str(t) for t in geo.tps if t > 1) or "none"
        raise UsageError(f"--tp-split {n}: {geo.model or 'the model'} cannot run at TP {n}", field="--tp-split",
                         fix=f"valid TP sizes: {valid}")
    if fr.tp not in (None, 1):
        raise UsageError(f"{fr.header.path.name} holds TP {fr.tp} states; --tp-split needs the full (TP 1) state",
                         field="--tp-split", fix="merge the shards first with --tp-merge")
    steps = []
    for e in fr.header.tensors:
        r = fr.roles[e.name]
        if r.kind == OTHER:
            steps.append(_raw([e], n, r.note))
            continue
        runs = tuple(geo.conv_runs(n, k) if r.kind == CONV else geo.head_runs(n, k) for k in range(n))
        chans = tuple(sum(b - a for a, b in rr) for rr in runs)
        lead = _lead(e, r.kind)
        outs, lays = [], []
        for k in range(n):
            lay = (to if isinstance(to, str) else to[k].get(e.name, SD)) if r.kind == CONV else None
            lays.append(lay)
            outs.append(_out(e.name, e.dtype, _shape(lead, chans[k], r.length, lay, e.shape[-2:]), e.elem or 1))
        steps.append(Step(name=e.name, kind=r.kind, mode="gather", action="split", dtype=e.dtype, elem=e.elem or 1,
                          rows=prod(lead), length=r.length, sources=(e,), in_layouts=(r.layout,),
                          in_channels=(r.channels,), outputs=tuple(outs), out_layouts=tuple(lays), out_channels=chans,
                          runs=runs, via=r.via))
    return StreamPlan(op="tp-split", steps=tuple(steps), n_out=n)


def _first_provider(runs: Sequence[tuple[Run, ...]], channels: int) -> tuple[tuple[tuple[Run, ...], ...],
                                                                             tuple[tuple[bool, ...], ...]]:
    """Cut each rank's runs where channels were already provided by a lower rank (replicated groups):
    those pieces are compared, not written."""
    seen = [False] * channels
    out_runs, out_place = [], []
    for rr in runs:
        pieces: list[Run] = []
        flags: list[bool] = []
        for a, b in rr:
            start = a
            for c in range(a + 1, b + 1):
                if c == b or seen[c] != seen[start]:
                    pieces.append((start, c))
                    flags.append(not seen[start])
                    start = c
        for a, b in rr:
            seen[a:b] = [True] * (b - a)
        out_runs.append(tuple(pieces))
        out_place.append(tuple(flags))
    return tuple(out_runs), tuple(out_place)


def plan_merge(shards: Sequence[FileRoles], to: str, geo: Geometry | None) -> StreamPlan:
    """``n`` per-rank states (in rank order) back to the full state; replicas must agree bit for bit."""
    geo = _need_geo(geo, "--tp-merge")
    n = len(shards)
    first = shards[0]
    for k, fr in enumerate(shards):
        if fr.tp not in (None, n):
            raise UsageError(f"{fr.header.path.name} holds TP {fr.tp} states but {n} shards were given",
                             field="INPUT", fix=f"pass all {fr.tp} shards of one state")
        names = [t.name for t in fr.header.tensors]
        if sorted(names) != sorted(t.name for t in first.header.tensors):
            raise UsageError(f"shard {k} ({fr.header.path.name}) holds different tensors than shard 0",
                             field="INPUT", fix="pass the shards of one state")
    steps = []
    by_name = [fr.header.by_name() for fr in shards]
    for e0 in first.header.tensors:
        entries = [m[e0.name] for m in by_name]
        roles = [fr.roles[e0.name] for fr in shards]
        kinds = {r.kind for r in roles}
        if len(kinds) > 1 or any(e.dtype != e0.dtype for e in entries):
            raise UsageError(f"tensor {e0.name!r} differs in kind or dtype between shards", field="INPUT",
                             fix="pass the shards of one state")
        r0 = roles[0]
        if r0.kind == OTHER:
            if any(e.shape != e0.shape for e in entries):
                raise UsageError(f"tensor {e0.name!r} has different shapes on different shards", field="INPUT",
                                 fix="if it is a per-rank state, select it with --pattern/--model")
            steps.append(_raw(entries, 1, r0.note))
            continue
        chans = geo.rank_state(1).conv.dim if r0.kind == CONV else geo.dims.num_heads
        runs, place = _first_provider(
            [geo.conv_runs(n, k) if r0.kind == CONV else geo.head_runs(n, k) for k in range(n)], chans)
        lead = _lead(e0, r0.kind)
        if any(_lead(e, r0.kind) != lead for e in entries):
            raise UsageError(f"tensor {e0.name!r}: leading dims differ between shards", field="INPUT")
        lay = to if r0.kind == CONV else None
        out = _out(e0.name, e0.dtype, _shape(lead, chans, r0.length, lay, e0.shape[-2:]), e0.elem or 1)
        steps.append(Step(name=e0.name, kind=r0.kind, mode="scatter", action="merged", dtype=e0.dtype,
                          elem=e0.elem or 1, rows=prod(lead), length=r0.length, sources=tuple(entries),
                          in_layouts=tuple(r.layout for r in roles), in_channels=tuple(r.channels for r in roles),
                          outputs=(out,), out_layouts=(lay,), out_channels=(chans,), runs=runs,
                          place=tuple(place), via=r0.via))
    return StreamPlan(op="tp-merge", steps=tuple(steps), n_out=1)
