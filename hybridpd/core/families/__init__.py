"""One adapter per architecture: raw config -> ModelSpec, holding exactly what vLLM reads.

``spec`` holds the values (ModelSpec and the state geometries), ``base`` what every adapter shares (typed config
reading, bounds, building the spec), ``mamba2`` the Mamba2 families and ``recurrent`` Jamba (Mamba-1) and
Qwen3-Next (GatedDeltaNet); dense models are read here.  Callers import from ``hybridpd.core.families``.
"""

from __future__ import annotations

from hybridpd.core.families import mamba2, recurrent
from hybridpd.core.families.base import LAYERS, Adapter, Cfg, attention_dims, build_spec, cache_layers, show
from hybridpd.core.families.spec import (
    ATTENTION,
    MAMBA,
    AttentionDims,
    CacheLayer,
    GdnDims,
    Mamba1Dims,
    MambaDims,
    ModelSpec,
)
from hybridpd.core.models import RawModel
from hybridpd.errors import ConfigError

__all__ = ["ATTENTION", "MAMBA", "AttentionDims", "CacheLayer", "GdnDims", "Mamba1Dims", "MambaDims", "ModelSpec",
           "model_spec"]


def _dense(raw: RawModel, cfg: Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    attn = attention_dims(cfg)
    layers, pat = cache_layers(["*"] * n)
    return build_spec(raw, cfg, "dense", layers, pat, None, attn, None)


_BY_MODEL_TYPE: dict[str, Adapter] = {**mamba2.ADAPTERS, **recurrent.ADAPTERS}
_DENSE_TYPES = {"llama", "qwen3", "qwen2", "mistral", "gemma", "phi3", "granite", "olmo2"}


def model_spec(raw: RawModel) -> ModelSpec:
    cfg = Cfg(raw.config, raw.model_id)
    mt = raw.config.get("model_type")
    if mt is None and "d_model" in raw.config and "ssm_cfg" in raw.config:
        mt = "mamba2"
    if mt is None:
        raise ConfigError("model_type is missing from config.json", field="model_type",
                          fix="add model_type (e.g. nemotron_h, granitemoehybrid, falcon_h1, llama)")
    if not isinstance(mt, str):
        raise ConfigError(f"model_type must be a string, got {show(mt)}", field="model_type",
                          fix="e.g. \"nemotron_h\", \"granitemoehybrid\", \"falcon_h1\", \"llama\"")
    if mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt](raw, cfg)
    if mt in _DENSE_TYPES:
        return _dense(raw, cfg)
    known = ", ".join(sorted(set(_BY_MODEL_TYPE) | _DENSE_TYPES))
    raise ConfigError(f"unsupported model_type {show(mt)}", field="model_type", fix=f"hybridpd knows {known}")
