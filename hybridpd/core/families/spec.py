"""What hybridpd reads from a model's config: the Mamba / attention geometry and the cache layers, as vLLM sees them.

Layer order matters: HMA groups are formed in first-appearance order of the KV-cache specs, so
``ModelSpec.cache_layers`` lists the layers that own a KV cache or a Mamba state in vLLM's
registration order (Falcon-H1 registers each layer's attention before its Mamba mixer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # the checkpoint's MTP drafter (NemotronH num_nextn_predict_layers / mtp_hybrid_override_pattern), read by
    # core/speculative.py; 0 / "" when the config has none
    mtp_layers: int = 0
    mtp_pattern: str = ""
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
