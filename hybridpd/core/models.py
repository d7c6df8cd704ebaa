"""Resolve MODEL (bundled id/alias, local path, or Hugging Face cache) to a raw config dict."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from hybridpd.errors import ConfigError, ModelNotFound
from hybridpd.fsutil import parse_json_bytes, read_bounded

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


_CONFIGS = Path(__file__).parent.parent / "data" / "configs"  # read directly: importlib.resources costs `plan` ~6 ms


@lru_cache(maxsize=1)
def bundled_index() -> dict[str, str]:
    """HF id -> resource file name of every bundled config."""
    out: dict[str, str] = {}
    for entry in _CONFIGS.iterdir():
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


def _read_json(path: Path, what: str) -> dict[str, Any]:
    data = parse_json_bytes(read_bounded(path, field=what), where=str(path), field=what,
                            fix="repair the file or point MODEL at a valid config.json")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object", field=what, fix="use a Hugging Face config.json")
    return data


def load_bundled(hf_id: str) -> RawModel:
    fname = bundled_index()[hf_id]
    data = json.loads((_CONFIGS / fname).read_text(encoding="utf-8"))
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
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:  # the Hub's own rule (ASCII letters, digits, - _ . ; at most 96 chars), before any cache or network use
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ModelNotFound(f"model {repo_id[:100]!r} is not a path, not bundled, and not a valid Hugging Face id",
                            field="MODEL", fix="a Hub id is ORG/NAME of ASCII letters, digits, '-', '_' and '.' "
                                               "(or give a local path; `hybridpd models` lists bundled ids)") from None
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
