"""One adapter per architecture: raw config -> ModelSpec, holding exactly what vLLM reads.

Layer order matters: HMA groups are formed in first-appearance order of the KV-cache specs, so
``ModelSpec.cache_layers`` lists the layers that own a KV cache or a Mamba state in vLLM's
registration order (Falcon-H1 registers each layer's attention before its Mamba mixer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .models import RawModel

MAMBA = "mamba"
ATTENTION = "attention"


@dataclass(frozen=True, kw_only=True)
class MambaDims:
    """Mamba2 mixer geometry as vLLM's shape calculator receives it."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    intermediate_size: int  # x channels (global); NemotronH: heads * head_dim


@dataclass(frozen=True, kw_only=True)
class AttentionDims:
    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True, kw_only=True)
class CacheLayer:
    """One layer that owns cache memory, named as vLLM names it."""

    index: int  # decoder layer index
    kind: str  # MAMBA | ATTENTION
    name: str


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    model_id: str
    source: str
    family: str  # nemotron_h | granitemoehybrid | falcon_h1 | mamba2 | zamba2 | dense | jamba | qwen3_next
    architecture: str
    num_hidden_layers: int
    cache_layers: tuple[CacheLayer, ...]
    mamba: MambaDims | None
    attention: AttentionDims | None
    model_dtype: str
    hf_mamba_ssm_cache_dtype: str | None  # as written in config.json, if any
    kv_cache_quant: str | None  # "fp8" when quantization metadata says the KV cache is FP8
    max_position_embeddings: int | None
    mamba_type: str | None  # "mamba2" | "mamba1" | "gdn" | None
    layer_pattern: str  # one char per decoder layer: M * - E H(both)
    mamba_chunk_size: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def mamba_layers(self) -> tuple[CacheLayer, ...]:
        return tuple(c for c in self.cache_layers if c.kind == MAMBA)

    @property
    def attention_layers(self) -> tuple[CacheLayer, ...]:
        return tuple(c for c in self.cache_layers if c.kind == ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.mamba_layers) and bool(self.attention_layers)

    @property
    def has_mamba(self) -> bool:
        return bool(self.mamba_layers)


class _Cfg:
    """Typed access to a raw config; every failure names the field."""

    def __init__(self, raw: dict[str, Any], model_id: str) -> None:
        self.raw = raw
        self.model_id = model_id
        self.notes: list[str] = []

    def int(self, *keys: str, default: int | None = None, positive: bool = True) -> int:
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                val = self.raw[key]
                if isinstance(val, bool) or not isinstance(val, int):
                    raise ConfigError(f"must be an integer, got {val!r}", field=key,
                                      fix=f"set {key} to an integer in config.json")
                if positive and val <= 0:
                    raise ConfigError(f"must be > 0, got {val}", field=key, fix=f"set {key} to a positive integer")
                return val
        if default is None:
            raise ConfigError("missing from config.json", field=keys[0],
                              fix=f"add {keys[0]} to the model's config.json")
        self.notes.append(f"{keys[0]} not in config.json; used the transformers default {default}")
        return default

    def list(self, key: str) -> list[Any] | None:
        val = self.raw.get(key)
        if val is None:
            return None
        if not isinstance(val, list):
            raise ConfigError(f"must be a list, got {type(val).__name__}", field=key,
                              fix=f"set {key} to a JSON list")
        return val

    def str(self, key: str) -> str | None:
        val = self.raw.get(key)
        if val is None:
            return None
        if not isinstance(val, str):
            raise ConfigError(f"must be a string, got {val!r}", field=key, fix=f"set {key} to a string")
        return val


def _model_dtype(cfg: _Cfg) -> str:
    val = cfg.raw.get("torch_dtype", cfg.raw.get("dtype"))
    if val is None:
        cfg.notes.append("torch_dtype not in config.json; assuming bfloat16 (pass --dtype to override)")
        return "bfloat16"
    if not isinstance(val, str):
        raise ConfigError(f"must be a dtype string, got {val!r}", field="torch_dtype", fix="e.g. \"bfloat16\"")
    val = val.removeprefix("torch.")
    if val in ("float32", "float"):
        # vLLM's dtype="auto" serves fp32 checkpoints in bf16 on GPUs.
        return "bfloat16"
    if val not in ("bfloat16", "float16"):
        raise ConfigError(f"unsupported model dtype {val!r}", field="torch_dtype",
                          fix="use bfloat16 or float16, or pass --dtype")
    return val


def _kv_quant(raw: RawModel) -> str | None:
    """KV-cache dtype implied by quantization metadata, as vLLM resolves cache_dtype='auto'."""
    q = raw.config.get("quantization_config")
    if isinstance(q, dict):
        scheme = q.get("kv_cache_scheme")
        if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            return "fp8"
        algo = q.get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo.upper().startswith("FP8"):
            return "fp8"
    hq = raw.quant_config
    if isinstance(hq, dict):
        algo = (hq.get("quantization") or {}).get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo.upper().startswith("FP8"):
            return "fp8"
    return None


def _attention_dims(cfg: _Cfg, *, head_dim_keys: tuple[str, ...] = ("head_dim",)) -> AttentionDims:
    heads = cfg.int("num_attention_heads")
    kv = cfg.int("num_key_value_heads", default=heads)
    head_size = None
    for key in head_dim_keys:
        if cfg.raw.get(key) is not None:
            head_size = cfg.int(key)
            break
    if head_size is None:
        hidden = cfg.int("hidden_size")
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}",
                              field="head_dim", fix="add head_dim to config.json")
        head_size = hidden // heads
    if heads % kv:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                          field="num_key_value_heads", fix="fix the head counts")
    return AttentionDims(num_heads=heads, num_kv_heads=kv, head_size=head_size)


def _check_mamba(d: MambaDims) -> MambaDims:
    if d.intermediate_size != d.num_heads * d.head_dim:
        raise ConfigError(
            f"Mamba2 intermediate size {d.intermediate_size} != heads*head_dim {d.num_heads * d.head_dim}",
            field="mamba_num_heads", fix="check mamba heads, head_dim and expand")
    if d.num_heads % d.n_groups:
        raise ConfigError(f"Mamba heads {d.num_heads} not divisible by n_groups {d.n_groups}",
                          field="n_groups", fix="check n_groups")
    return d


def _layers(kinds: list[str]) -> tuple[tuple[CacheLayer, ...], str]:
    """kinds: per decoder layer one of 'M','*','-','E','H' (H = attention + mamba, attention first)."""
    out: list[CacheLayer] = []
    for i, k in enumerate(kinds):
        if k in ("*", "H"):
            out.append(CacheLayer(index=i, kind=ATTENTION, name=f"model.layers.{i}.self_attn.attn"))
        if k in ("M", "H"):
            out.append(CacheLayer(index=i, kind=MAMBA, name=f"model.layers.{i}.mixer"))
    return tuple(out), "".join(kinds)


_NEMOTRON_BLOCK_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E", "linear_attention": "M",
                         "full_attention": "*"}


def _nemotron_h(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    pattern = cfg.str("hybrid_override_pattern")
    if pattern is None:
        types = cfg.list("layers_block_type")
        if types is None:
            raise ConfigError("missing", field="hybrid_override_pattern",
                              fix="add hybrid_override_pattern (e.g. \"M*M-\") or layers_block_type")
        try:
            pattern = "".join(_NEMOTRON_BLOCK_TYPES[str(t)] for t in types)
        except KeyError as e:
            raise ConfigError(f"unknown layer type {e.args[0]!r}", field="layers_block_type",
                              fix="use mamba, attention, mlp or moe") from None
    bad = set(pattern) - set("M*-E")
    if bad:
        raise ConfigError(f"unknown layer symbol(s) {''.join(sorted(bad))!r}", field="hybrid_override_pattern",
                          fix="use M (Mamba2), * (attention), - (MLP), E (MoE)")
    # transformers >= 5 writes layers_block_type and derives num_hidden_layers from it (no key in config.json)
    n = cfg.int("num_hidden_layers") if "num_hidden_layers" in cfg.raw else len(pattern)
    if len(pattern) != n:
        raise ConfigError(f"has {len(pattern)} layers but num_hidden_layers is {n}",
                          field="hybrid_override_pattern", fix="make the pattern one symbol per layer")
    heads = cfg.int("mamba_num_heads")
    hd = cfg.int("mamba_head_dim")
    mamba = _check_mamba(MambaDims(num_heads=heads, head_dim=hd, n_groups=cfg.int("n_groups"),
                                   state_size=cfg.int("ssm_state_size"), conv_kernel=cfg.int("conv_kernel", default=4),
                                   intermediate_size=heads * hd))
    layers, pat = _layers(list(pattern))
    attn = _attention_dims(cfg) if "*" in pattern else None
    return _spec(raw, cfg, "nemotron_h", layers, pat, mamba, attn, "mamba2",
                 hf_ssm=cfg.str("mamba_ssm_cache_dtype"))


def _granite(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers")
    types = cfg.list("layer_types")
    if types is None:
        raise ConfigError("missing", field="layer_types", fix="add layer_types (mamba/attention per layer)")
    if len(types) != n:
        raise ConfigError(f"has {len(types)} entries but num_hidden_layers is {n}", field="layer_types",
                          fix="one entry per layer")
    # transformers >= 5 writes linear_attention / full_attention for mamba / attention
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*"}
    kinds = []
    for t in types:
        if t not in names:
            raise ConfigError(f"unknown layer type {t!r}", field="layer_types", fix="use mamba or attention")
        kinds.append(names[t])
    hidden = cfg.int("hidden_size")
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("mamba_n_heads"), head_dim=cfg.int("mamba_d_head"),
        n_groups=cfg.int("mamba_n_groups", default=1), state_size=cfg.int("mamba_d_state"),
        conv_kernel=cfg.int("mamba_d_conv", default=4),
        intermediate_size=cfg.int("mamba_expand", default=2) * hidden))
    layers, pat = _layers(kinds)
    attn = _attention_dims(cfg, head_dim_keys=()) if "*" in kinds else None
    return _spec(raw, cfg, "granitemoehybrid", layers, pat, mamba, attn, "mamba2")


def _falcon_h1(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers")
    hidden = cfg.int("hidden_size")
    d_ssm = cfg.raw.get("mamba_d_ssm")
    if d_ssm is None:
        inter = cfg.int("mamba_expand", default=2) * hidden
        cfg.notes.append("mamba_d_ssm not in config.json; vLLM then uses mamba_expand * hidden_size")
    else:
        inter = cfg.int("mamba_d_ssm")
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("mamba_n_heads"), head_dim=cfg.int("mamba_d_head"),
        n_groups=cfg.int("mamba_n_groups", default=1), state_size=cfg.int("mamba_d_state"),
        conv_kernel=cfg.int("mamba_d_conv", default=4), intermediate_size=inter))
    layers, pat = _layers(["H"] * n)
    attn = _attention_dims(cfg)
    return _spec(raw, cfg, "falcon_h1", layers, pat, mamba, attn, "mamba2")


def _mamba2(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    if "d_model" in cfg.raw:  # state-spaces mamba_ssm format
        hidden = cfg.int("d_model")
        n = cfg.int("n_layer")
        ssm_cfg = cfg.raw.get("ssm_cfg") or {}
        if ssm_cfg.get("layer", "Mamba2") != "Mamba2":
            return _rejected(raw, cfg, "mamba1", "Mamba-1 layers (ssm_cfg.layer)")
        sub = _Cfg(ssm_cfg, cfg.model_id)
        expand = sub.int("expand", default=2)
        hd = sub.int("headdim", default=64)
        inter = expand * hidden
        mamba = MambaDims(num_heads=inter // hd, head_dim=hd, n_groups=sub.int("ngroups", default=1),
                          state_size=sub.int("d_state", default=128), conv_kernel=sub.int("d_conv", default=4),
                          intermediate_size=inter)
        cfg.notes.extend(sub.notes)
        attn_idx = cfg.list("attn_layer_idx") or []
    else:
        n = cfg.int("num_hidden_layers")
        hidden = cfg.int("hidden_size")
        hd = cfg.int("head_dim", default=64)
        inter = cfg.int("expand", default=2) * hidden
        mamba = MambaDims(num_heads=cfg.int("num_heads", default=inter // hd), head_dim=hd,
                          n_groups=cfg.int("n_groups", default=1), state_size=cfg.int("state_size", default=128),
                          conv_kernel=cfg.int("conv_kernel", default=4), intermediate_size=inter)
        attn_idx = []
    if attn_idx:
        return _rejected(raw, cfg, "mamba2", "attention layers inside a mamba_ssm checkpoint (not a vLLM format)")
    _check_mamba(mamba)
    layers, pat = _layers(["M"] * n)
    return _spec(raw, cfg, "mamba2", layers, pat, mamba, None, "mamba2")


def _zamba2(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    types = cfg.list("layers_block_type")
    n = cfg.int("num_hidden_layers")
    if types is None or len(types) != n:
        raise ConfigError("missing or wrong length", field="layers_block_type", fix="one entry per layer")
    hidden = cfg.int("hidden_size")
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("n_mamba_heads"), head_dim=cfg.int("mamba_headdim"),
        n_groups=cfg.int("mamba_ngroups", default=1), state_size=cfg.int("mamba_d_state"),
        conv_kernel=cfg.int("mamba_d_conv", default=4), intermediate_size=cfg.int("mamba_expand", default=2) * hidden))
    kinds = ["H" if t == "hybrid" else "M" for t in types]
    layers, pat = _layers(kinds)
    attn = _attention_dims(cfg, head_dim_keys=("attention_head_dim",))
    cfg.notes.append("Zamba2: shared attention blocks are modelled as one KV cache per hybrid layer")
    return _spec(raw, cfg, "zamba2", layers, pat, mamba, attn, "mamba2")


def _dense(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers")
    attn = _attention_dims(cfg)
    layers, pat = _layers(["*"] * n)
    return _spec(raw, cfg, "dense", layers, pat, None, attn, None)


def _jamba(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers")
    off = cfg.int("attn_layer_offset", default=4, positive=False)
    period = cfg.int("attn_layer_period", default=8)
    kinds = ["*" if i % period == off else "M" for i in range(n)]
    layers, pat = _layers(kinds)
    spec = _spec(raw, cfg, "jamba", layers, pat, None, _attention_dims(cfg), "mamba1")
    return spec


def _qwen3_next(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers")
    types = cfg.list("layer_types")
    if types is None:
        interval = cfg.int("full_attention_interval", default=4)
        kinds = ["*" if (i + 1) % interval == 0 else "M" for i in range(n)]
    else:
        kinds = ["*" if t == "full_attention" else "M" for t in types]
    layers, pat = _layers(kinds)
    return _spec(raw, cfg, "qwen3_next", layers, pat, None, _attention_dims(cfg), "gdn")


def _rejected(raw: RawModel, cfg: _Cfg, mamba_type: str, what: str) -> ModelSpec:
    cfg.notes.append(f"contains {what}")
    return _spec(raw, cfg, "mamba2", (), "", None, None, mamba_type)


def _spec(raw: RawModel, cfg: _Cfg, family: str, layers: tuple[CacheLayer, ...], pattern: str,
          mamba: MambaDims | None, attn: AttentionDims | None, mamba_type: str | None,
          hf_ssm: str | None = None) -> ModelSpec:
    archs = raw.config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else str(raw.config.get("model_type", family))
    dtype = _model_dtype(cfg)
    mpe = raw.config.get("max_position_embeddings")
    chunk = next((raw.config[k] for k in ("chunk_size", "mamba_chunk_size") if isinstance(raw.config.get(k), int)), None)
    notes = list(cfg.notes)
    conf = raw.provenance.get("_confidence") if raw.provenance else None
    if isinstance(conf, dict) and conf.get("not_found"):
        notes.append("bundled config is incomplete; not found upstream: " + "; ".join(map(str, conf["not_found"])))
    return ModelSpec(
        model_id=raw.model_id, source=raw.source, family=family, architecture=arch,
        num_hidden_layers=len(pattern), cache_layers=layers, mamba=mamba, attention=attn, model_dtype=dtype,
        hf_mamba_ssm_cache_dtype=hf_ssm, kv_cache_quant=_kv_quant(raw),
        max_position_embeddings=mpe if isinstance(mpe, int) and mpe > 0 else None,
        mamba_type=mamba_type, layer_pattern=pattern, mamba_chunk_size=chunk if mamba else None,
        notes=tuple(notes))


_BY_MODEL_TYPE: dict[str, Callable[[RawModel, _Cfg], ModelSpec]] = {
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite,
    "falcon_h1": _falcon_h1,
    "mamba2": _mamba2,
    "zamba2": _zamba2,
    "jamba": _jamba,
    "qwen3_next": _qwen3_next,
}
_DENSE_TYPES = {"llama", "qwen3", "qwen2", "mistral", "gemma", "phi3", "granite", "olmo2"}


def model_spec(raw: RawModel) -> ModelSpec:
    cfg = _Cfg(raw.config, raw.model_id)
    mt = raw.config.get("model_type")
    if mt is None and "d_model" in raw.config and "ssm_cfg" in raw.config:
        mt = "mamba2"
    if not isinstance(mt, str):
        raise ConfigError("missing from config.json", field="model_type",
                          fix="add model_type (e.g. nemotron_h, granitemoehybrid, falcon_h1, llama)")
    if mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt](raw, cfg)
    if mt in _DENSE_TYPES:
        return _dense(raw, cfg)
    known = ", ".join(sorted(set(_BY_MODEL_TYPE) | _DENSE_TYPES))
    raise ConfigError(f"unsupported model_type {mt!r}", field="model_type", fix=f"hybridpd knows {known}")
