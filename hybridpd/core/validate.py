"""One set of bounds for settings read from files (deployment records): the same limits the CLI flags have.

A value read from a file is checked for type, finiteness and range before any code sizes work by it, so a
record with ``tp = 10**18`` is a one-line usage error, never a run that grows without end.
"""

from __future__ import annotations

import math
from typing import Any

from hybridpd.errors import UsageError

# plan's work grows with TP x layers; ISLs and block counts are plain integers but stay printable
MAX_TP = 1024
MAX_BYTES = 1 << 50  # 1 PiB
MAX_TOKENS = 1 << 24  # ISL, --max-model-len: 16,777,216 tokens
MAX_BLOCK_SIZE = 1 << 20
MAX_NUM_BLOCKS = 1 << 22
MAX_SPEC_TOKENS = 256

#: EngineSettings field -> (kind, low, high); kind: int, int?, float, bool?, bool, str, str?
ENGINE_BOUNDS: dict[str, tuple[str, float, float]] = {
    "tp": ("int", 1, MAX_TP),
    "block_size": ("int?", 1, MAX_BLOCK_SIZE),
    "num_speculative_tokens": ("int", 0, MAX_SPEC_TOKENS),
    "max_model_len": ("int?", 1, MAX_TOKENS),
    "num_blocks": ("int?", 1, MAX_NUM_BLOCKS),
    "kv_cache_memory": ("int?", 0, MAX_BYTES),
    "gpu_memory": ("int?", 0, MAX_BYTES),
    "weights_memory": ("int", 0, MAX_BYTES),
    "gpu_memory_utilization": ("float", 0, 1),
    "enable_prefix_caching": ("bool?", 0, 0),
    "disable_hybrid_kv_cache_manager": ("bool", 0, 0),
    "cpu_avx512_bf16": ("bool?", 0, 0),
    "cpu_amx_tile": ("bool?", 0, 0),
    "kv_cache_dtype": ("str", 0, 0),
    "mamba_cache_dtype": ("str", 0, 0),
    "mamba_ssm_cache_dtype": ("str", 0, 0),
    "dtype": ("str?", 0, 0),
    "attention_backend": ("str?", 0, 0),
    "conv_layout": ("str", 0, 0),
}


def check_value(name: str, value: Any, kind: str, low: float, high: float, *, where: str, field: str) -> None:
    """Raise a one-line UsageError naming ``where`` + ``name`` unless ``value`` has the kind and bounds."""
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    fix = "pass a file written by `hybridpd serve`"
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"{where}{name} must be true or false, got {type(value).__name__}", field=field, fix=fix)
        return
    if kind == "str":
        if not isinstance(value, str) or len(value) > 256:
            raise UsageError(f"{where}{name} must be a short string, got {type(value).__name__}", field=field, fix=fix)
        return
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{where}{name} must be an integer, got {type(value).__name__}", field=field, fix=fix)
    elif kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise UsageError(f"{where}{name} must be a finite number, got {str(value)[:20]}", field=field, fix=fix)
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 20 else str(value)[:20] + "..."
        raise UsageError(f"{where}{name} = {shown} is outside {low:g}..{high:g}", field=field, fix=fix)


def check_engine_settings(d: dict[str, Any], *, where: str, field: str) -> None:
    for name, (kind, low, high) in ENGINE_BOUNDS.items():
        if name in d:
            check_value(name, d[name], kind, low, high, where=where, field=field)
