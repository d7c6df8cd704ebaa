"""Options and the argument checks every `convert` entry point shares (convert and --check).

Below both ``convert`` and ``convert_check``, so neither imports the other's internals."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from hybridpd.convert.engine import DEFAULT_CHUNK
from hybridpd.convert.header import Header
from hybridpd.convert.plan import DS, SD, Geometry
from hybridpd.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    to: str | None = None  # SD | DS; required to convert, optional for check
    model: str | None = None  # resolved like `plan`: bundled id/alias, path, HF cache
    geometry: Geometry | None = None  # instead of model (library callers)
    num_spec: int = 0
    pattern: str | None = None  # regex selecting conv states by name (default: 'conv')
    from_layout: str | None = None
    tp_split: int | None = None
    tp_merge: bool = False
    force: bool = False
    device: str = "cpu"
    checksum: str = "xxh3"  # xxh3 | crc32 | sha256 | none: of every input and output data section
    allow_network: bool = False
    chunk_bytes: int = DEFAULT_CHUNK


@dataclass
class CheckResult:
    pairs: list[dict[str, Any]] = field(default_factory=list)
    mismatch: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def to_dict(self) -> dict[str, Any]:
        return {"operation": "check", "ok": self.ok, "pairs": self.pairs, "first_mismatch": self.mismatch,
                "bytes_compared": sum(p["bytes"] for p in self.pairs), "seconds": round(self.seconds, 6)}


def geometry_for(model: str, num_spec: int = 0, *, allow_network: bool = False) -> Geometry:
    """MODEL (same resolution as ``plan``) -> its Mamba2 geometry; errors for models without Mamba2."""
    from hybridpd.core.families import model_spec
    from hybridpd.core.models import resolve

    spec = model_spec(resolve(model, allow_network=allow_network))
    if spec.mamba is None or spec.mamba_type != "mamba2":
        raise UsageError(f"{spec.model_id} ({spec.family}) has no Mamba2 layers, so no conv state to convert",
                         field="--model", fix="pass a Mamba2 hybrid (e.g. nano, granite-tiny, falcon-h1-0.5b)")
    return Geometry(dims=spec.mamba, num_spec=num_spec, model=spec.model_id)


def layout_arg(v: str | None, what: str) -> str | None:
    if v is None:
        return None
    u = v.upper()
    if u not in (SD, DS):
        raise UsageError(f"{what} {v!r}", field=what, fix="use SD or DS")
    return u


def resolve_geometry(opts: ConvertOptions, header: Header) -> Geometry | None:
    if opts.geometry is not None:
        return opts.geometry
    if opts.model is not None:
        return geometry_for(opts.model, opts.num_spec, allow_network=opts.allow_network)
    return Geometry.from_metadata(header.metadata)


def validated(opts: ConvertOptions) -> ConvertOptions:
    if opts.tp_split is not None and opts.tp_merge:
        raise UsageError("--tp-split and --tp-merge together", field="--tp-split", fix="pass one of them")
    if opts.tp_split is not None and opts.tp_split < 2:
        raise UsageError(f"--tp-split {opts.tp_split}", field="--tp-split", fix="split into 2 or more shards")
    if opts.num_spec < 0:
        raise UsageError("must be >= 0", field="--num-speculative-tokens")
    if opts.num_spec and opts.model is None and opts.geometry is None:
        raise UsageError("--num-speculative-tokens only matters with --model", field="--num-speculative-tokens",
                         fix="pass --model too")
    return replace(opts, from_layout=layout_arg(opts.from_layout, "--from"))
