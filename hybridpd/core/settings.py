"""The `vllm serve` flags that change the KV-cache layout, for one side (P or D) of a P/D pair."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.errors import UsageError

MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    tp: int = 1
    block_size: int | None = None  # --block-size; None = platform/backend default
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    dtype: str | None = None  # --dtype override of the model dtype
    attention_backend: str | None = None  # None = platform default
    enable_prefix_caching: bool | None = None  # None = vLLM's default for this version
    num_speculative_tokens: int = 0
    speculative_method: str | None = None  # --speculative-config method (core/speculative.py); None: not given
    speculative_model: str | None = None  # --speculative-config model (a separate draft model)
    max_model_len: int | None = None
    num_blocks: int | None = None  # --num-gpu-blocks-override
    kv_cache_memory: int | None = None  # bytes available to the KV cache (--kv-cache-memory-bytes)
    gpu_memory: int | None = None  # bytes of device memory (upper bound: weights not subtracted)
    gpu_memory_utilization: float = 0.9
    weights_memory: int = 0  # bytes to subtract from gpu_memory*utilization, per rank
    disable_hybrid_kv_cache_manager: bool = False
    conv_layout: str = "DS"  # VLLM_SSM_CONV_STATE_LAYOUT
    cpu_avx512_bf16: bool | None = None  # CPU platform: target host has avx512_bf16 (None: not known; the CLI fills it)
    cpu_amx_tile: bool | None = None  # CPU platform: target host has AMX tiles (None: not known; the CLI fills it)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise UsageError(f"TP must be >= 1, got {self.tp}", field="--ptp/--dtp")
        if self.block_size is not None and self.block_size < 1:
            raise UsageError(f"must be >= 1, got {self.block_size}", field="--block-size")
        for name, val, allowed in (("--kv-cache-dtype", self.kv_cache_dtype, KV_DTYPES),
                                   ("--mamba-cache-dtype", self.mamba_cache_dtype, MAMBA_DTYPES),
                                   ("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype, MAMBA_DTYPES)):
            if val not in allowed:
                raise UsageError(f"unknown value {val!r}", field=name, fix=f"use one of {', '.join(allowed)}")
        if self.num_speculative_tokens < 0:
            raise UsageError("must be >= 0", field="--num-speculative-tokens")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(f"must be in (0, 1], got {self.gpu_memory_utilization}",
                             field="--gpu-memory-utilization")
        if self.conv_layout not in ("DS", "SD"):
            raise UsageError(f"unknown layout {self.conv_layout!r}", field="--conv-layout", fix="use DS or SD")


def parse_size(text: str, *, field: str) -> int:
    """'141GB', '80GiB', '512MiB', '1e9' -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise UsageError(f"cannot parse size {text!r}", field=field, fix="write e.g. 141GB, 80GiB or 512MiB")
    num = float(m.group(1))
    unit = m.group(2).upper()
    base = 1024 if m.group(3) else 1000
    exp = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    return int(num * base**exp)
