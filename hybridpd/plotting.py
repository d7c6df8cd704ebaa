"""--plot: bytes per request against input length, actual vs naive (matplotlib, optional extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ExternalToolError
from .fsutil import atomic_target, output_target

if TYPE_CHECKING:
    from .plan import Plan


def plot_transfer(plan: Plan, path: str) -> None:
    output_target(path, field="--plot")  # refuse a directory, device or dangling link before any work
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ExternalToolError("matplotlib is not installed", field="--plot",
                                fix="pip install 'hybridpd[plot]'") from None
    if plan.routes is None:
        raise ExternalToolError("no transfer to plot for this combination", field="--plot",
                                fix="fix the errors in the findings first")
    top = max(plan.prefill.model.max_position_embeddings or 131072, 2048)
    isls = sorted({int(2 ** (i / 4)) for i in range(40, 4 * top.bit_length())} | {1024})
    isls = [i for i in isls if i <= top]
    ts = [plan.transfer_for(i) for i in isls]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(isls, [t.bytes / 2**20 for t in ts], label="moved (vLLM, unpadded Mamba)")
    ax.plot(isls, [t.naive_bytes / 2**20 for t in ts], "--", label="naive (whole padded pages)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("MiB per request (all D ranks)")
    ax.set_title(f"{plan.model.model_id}  P TP{plan.prefill.tp} -> D TP{plan.decode.tp}", fontsize=9)
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_target(path, suffix=".png", field="--plot") as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)
