"""The Mamba2 families: NemotronH, GraniteMoeHybrid, Falcon-H1, pure Mamba2 and Zamba2 (``ModelSpec.mamba`` set)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hybridpd.core.families.base import (
    CONV_KERNEL,
    EXPAND,
    GROUPS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    STATE,
    Adapter,
    Cfg,
    MambaKeys,
    attention_dims,
    build_spec,
    cache_layers,
    check_count,
    check_mamba,
    mamba2_dims,
)
from hybridpd.core.families.spec import MambaDims, ModelSpec
from hybridpd.core.models import RawModel
from hybridpd.errors import ConfigError

_NEMOTRON_BLOCK_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E", "linear_attention": "M",
                         "full_attention": "*"}
_NEMOTRON_KEYS = MambaKeys(heads="mamba_num_heads", head_dim="mamba_head_dim", groups="n_groups", state="ssm_state_size",
                           conv="conv_kernel", inter="mamba_num_heads", inter_expr="mamba_num_heads * mamba_head_dim")
# GraniteMoeHybrid and Falcon-H1 spell the mixer alike (Falcon-H1 may set the x channels with mamba_d_ssm)
_MAMBA_N_KEYS = MambaKeys(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", state="mamba_d_state",
                          conv="mamba_d_conv", inter="mamba_expand", inter_expr="mamba_expand * hidden_size")
_ZAMBA2_KEYS = MambaKeys(heads="n_mamba_heads", head_dim="mamba_headdim", groups="mamba_ngroups", state="mamba_d_state",
                         conv="mamba_d_conv", inter="mamba_expand", inter_expr="mamba_expand * hidden_size")


def _expand_times(cfg: Cfg, hidden: int) -> Callable[[int, int], int]:
    """x channels = mamba_expand * hidden_size (GraniteMoeHybrid, Zamba2)."""
    return lambda _heads, _head_dim: cfg.int("mamba_expand", default=2, bounds=EXPAND) * hidden


def nemotron_h(raw: RawModel, cfg: Cfg) -> ModelSpec:
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
    mamba = mamba2_dims(cfg, _NEMOTRON_KEYS, lambda heads, head_dim: heads * head_dim, groups_default=None)
    layers, pat = cache_layers(list(pattern))
    attn = attention_dims(cfg) if "*" in pattern else None
    spec = build_spec(raw, cfg, "nemotron_h", layers, pat, mamba, attn, "mamba2",
                      hf_ssm=cfg.str("mamba_ssm_cache_dtype"))
    mtp = cfg.int("num_nextn_predict_layers", bounds=(0, 64)) if cfg.raw.get("num_nextn_predict_layers") else 0
    if not mtp:
        return spec
    return replace(spec, mtp_layers=mtp, mtp_pattern=cfg.str("mtp_hybrid_override_pattern") or "")


def granite(raw: RawModel, cfg: Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    # transformers >= 5 writes linear_attention / full_attention for mamba / attention
    kinds = cfg.str_list("layer_types", {"mamba": "M", "linear_attention": "M", "attention": "*",
                                         "full_attention": "*"})
    if kinds is None:
        raise ConfigError("layer_types is missing", field="layer_types",
                          fix="add layer_types (mamba/attention per layer)")
    check_count("layer_types", kinds, n)
    mamba = mamba2_dims(cfg, _MAMBA_N_KEYS, _expand_times(cfg, cfg.int("hidden_size")))
    layers, pat = cache_layers(kinds)
    attn = attention_dims(cfg, head_dim_keys=()) if "*" in kinds else None
    return build_spec(raw, cfg, "granitemoehybrid", layers, pat, mamba, attn, "mamba2")


def falcon_h1(raw: RawModel, cfg: Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    hidden = cfg.int("hidden_size")
    if cfg.raw.get("mamba_d_ssm") is None:
        inter = cfg.int("mamba_expand", default=2, bounds=EXPAND) * hidden
        expr = "mamba_expand * hidden_size (mamba_d_ssm is absent)"
        cfg.notes.append("mamba_d_ssm not in config.json; vLLM then uses mamba_expand * hidden_size")
    else:
        inter = cfg.int("mamba_d_ssm")
        expr = "mamba_d_ssm"
    keys = replace(_MAMBA_N_KEYS, inter="mamba_d_ssm", inter_expr=expr)
    mamba = mamba2_dims(cfg, keys, lambda _heads, _head_dim: inter)
    layers, pat = cache_layers(["H"] * n)
    attn = attention_dims(cfg)
    return build_spec(raw, cfg, "falcon_h1", layers, pat, mamba, attn, "mamba2")


def pure_mamba2(raw: RawModel, cfg: Cfg) -> ModelSpec:
    if "d_model" in cfg.raw:  # state-spaces mamba_ssm format
        hidden = cfg.int("d_model")
        n = cfg.int("n_layer", bounds=LAYERS)
        ssm_cfg = cfg.raw.get("ssm_cfg")
        if ssm_cfg is None:
            ssm_cfg = {}
        if not isinstance(ssm_cfg, dict):
            raise ConfigError(f"ssm_cfg must be an object, got {type(ssm_cfg).__name__}", field="ssm_cfg",
                              fix="set ssm_cfg to a JSON object (e.g. {\"layer\": \"Mamba2\"})")
        sub = Cfg(ssm_cfg, cfg.model_id, prefix="ssm_cfg.")
        layer = sub.str("layer") or "Mamba2"
        if layer != "Mamba2":
            return _rejected(raw, cfg, "mamba1", "Mamba-1 layers (ssm_cfg.layer)")
        expand = sub.int("expand", default=2, bounds=EXPAND)
        hd = sub.int("headdim", default=64, bounds=HEAD_DIM)
        inter = expand * hidden
        keys = MambaKeys(heads="ssm_cfg.headdim", head_dim="ssm_cfg.headdim", groups="ssm_cfg.ngroups",
                         state="ssm_cfg.d_state", conv="ssm_cfg.d_conv", inter="ssm_cfg.headdim",
                         inter_expr="ssm_cfg.expand * d_model")
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
        keys = MambaKeys(heads="num_heads", head_dim="head_dim", groups="n_groups", state="state_size",
                         conv="conv_kernel", inter="expand", inter_expr="expand * hidden_size")
        mamba = MambaDims(num_heads=cfg.int("num_heads", default=max(inter // hd, 1), bounds=HEADS), head_dim=hd,
                          n_groups=cfg.int("n_groups", default=1, bounds=GROUPS),
                          state_size=cfg.int("state_size", default=128, bounds=STATE),
                          conv_kernel=cfg.int("conv_kernel", default=4, bounds=CONV_KERNEL), intermediate_size=inter)
        attn_idx = []
    if attn_idx:
        return _rejected(raw, cfg, "mamba2", "attention layers inside a mamba_ssm checkpoint (not a vLLM format)")
    check_mamba(mamba, keys)
    layers, pat = cache_layers(["M"] * n)
    return build_spec(raw, cfg, "mamba2", layers, pat, mamba, None, "mamba2")


def zamba2(raw: RawModel, cfg: Cfg) -> ModelSpec:
    kinds = cfg.str_list("layers_block_type", {"mamba": "M", "hybrid": "H"})
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    if kinds is None:
        raise ConfigError("layers_block_type is missing", field="layers_block_type",
                          fix="one entry (mamba or hybrid) per layer")
    check_count("layers_block_type", kinds, n)
    mamba = mamba2_dims(cfg, _ZAMBA2_KEYS, _expand_times(cfg, cfg.int("hidden_size")))
    layers, pat = cache_layers(kinds)
    attn = attention_dims(cfg, head_dim_keys=("attention_head_dim",))
    cfg.notes.append("Zamba2: shared attention blocks are modelled as one KV cache per hybrid layer")
    return build_spec(raw, cfg, "zamba2", layers, pat, mamba, attn, "mamba2")


def _rejected(raw: RawModel, cfg: Cfg, mamba_type: str, what: str) -> ModelSpec:
    """A mamba_ssm checkpoint vLLM cannot serve as Mamba2: no layers, and a note saying why."""
    cfg.notes.append(f"contains {what}")
    return build_spec(raw, cfg, "mamba2", (), "", None, None, mamba_type)


ADAPTERS: dict[str, Adapter] = {
    "nemotron_h": nemotron_h,
    "granitemoehybrid": granite,
    "falcon_h1": falcon_h1,
    "mamba2": pure_mamba2,
    "zamba2": zamba2,
}
