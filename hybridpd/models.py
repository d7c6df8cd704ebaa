"""Resolve MODEL (bundled id/alias, local path, or Hugging Face cache) to a raw config dict."""

from __future__ import annotations

import difflib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import ConfigError, ModelNotFound

# Short aliases an operator can type. Values are Hugging Face ids of bundled configs.
ALIASES: dict[str, str] = {
    "nano": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "nano-bf16": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "nano-fp8": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8",
    "nano-nvfp4": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4",
    "super": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
    "super-bf16": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
    "super-fp8": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8",
    "super-nvfp4": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4",
    "nemotron-h-8b": "nvidia/Nemotron-H-8B-Base-8K",
    "nemotron-h-47b": "nvidia/Nemotron-H-47B-Base-8K",
    "nemotron-h-56b": "nvidia/Nemotron-H-56B-Base-8K",
    "nano-9b-v2": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
    "nano-12b-v2": "nvidia/NVIDIA-Nemotron-Nano-12B-v2",
    "granite-tiny": "ibm-granite/granite-4.0-h-tiny",
    "granite-micro": "ibm-granite/granite-4.0-h-micro",
    "granite-small": "ibm-granite/granite-4.0-h-small",
    "falcon-h1-0.5b": "tiiuae/Falcon-H1-0.5B-Instruct",
    "falcon-h1-1.5b": "tiiuae/Falcon-H1-1.5B-Instruct",
    "falcon-h1-1.5b-deep": "tiiuae/Falcon-H1-1.5B-Deep-Instruct",
    "falcon-h1-3b": "tiiuae/Falcon-H1-3B-Instruct",
    "falcon-h1-7b": "tiiuae/Falcon-H1-7B-Instruct",
    "falcon-h1-34b": "tiiuae/Falcon-H1-34B-Instruct",
    "mamba2-2.7b": "state-spaces/mamba2-2.7b",
    "zamba2-2.7b": "Zyphra/Zamba2-2.7B",
    "jamba": "ai21labs/Jamba-v0.1",
    "jamba-mini-1.6": "ai21labs/AI21-Jamba-Mini-1.6",
    "qwen3-next": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
}


@dataclass(frozen=True, kw_only=True)
class RawModel:
    """A config.json as read, plus where it came from."""

    model_id: str
    source: str  # "bundled" | "path" | "hf-cache" | "hub"
    location: str
    config: dict[str, Any]
    quant_config: dict[str, Any] | None = None  # hf_quant_config.json, when present
    provenance: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=1)
def bundled_index() -> dict[str, str]:
    """HF id -> resource file name of every bundled config."""
    out: dict[str, str] = {}
    for entry in resources.files("hybridpd.data.configs").iterdir():
        name = entry.name
        if name.endswith(".json") and "__" in name:
            out[name[:-5].replace("__", "/", 1)] = name
    return out


def bundled_ids() -> list[str]:
    return sorted(bundled_index())


def completion_candidates() -> list[str]:
    """Every string `MODEL` completes to: bundled ids and aliases."""
    return sorted(set(bundled_ids()) | set(ALIASES))


def _lookup_bundled(name: str) -> str | None:
    idx = bundled_index()
    if name in ALIASES:
        return ALIASES[name]
    lower = {k.lower(): k for k in idx}
    if name.lower() in lower:
        return lower[name.lower()]
    if name.lower() in ALIASES:
        return ALIASES[name.lower()]
    return None


MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few kB; id2label-heavy ones stay far below this
MAX_JSON_DEPTH = 64  # real configs nest 3-4 levels


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_bounded(path: str | Path, *, field: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; FIFOs, devices and directories are refused unopened.

    The file is opened with O_NONBLOCK (a FIFO swapped in after the check cannot block) and checked again with
    fstat on the open descriptor, and never more than ``limit + 1`` bytes are read.
    """
    where = str(path)
    fix = "point it at a regular JSON file"
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot read {where}: {reason}", field=field, fix=fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where} is {_file_kind(st.st_mode)}, not a regular file", field=field, fix=fix)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}", field=field, fix=fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is {_file_kind(st.st_mode)}, not a regular file", field=field, fix=fix)
        if st.st_size > limit:
            raise ConfigError(f"{where} is {st.st_size:,} bytes, more than the {limit:,}-byte limit", field=field,
                              fix="point it at the model's config.json")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}", field=field, fix=fix) from None
    finally:
        os.close(fd)
    if got > limit:
        raise ConfigError(f"{where} is more than the {limit:,}-byte limit", field=field,
                          fix="point it at the model's config.json")
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:20]} is out of range")
    return v


def _depth_ok(data: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return True


def parse_json_bytes(raw: bytes, *, where: str, field: str,
                     fix: str = "repair the file or point MODEL at a valid config.json") -> Any:
    """Strict JSON from bytes: UTF-8, no NaN/Infinity, no overflowing floats, at most MAX_JSON_DEPTH levels."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (bad byte at offset {e.start})", field=field, fix=fix) from None
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON (line {e.lineno}: {e.msg})", field=field, fix=fix) from None
    except RecursionError:
        raise ConfigError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels", field=field, fix=fix) from None
    except ValueError as e:  # NaN/Infinity, 1e999, integers over Python's digit limit
        msg = str(e).split(";")[0]
        raise ConfigError(f"{where} is not valid JSON ({msg})", field=field, fix=fix) from None
    if not _depth_ok(data, MAX_JSON_DEPTH):
        raise ConfigError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels", field=field, fix=fix)
    return data


def _read_json(path: Path, what: str) -> dict[str, Any]:
    data = parse_json_bytes(read_bounded(path, field=what), where=str(path), field=what)
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object", field=what, fix="use a Hugging Face config.json")
    return data


def load_bundled(hf_id: str) -> RawModel:
    fname = bundled_index()[hf_id]
    data = json.loads(resources.files("hybridpd.data.configs").joinpath(fname).read_text())
    provenance = {"_source": data.pop("_source", None), "_confidence": data.pop("_confidence", None)}
    quant = None
    src = provenance.get("_source")
    if isinstance(src, dict):
        for key, val in src.items():
            if key.startswith("hf_quant_config.json") and isinstance(val, dict):
                quant = val
    return RawModel(model_id=hf_id, source="bundled", location=f"bundled:{fname}", config=data,
                    quant_config=quant, provenance=provenance)


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # name too long, embedded NUL, no permission on a parent
        return False


def load_path(path: Path) -> RawModel:
    cfg_path = path / "config.json" if path.is_dir() else path
    if not _exists(cfg_path):
        raise ModelNotFound(f"{path} has no config.json", field="MODEL",
                            fix="point MODEL at a model directory or its config.json")
    config = _read_json(cfg_path, "MODEL")
    quant = None
    qpath = cfg_path.parent / "hf_quant_config.json"
    if _exists(qpath):
        quant = _read_json(qpath, "hf_quant_config.json")
    return RawModel(model_id=str(path), source="path", location=str(cfg_path), config=config, quant_config=quant)


def load_hf(repo_id: str, *, allow_network: bool = False) -> RawModel | None:
    """Look a repo up in the local Hugging Face cache (or the Hub when allowed)."""
    try:
        import huggingface_hub as hfh
    except ImportError:  # pragma: no cover - dependency is declared
        return None
    cached = hfh.try_to_load_from_cache(repo_id, "config.json")
    path: str | None = cached if isinstance(cached, str) else None
    source = "hf-cache"
    if path is None and allow_network:
        try:
            path = hfh.hf_hub_download(repo_id, "config.json")
            source = "hub"
        except Exception as e:  # network/auth errors of every kind
            raise ModelNotFound(f"could not fetch {repo_id}: {e}", field="MODEL",
                                fix="check the id, your token, or the network") from None
    if path is None:
        return None
    config = _read_json(Path(path), "MODEL")
    quant = None
    qcached = hfh.try_to_load_from_cache(repo_id, "hf_quant_config.json")
    if isinstance(qcached, str):
        quant = _read_json(Path(qcached), "hf_quant_config.json")
    return RawModel(model_id=repo_id, source=source, location=path, config=config, quant_config=quant)


def resolve(model: str, *, allow_network: bool = False) -> RawModel:
    """MODEL -> RawModel. Order: existing path, bundled id/alias, HF cache, Hub (only if allowed)."""
    if not model or not model.strip():
        raise ModelNotFound("MODEL is empty", field="MODEL", fix="run `hybridpd models` for bundled ids")
    if "\x00" in model or len(model) > 4096:
        raise ModelNotFound("MODEL is not a usable name or path (NUL byte or over 4096 characters)", field="MODEL",
                            fix="run `hybridpd models` for bundled ids")
    p = Path(os.path.expanduser(model))
    if _exists(p):
        return load_path(p)
    hf_id = _lookup_bundled(model)
    if hf_id is not None:
        return load_bundled(hf_id)
    if model.count("/") == 1 and not model.startswith((".", "/")):
        found = load_hf(model, allow_network=allow_network)
        if found is not None:
            return found
    close = difflib.get_close_matches(model, completion_candidates(), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "run `hybridpd models` for bundled ids"
    extra = "" if allow_network else "; pass --allow-network to fetch from the Hugging Face Hub"
    raise ModelNotFound(f"model {model!r} is not bundled, not a path, and not in the local HF cache{extra}",
                        field="MODEL", fix=hint)
