"""The one check behind every ``--device cuda`` path: torch must see the GPU asked for."""

from __future__ import annotations

from hybridpd.errors import ExternalToolError


def require_gpu(index: int, device: str) -> None:
    """Raise a one-line ExternalToolError naming ``--device`` unless torch sees CUDA device ``index``."""
    try:
        import torch
    except ImportError:
        raise ExternalToolError(f"--device {device} needs torch with CUDA", field="--device",
                                fix="install a CUDA build of torch, or use --device cpu") from None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= n:
        raise ExternalToolError(f"--device {device}: torch {torch.__version__} sees no CUDA device {index} "
                                f"({n} CUDA device(s) visible)", field="--device",
                                fix="use --device cpu, or a GPU index below the device count")
