"""CUDA-event timing shared by the GPU benchmarks."""

from __future__ import annotations

from typing import Any


def best_time(fn: Any, repeat: int, warmup: int = 3) -> float:
    """Best of ``repeat`` timed calls of ``fn`` in seconds (CUDA events), after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return best
