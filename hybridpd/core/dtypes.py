"""Dtype names as vLLM spells them, and their element sizes."""

from __future__ import annotations

from hybridpd.errors import UsageError

# canonical name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "fp8_inc": "fp8",
    "fp8_ds_mla": "fp8",
}


def canonical(name: str, *, field: str = "dtype") -> str:
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        choices = ", ".join(sorted(DTYPE_SIZES))
        raise UsageError(f"unknown dtype {name!r}", field=field, fix=f"use one of {choices}")
    return key


def size_of(name: str) -> int:
    return DTYPE_SIZES[canonical(name)]
