"""The families whose recurrent state is not Mamba2 (``ModelSpec.recurrent``): Jamba (Mamba-1), Qwen3-Next (GatedDeltaNet)."""

from __future__ import annotations

from hybridpd.core.families.base import (
    CONV_KERNEL,
    EXPAND,
    HEAD_DIM,
    HEADS,
    LAYERS,
    STATE,
    WIDTH,
    Adapter,
    Cfg,
    attention_dims,
    build_spec,
    cache_layers,
    check_count,
)
from hybridpd.core.families.spec import GdnDims, Mamba1Dims, ModelSpec
from hybridpd.core.models import RawModel
from hybridpd.errors import ConfigError


def jamba(raw: RawModel, cfg: Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    period = cfg.int("attn_layer_period", default=8, bounds=LAYERS)
    off = cfg.int("attn_layer_offset", default=4, bounds=(0, LAYERS[1]))
    if off >= period:
        raise ConfigError(f"attn_layer_offset {off} must be less than attn_layer_period {period}",
                          field="attn_layer_offset", fix="set attn_layer_offset in 0..attn_layer_period-1")
    kinds = ["*" if i % period == off else "M" for i in range(n)]
    layers, pat = cache_layers(kinds)
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
    return build_spec(raw, cfg, "jamba", layers, pat, None, attention_dims(cfg, head_dim_keys=()), "mamba1",
                      recurrent=rec)


def qwen3_next(raw: RawModel, cfg: Cfg) -> ModelSpec:
    n = cfg.int("num_hidden_layers", bounds=LAYERS)
    kinds = cfg.str_list("layer_types", {"full_attention": "*", "linear_attention": "M"})
    if kinds is None:
        interval = cfg.int("full_attention_interval", default=4, bounds=LAYERS)
        kinds = ["*" if (i + 1) % interval == 0 else "M" for i in range(n)]
    check_count("layer_types", kinds, n)
    layers, pat = cache_layers(kinds)
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
    return build_spec(raw, cfg, "qwen3_next", layers, pat, None, attention_dims(cfg), "gdn", recurrent=rec,
                      mamba_prefix_caching=False)


ADAPTERS: dict[str, Adapter] = {"jamba": jamba, "qwen3_next": qwen3_next}
