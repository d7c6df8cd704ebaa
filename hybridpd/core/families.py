"""One adapter per architecture: raw config -> ModelSpec, holding exactly what vLLM reads.

Layer order matters: HMA groups are formed in first-appearance order of the KV-cache specs, so
``ModelSpec.cache_layers`` lists the layers that own a KV cache or a Mamba state in vLLM's
registration order (Falcon-H1 registers each layer's attention before its Mamba mixer).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridpd.core.models import RawModel
from hybridpd.errors import ConfigError

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
class Mamba1Dims:
    """Mamba-1 mixer geometry (Jamba) as ``MambaStateShapeCalculator.mamba1_state_shape`` receives it."""

    intermediate_size: int  # mamba_expand * hidden_size
    state_size: int  # mamba_d_state
    conv_kernel: int  # mamba_d_conv


@dataclass(frozen=True, kw_only=True)
class GdnDims:
    """GatedDeltaNet geometry (Qwen3-Next) as ``gated_delta_net_state_shape`` receives it."""

    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim


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
    # state geometry of the non-Mamba2 recurrent families (``mamba`` holds Mamba2 only)
    recurrent: Mamba1Dims | GdnDims | None = None
    # the model class implements SupportsMambaPrefixCaching (mamba_cache_mode "all" allowed, else "align")
    mamba_prefix_caching: bool = True
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

    @property
    def state_modelled(self) -> bool:
        """hybridpd knows this model's recurrent-state geometry (Mamba2, Mamba-1 or GatedDeltaNet)."""
        return self.mamba is not None or self.recurrent is not None


# Accepted ranges: generous against every published checkpoint, small enough that `plan` stays fast and
# bounded in memory (its work grows with layers x TP). (low, high); a value outside names its key and range.
LAYERS = (1, 4096)
WIDTH = (1, 1 << 20)  # hidden_size, Mamba x channels
HEADS = (1, 1 << 16)
HEAD_DIM = (1, 1 << 14)
GROUPS = (1, 1 << 16)
STATE = (1, 1 << 14)
CONV_KERNEL = (2, 1 << 10)  # vLLM's conv state keeps conv_kernel - 1 columns: 1 would leave it empty
EXPAND = (1, 64)
POSITIONS = (1, 1 << 30)
CHUNK = (1, 1 << 20)
_WHY = {CONV_KERNEL: " (vLLM keeps {key} - 1 columns of conv state, so 1 leaves the state empty)"}


def _show(val: Any) -> str:
    """A value for an error message, never longer than a line."""
    if isinstance(val, int) and not isinstance(val, bool) and abs(val) >= 10**15:
        return f"an integer of {len(str(abs(val))) if abs(val) < 10**4000 else 'over 4000'} digits"
    text = repr(val) if not isinstance(val, (dict, list)) else type(val).__name__
    return text if len(text) <= 40 else text[:37] + "..."


class _Cfg:
    """Typed access to a raw config; every failure names the key as the config spells it."""

    def __init__(self, raw: dict[str, Any], model_id: str, prefix: str = "") -> None:
        self.raw = raw
        self.model_id = model_id
        self.prefix = prefix  # "ssm_cfg." for a nested object
        self.notes: list[str] = []

    def name(self, key: str) -> str:
        return self.prefix + key

    def int(self, *keys: str, default: int | None = None, bounds: tuple[int, int] = WIDTH) -> int:
        lo, hi = bounds
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                val = self.raw[key]
                k = self.name(key)
                if isinstance(val, bool) or not isinstance(val, int):
                    raise ConfigError(f"{k} must be an integer, got {_show(val)}", field=k,
                                      fix=f"set {k} to an integer in {lo}..{hi}")
                if not lo <= val <= hi:
                    raise ConfigError(f"{k} must be in {lo}..{hi}, got {_show(val)}{_WHY.get(bounds, '').format(key=k)}", field=k,
                                      fix=f"set {k} to an integer in {lo}..{hi}")
                return val
        if default is None:
            k = self.name(keys[0])
            raise ConfigError(f"{k} is missing from config.json", field=k, fix=f"add {k} to the model's config.json")
        self.notes.append(f"{self.name(keys[0])} not in config.json; used the transformers default {default}")
        return default

    def list(self, key: str, *, max_len: builtins.int = LAYERS[1]) -> builtins.list[Any] | None:
        val = self.raw.get(key)
        if val is None:
            return None
        k = self.name(key)
        if not isinstance(val, list):
            raise ConfigError(f"{k} must be a list, got {type(val).__name__}", field=k, fix=f"set {k} to a JSON list")
        if len(val) > max_len:
            raise ConfigError(f"{k} has {len(val)} entries, more than {max_len}", field=k,
                              fix=f"give {k} at most {max_len} entries")
        return val

    def str_list(self, key: str, allowed: dict[str, str]) -> builtins.list[str] | None:
        """A list of layer-type names, each mapped through ``allowed``."""
        vals = self.list(key)
        if vals is None:
            return None
        k = self.name(key)
        out = []
        for i, v in enumerate(vals):
            if not isinstance(v, str) or v not in allowed:
                raise ConfigError(f"{k}[{i}] is {_show(v)}, not a known layer type", field=k,
                                  fix=f"use one of {', '.join(sorted(allowed))}")
            out.append(allowed[v])
        return out

    def str(self, key: str, *, max_len: builtins.int = 256) -> str | None:
        val = self.raw.get(key)
        if val is None:
            return None
        k = self.name(key)
        if not isinstance(val, str):
            raise ConfigError(f"{k} must be a string, got {_show(val)}", field=k, fix=f"set {k} to a string")
        if len(val) > max_len:
            raise ConfigError(f"{k} is {len(val)} characters long, more than {max_len}", field=k,
                              fix=f"shorten {k}")
        return val


def _model_dtype(cfg: _Cfg) -> str:
    key = "torch_dtype" if "torch_dtype" in cfg.raw else "dtype"
    val = cfg.raw.get(key)
    if val is None:
        cfg.notes.append("torch_dtype not in config.json; assuming bfloat16 (pass --dtype to override)")
        return "bfloat16"
    if not isinstance(val, str):
        raise ConfigError(f"{key} must be a dtype string, got {_show(val)}", field=key, fix="e.g. \"bfloat16\"")
    val = val.removeprefix("torch.")
    if val in ("float32", "float"):
        # vLLM's dtype="auto" serves fp32 checkpoints in bf16 on GPUs.
        return "bfloat16"
    if val not in ("bfloat16", "float16"):
        raise ConfigError(f"unsupported model dtype {_show(val)}", field=key,
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
        hqq = hq.get("quantization")
        algo = hqq.get("kv_cache_quant_algo") if isinstance(hqq, dict) else None
        if isinstance(algo, str) and algo.upper().startswith("FP8"):
            return "fp8"
    return None


def _attention_dims(cfg: _Cfg, *, head_dim_keys: tuple[str, ...] = ("head_dim",)) -> AttentionDims:
    heads = cfg.int("num_attention_heads", bounds=HEADS)
    kv = cfg.int("num_key_value_heads", default=heads, bounds=HEADS)
    head_size = None
    for key in head_dim_keys:
        if cfg.raw.get(key) is not None:
            head_size = cfg.int(key, bounds=HEAD_DIM)
            break
    if head_size is None:
        hidden = cfg.int("hidden_size")
        where = head_dim_keys[0] if head_dim_keys else "num_attention_heads"
        fix = f"add {where} to config.json" if head_dim_keys else "make hidden_size a multiple of num_attention_heads"
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}", field=where,
                              fix=fix)
        head_size = hidden // heads
        if head_size > HEAD_DIM[1]:
            raise ConfigError(f"hidden_size / num_attention_heads = {head_size} is more than {HEAD_DIM[1]}",
                              field=where, fix=fix)
    if heads % kv:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                          field="num_key_value_heads", fix="fix the head counts")
    return AttentionDims(num_heads=heads, num_kv_heads=kv, head_size=head_size)


@dataclass(frozen=True, kw_only=True)
class _MambaKeys:
    """How one family spells the Mamba2 fields, for error messages."""

    heads: str
    head_dim: str
    groups: str
    inter: str  # the key that sets the x channels (or the first key of the product that does)
    inter_expr: str  # how the x channels are computed, e.g. "mamba_expand * hidden_size"


def _check_mamba(d: MambaDims, k: _MambaKeys) -> MambaDims:
    prod = d.num_heads * d.head_dim
    if d.intermediate_size > WIDTH[1]:
        raise ConfigError(f"{k.inter_expr} = {d.intermediate_size} is more than {WIDTH[1]} channels", field=k.inter,
                          fix=f"set {k.inter} so that {k.inter_expr} <= {WIDTH[1]}")
    if d.intermediate_size != prod:
        raise ConfigError(
            f"{k.inter_expr} = {d.intermediate_size} but {k.heads} * {k.head_dim} = {prod}; vLLM's Mamba2 mixer "
            "needs them equal", field=k.inter, fix=f"make {k.heads} * {k.head_dim} equal {k.inter_expr}")
    if d.num_heads % d.n_groups:
        raise ConfigError(f"{k.heads} {d.num_heads} is not divisible by {k.groups} {d.n_groups}", field=k.groups,
                          fix=f"set {k.groups} to a divisor of {k.heads}")
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


def _check_count(cfg: _Cfg, key: str, kinds: list[str], n: int) -> None:
    if len(kinds) != n:
        raise ConfigError(f"{key} has {len(kinds)} entries but num_hidden_layers is {n}", field=key,
                          fix=f"give {key} one entry per layer")


_NEMOTRON_BLOCK_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E", "linear_attention": "M",
                         "full_attention": "*"}


def _nemotron_h(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    pattern = cfg.str("hybrid_override_pattern", max_len=LAYERS[1])
    if pattern is None:
        types = cfg.str_list("layers_block_type", _NEMOTRON_BLOCK_TYPES)
        if types is None:
            raise ConfigError("hybrid_override_pattern is missing (and so is layers_block_type)",
                              field="hybrid_override_pattern",
                              fix="add hybrid_override_pattern (e.g. \"M*M-\") or layers_block_type")
        pattern = "".join(types)
    bad = set(pattern) - set("M*-E")
    if bad:
        raise ConfigError(f"unknown layer symbol(s) {''.join(sorted(bad))[:20]!r}", field="hybrid_override_pattern",
                          fix="use M (Mamba2), * (attention), - (MLP), E (MoE)")
    if not pattern:
        raise ConfigError("hybrid_override_pattern is empty", field="hybrid_override_pattern",
                          fix="one symbol per layer, e.g. \"M*M-\"")
    # transformers >= 5 writes layers_block_type and derives num_hidden_layers from it (no key in config.json)
    n = cfg.int("num_hidden_layers", bounds=LAYERS) if cfg.raw.get("num_hidden_layers") is not None else len(pattern)
    if len(pattern) != n:
        raise ConfigError(f"hybrid_override_pattern has {len(pattern)} layers but num_hidden_layers is {n}",
                          field="hybrid_override_pattern", fix="make the pattern one symbol per layer")
    heads = cfg.int("mamba_num_heads", bounds=HEADS)
    hd = cfg.int("mamba_head_dim", bounds=HEAD_DIM)
    keys = _MambaKeys(heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups", inter="mamba_num_heads",
                      inter_expr="mamba_num_heads * mamba_head_dim")
    mamba = _check_mamba(MambaDims(num_heads=heads, head_dim=hd, n_groups=cfg.int("n_groups", bounds=GROUPS),
                                   state_size=cfg.int("ssm_state_size", bounds=STATE),
                                   conv_kernel=cfg.int("conv_kernel", default=4, bounds=CONV_KERNEL),
                                   intermediate_size=heads * hd), keys)
    layers, pat = _layers(list(pattern))
    attn = _attention_dims(cfg) if "*" in pattern else None
    return _spec(raw, cfg, "nemotron_h", layers, pat, mamba, attn, "mamba2",
                 hf_ssm=cfg.str("mamba_ssm_cache_dtype"))


def _granite(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    # transformers >= 5 writes linear_attention / full_attention for mamba / attention
    kinds = cfg.str_list("layer_types", {"mamba": "M", "linear_attention": "M", "attention": "*",
                                         "full_attention": "*"})
    if kinds is None:
        raise ConfigError("layer_types is missing", field="layer_types",
                          fix="add layer_types (mamba/attention per layer)")
    _check_count(cfg, "layer_types", kinds, n)
    hidden = cfg.int("hidden_size")
    keys = _MambaKeys(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", inter="mamba_expand",
                      inter_expr="mamba_expand * hidden_size")
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("mamba_n_heads", bounds=HEADS), head_dim=cfg.int("mamba_d_head", bounds=HEAD_DIM),
        n_groups=cfg.int("mamba_n_groups", default=1, bounds=GROUPS), state_size=cfg.int("mamba_d_state", bounds=STATE),
        conv_kernel=cfg.int("mamba_d_conv", default=4, bounds=CONV_KERNEL),
        intermediate_size=cfg.int("mamba_expand", default=2, bounds=EXPAND) * hidden), keys)
    layers, pat = _layers(kinds)
    attn = _attention_dims(cfg, head_dim_keys=()) if "*" in kinds else None
    return _spec(raw, cfg, "granitemoehybrid", layers, pat, mamba, attn, "mamba2")


def _falcon_h1(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    hidden = cfg.int("hidden_size")
    if cfg.raw.get("mamba_d_ssm") is None:
        inter = cfg.int("mamba_expand", default=2, bounds=EXPAND) * hidden
        expr = "mamba_expand * hidden_size (mamba_d_ssm is absent)"
        cfg.notes.append("mamba_d_ssm not in config.json; vLLM then uses mamba_expand * hidden_size")
    else:
        inter = cfg.int("mamba_d_ssm")
        expr = "mamba_d_ssm"
    keys = _MambaKeys(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", inter="mamba_d_ssm",
                      inter_expr=expr)
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("mamba_n_heads", bounds=HEADS), head_dim=cfg.int("mamba_d_head", bounds=HEAD_DIM),
        n_groups=cfg.int("mamba_n_groups", default=1, bounds=GROUPS), state_size=cfg.int("mamba_d_state", bounds=STATE),
        conv_kernel=cfg.int("mamba_d_conv", default=4, bounds=CONV_KERNEL), intermediate_size=inter), keys)
    layers, pat = _layers(["H"] * n)
    attn = _attention_dims(cfg)
    return _spec(raw, cfg, "falcon_h1", layers, pat, mamba, attn, "mamba2")


def _mamba2(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    if "d_model" in cfg.raw:  # state-spaces mamba_ssm format
        hidden = cfg.int("d_model")
        n = cfg.int("n_layer", bounds=LAYERS)
        ssm_cfg = cfg.raw.get("ssm_cfg")
        if ssm_cfg is None:
            ssm_cfg = {}
        if not isinstance(ssm_cfg, dict):
            raise ConfigError(f"ssm_cfg must be an object, got {type(ssm_cfg).__name__}", field="ssm_cfg",
                              fix="set ssm_cfg to a JSON object (e.g. {\"layer\": \"Mamba2\"})")
        sub = _Cfg(ssm_cfg, cfg.model_id, prefix="ssm_cfg.")
        layer = sub.str("layer") or "Mamba2"
        if layer != "Mamba2":
            return _rejected(raw, cfg, "mamba1", "Mamba-1 layers (ssm_cfg.layer)")
        expand = sub.int("expand", default=2, bounds=EXPAND)
        hd = sub.int("headdim", default=64, bounds=HEAD_DIM)
        inter = expand * hidden
        keys = _MambaKeys(heads="ssm_cfg.headdim", head_dim="ssm_cfg.headdim", groups="ssm_cfg.ngroups",
                          inter="ssm_cfg.headdim", inter_expr="ssm_cfg.expand * d_model")
        if inter % hd:
            raise ConfigError(f"ssm_cfg.expand * d_model = {inter} is not a multiple of ssm_cfg.headdim {hd}",
                              field="ssm_cfg.headdim", fix="set ssm_cfg.headdim to a divisor of expand * d_model")
        mamba = MambaDims(num_heads=inter // hd, head_dim=hd, n_groups=sub.int("ngroups", default=1, bounds=GROUPS),
                          state_size=sub.int("d_state", default=128, bounds=STATE),
                          conv_kernel=sub.int("d_conv", default=4, bounds=CONV_KERNEL), intermediate_size=inter)
        cfg.notes.extend(sub.notes)
        attn_idx = cfg.list("attn_layer_idx") or []
    else:
        n = cfg.int("num_hidden_layers", bounds=LAYERS)
        hidden = cfg.int("hidden_size")
        hd = cfg.int("head_dim", default=64, bounds=HEAD_DIM)
        inter = cfg.int("expand", default=2, bounds=EXPAND) * hidden
        keys = _MambaKeys(heads="num_heads", head_dim="head_dim", groups="n_groups", inter="expand",
                          inter_expr="expand * hidden_size")
        mamba = MambaDims(num_heads=cfg.int("num_heads", default=max(inter // hd, 1), bounds=HEADS), head_dim=hd,
                          n_groups=cfg.int("n_groups", default=1, bounds=GROUPS),
                          state_size=cfg.int("state_size", default=128, bounds=STATE),
                          conv_kernel=cfg.int("conv_kernel", default=4, bounds=CONV_KERNEL), intermediate_size=inter)
        attn_idx = []
    if attn_idx:
        return _rejected(raw, cfg, "mamba2", "attention layers inside a mamba_ssm checkpoint (not a vLLM format)")
    _check_mamba(mamba, keys)
    layers, pat = _layers(["M"] * n)
    return _spec(raw, cfg, "mamba2", layers, pat, mamba, None, "mamba2")


def _zamba2(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    kinds = cfg.str_list("layers_block_type", {"mamba": "M", "hybrid": "H"})
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    if kinds is None:
        raise ConfigError("layers_block_type is missing", field="layers_block_type",
                          fix="one entry (mamba or hybrid) per layer")
    _check_count(cfg, "layers_block_type", kinds, n)
    hidden = cfg.int("hidden_size")
    keys = _MambaKeys(heads="n_mamba_heads", head_dim="mamba_headdim", groups="mamba_ngroups", inter="mamba_expand",
                      inter_expr="mamba_expand * hidden_size")
    mamba = _check_mamba(MambaDims(
        num_heads=cfg.int("n_mamba_heads", bounds=HEADS), head_dim=cfg.int("mamba_headdim", bounds=HEAD_DIM),
        n_groups=cfg.int("mamba_ngroups", default=1, bounds=GROUPS), state_size=cfg.int("mamba_d_state", bounds=STATE),
        conv_kernel=cfg.int("mamba_d_conv", default=4, bounds=CONV_KERNEL),
        intermediate_size=cfg.int("mamba_expand", default=2, bounds=EXPAND) * hidden), keys)
    layers, pat = _layers(kinds)
    attn = _attention_dims(cfg, head_dim_keys=("attention_head_dim",))
    cfg.notes.append("Zamba2: shared attention blocks are modelled as one KV cache per hybrid layer")
    return _spec(raw, cfg, "zamba2", layers, pat, mamba, attn, "mamba2")


def _dense(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    attn = _attention_dims(cfg)
    layers, pat = _layers(["*"] * n)
    return _spec(raw, cfg, "dense", layers, pat, None, attn, None)


def _jamba(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    period = cfg.int("attn_layer_period", default=8, bounds=LAYERS)
    off = cfg.int("attn_layer_offset", default=4, bounds=(0, LAYERS[1]))
    if off >= period:
        raise ConfigError(f"attn_layer_offset {off} must be less than attn_layer_period {period}",
                          field="attn_layer_offset", fix="set attn_layer_offset in 0..attn_layer_period-1")
    kinds = ["*" if i % period == off else "M" for i in range(n)]
    layers, pat = _layers(kinds)
    # JambaForCausalLM.get_mamba_state_shape_from_config: mamba1_state_shape(mamba_expand * hidden_size,
    # mamba_d_state, mamba_d_conv); defaults are transformers' JambaConfig ones
    hidden = cfg.int("hidden_size")
    expand = cfg.int("mamba_expand", default=2, bounds=EXPAND)
    if expand * hidden > WIDTH[1]:
        raise ConfigError(f"mamba_expand * hidden_size = {expand * hidden} is more than {WIDTH[1]} channels",
                          field="mamba_expand", fix=f"set mamba_expand so that mamba_expand * hidden_size <= {WIDTH[1]}")
    rec = Mamba1Dims(intermediate_size=expand * hidden, state_size=cfg.int("mamba_d_state", default=16, bounds=STATE),
                     conv_kernel=cfg.int("mamba_d_conv", default=4, bounds=CONV_KERNEL))
    # JambaConfig has no head_dim: vLLM divides hidden_size by num_attention_heads
    spec = _spec(raw, cfg, "jamba", layers, pat, None, _attention_dims(cfg, head_dim_keys=()), "mamba1", recurrent=rec)
    return spec


def _qwen3_next(raw: RawModel, cfg: _Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    kinds = cfg.str_list("layer_types", {"full_attention": "*", "linear_attention": "M"})
    if kinds is None:
        interval = cfg.int("full_attention_interval", default=4, bounds=LAYERS)
        kinds = ["*" if (i + 1) % interval == 0 else "M" for i in range(n)]
    _check_count(cfg, "layer_types", kinds, n)
    layers, pat = _layers(kinds)
    # Qwen3NextForCausalLM.get_mamba_state_shape_from_config: gated_delta_net_state_shape(linear_* keys)
    nk = cfg.int("linear_num_key_heads", bounds=HEADS)
    nv = cfg.int("linear_num_value_heads", bounds=HEADS)
    if nv % nk:
        raise ConfigError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}",
                          field="linear_num_value_heads", fix="make linear_num_value_heads a multiple of the key heads")
    rec = GdnDims(num_k_heads=nk, num_v_heads=nv, head_k_dim=cfg.int("linear_key_head_dim", bounds=HEAD_DIM),
                  head_v_dim=cfg.int("linear_value_head_dim", bounds=HEAD_DIM),
                  conv_kernel=cfg.int("linear_conv_kernel_dim", default=4, bounds=CONV_KERNEL))
    if 2 * rec.num_k_heads * rec.head_k_dim + rec.num_v_heads * rec.head_v_dim > WIDTH[1]:
        raise ConfigError(f"the GatedDeltaNet conv dim is more than {WIDTH[1]} channels", field="linear_num_key_heads",
                          fix="check the linear_* head counts and dims")
    # no SupportsMambaPrefixCaching: mamba_cache_mode "all" falls back to "align" (model_executor/models/config.py)
    return _spec(raw, cfg, "qwen3_next", layers, pat, None, _attention_dims(cfg), "gdn", recurrent=rec,
                 mamba_prefix_caching=False)


def _rejected(raw: RawModel, cfg: _Cfg, mamba_type: str, what: str) -> ModelSpec:
    cfg.notes.append(f"contains {what}")
    return _spec(raw, cfg, "mamba2", (), "", None, None, mamba_type)


def _architecture(cfg: _Cfg, family: str) -> str:
    archs = cfg.list("architectures", max_len=16)
    if archs:
        if not isinstance(archs[0], str) or not archs[0] or len(archs[0]) > 256:
            raise ConfigError(f"architectures[0] must be a class name, got {_show(archs[0])}", field="architectures",
                              fix="e.g. [\"NemotronHForCausalLM\"]")
        return archs[0]
    mt = cfg.raw.get("model_type")
    return mt if isinstance(mt, str) else family


# transformers 5 config-class defaults (NemotronHConfig.chunk_size, GraniteMoeHybridConfig.mamba_chunk_size, ...)
_CHUNK_DEFAULT = {"nemotron_h": 128, "granitemoehybrid": 256, "falcon_h1": 256, "zamba2": 256, "mamba2": 256}


def _spec(raw: RawModel, cfg: _Cfg, family: str, layers: tuple[CacheLayer, ...], pattern: str,
          mamba: MambaDims | None, attn: AttentionDims | None, mamba_type: str | None,
          hf_ssm: str | None = None, recurrent: Mamba1Dims | GdnDims | None = None,
          mamba_prefix_caching: bool = True) -> ModelSpec:
    arch = _architecture(cfg, family)
    dtype = _model_dtype(cfg)
    mpe = cfg.int("max_position_embeddings", bounds=POSITIONS) if cfg.raw.get("max_position_embeddings") is not None \
        else None
    # ModelConfig.get_mamba_chunk_size reads mamba_chunk_size, then chunk_size, from the transformers config
    # object, so the config class's default applies when config.json has neither; 2048 when the class has none.
    chunk_key = next((k for k in ("mamba_chunk_size", "chunk_size") if cfg.raw.get(k) is not None), None)
    chunk = cfg.int(chunk_key, bounds=CHUNK) if chunk_key else _CHUNK_DEFAULT.get(family, 2048)
    notes = list(cfg.notes)
    conf = raw.provenance.get("_confidence") if raw.provenance else None
    if isinstance(conf, dict) and conf.get("not_found"):
        notes.append("bundled config is incomplete; not found upstream: " + "; ".join(map(str, conf["not_found"])))
    return ModelSpec(
        model_id=raw.model_id, source=raw.source, family=family, architecture=arch,
        num_hidden_layers=len(pattern), cache_layers=layers, mamba=mamba, attention=attn, model_dtype=dtype,
        hf_mamba_ssm_cache_dtype=hf_ssm, kv_cache_quant=_kv_quant(raw), max_position_embeddings=mpe,
        mamba_type=mamba_type, layer_pattern=pattern, mamba_chunk_size=chunk if (mamba or recurrent) else None,
        recurrent=recurrent, mamba_prefix_caching=mamba_prefix_caching, notes=tuple(notes))


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
    if mt is None:
        raise ConfigError("model_type is missing from config.json", field="model_type",
                          fix="add model_type (e.g. nemotron_h, granitemoehybrid, falcon_h1, llama)")
    if not isinstance(mt, str):
        raise ConfigError(f"model_type must be a string, got {_show(mt)}", field="model_type",
                          fix="e.g. \"nemotron_h\", \"granitemoehybrid\", \"falcon_h1\", \"llama\"")
    if mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt](raw, cfg)
    if mt in _DENSE_TYPES:
        return _dense(raw, cfg)
    known = ", ".join(sorted(set(_BY_MODEL_TYPE) | _DENSE_TYPES))
    raise ConfigError(f"unsupported model_type {_show(mt)}", field="model_type", fix=f"hybridpd knows {known}")
