"""--plot: bytes per request against input length, moved vs naive, and what the N-1 rule saves (matplotlib, optional).

Top panel: MiB moved per request (all D ranks) and the naive whole-padded-pages figure, log-log; the --isl values
of the plan are marked. Bottom panel: the saving (naive - moved) in KiB, which the top panel cannot show when it is
a small fraction. A combination vLLM refuses is titled as refused. The format follows the file extension.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybridpd.core.findings import ERROR
from hybridpd.errors import ExternalToolError, UsageError
from hybridpd.fsutil import atomic_target, output_target

if TYPE_CHECKING:
    from hybridpd.core.plan import Plan

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def plot_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise UsageError(f"cannot tell the image format from {os.path.basename(path)!r}", field="--plot",
                         fix="name a .png, .svg or .pdf file")
    return FORMATS[ext]


def plot_transfer(plan: Plan, path: str) -> None:
    fmt = plot_format(path)
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
    marked = sorted({t.isl for t in plan.transfers})
    top = max(plan.prefill.model.max_position_embeddings or 131072, 2048, *marked)
    isls = sorted({int(2 ** (i / 4)) for i in range(40, 4 * top.bit_length())} | {1024} | set(marked))
    isls = [i for i in isls if i <= top]
    ts = {i: plan.transfer_for(i) for i in isls}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ax.plot(isls, [ts[i].bytes / 2**20 for i in isls], label="moved (vLLM, unpadded Mamba)")
    ax.plot(isls, [ts[i].naive_bytes / 2**20 for i in isls], "--", label="naive (whole padded pages)")
    ax.scatter(marked, [ts[i].bytes / 2**20 for i in marked], zorder=3, color="black", s=14, label="--isl")
    for i in marked:
        ax.annotate(f"{i:,}: {ts[i].bytes / 2**20:,.1f} MiB", (i, ts[i].bytes / 2**20), textcoords="offset points",
                    xytext=(4, -10), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("MiB per request (all D ranks)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    saved = [(ts[i].naive_bytes - ts[i].bytes) / 2**10 for i in isls]
    ax2.plot(isls, saved, color="tab:green", label="saved by the N-1 rule (naive - moved)")
    ax2.scatter(marked, [(ts[i].naive_bytes - ts[i].bytes) / 2**10 for i in marked], zorder=3, color="black", s=14)
    ax2.set_xlabel("input length (tokens)")
    ax2.set_ylabel("KiB saved per request")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    title = f"{plan.model.model_id}  P TP{plan.prefill.tp} -> D TP{plan.decode.tp}"
    errors = [f.code for f in plan.findings if f.severity == ERROR]
    if errors:
        title = f"REFUSED by vLLM ({', '.join(errors)})\n{title}"
    ax.set_title(title, fontsize=9, color="tab:red" if errors else "black")
    fig.tight_layout()
    try:
        with atomic_target(path, suffix=f".{fmt}", field="--plot") as tmp:
            fig.savefig(tmp, format=fmt, dpi=110)
    finally:
        plt.close(fig)
