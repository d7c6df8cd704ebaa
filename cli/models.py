"""`hybridpd models`: bundled models, their layer mix, and P/D support per vLLM profile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from ._output import Report, Table, emit_json, emit_report, output_options, resolve_format


@click.command()
@click.option("--supported-only", is_flag=True, help="Only models vLLM P/D supports on at least one profile.")
@output_options
def models(supported_only: bool, as_json: bool, fmt: str | None) -> None:
    """List bundled models: family, layer mix (Mamba / attention), aliases, and P/D support per vLLM profile.

    P/D support is decided by the plan engine at TP 1/1 with default settings, per vLLM release range;
    "no" carries the first error finding's code (see `hybridpd plan MODEL --vllm-version V` for the full
    story). A second column checks heterogeneous TP (P TP 1 -> D TP 2) on the newest profile: models
    with n_groups = 1 (Granite, most Falcon-H1) pass at TP 1/1 but get their conv state corrupted there.

    \b
    Examples:
      hybridpd models
      hybridpd models --json | jq '.[] | select(.pd_support["0.32"].supported) | .id'
      hybridpd models --fmt markdown
    """
    from hybridpd.core.catalog import catalog, profile_names

    entries = [e.as_dict() for e in catalog()]
    if supported_only:
        entries = [e for e in entries if any(s["supported"] for s in e["pd_support"].values())]
    out = resolve_format(as_json, fmt)
    if out == "json":
        emit_json(entries)
        return
    emit_report(render(entries, profile_names()), out)


def support_ranges(support: dict[str, dict[str, Any]], profiles: list[str]) -> str:
    """Per-profile support folded into release ranges, e.g. 'no 0.20-0.21 (unsupported-mamba-type); yes 0.22-0.33'."""
    runs: list[list[str]] = []  # [first, last, verdict]
    for p in profiles:
        verdict = "yes" if support[p]["supported"] else f"no ({support[p]['reason']})"
        if runs and runs[-1][2] == verdict:
            runs[-1][1] = p
        else:
            runs.append([p, p, verdict])
    parts = []
    for first, last, verdict in runs:
        span = first if first == last else f"{first}-{last}"
        word, _, why = verdict.partition(" ")
        parts.append(f"{word} {span}" + (f" {why}" if why else ""))
    return "; ".join(parts)


def _hetero_cell(h: dict[str, Any] | None) -> str:
    if h is None:
        return "-"
    return "yes" if h["supported"] else f"no ({h['reason']})"


def render(entries: list[dict[str, Any]], profiles: list[str]) -> Report:
    rows: list[Sequence[Any]] = []
    for e in entries:
        mix = f"{e['mamba_layers']}M / {e['attention_layers']}A"
        kind = e["mamba_type"] or "-"
        if e["n_groups"]:
            kind = f"{kind} g{e['n_groups']}"
        rows.append([e["id"], ", ".join(e["aliases"]) or "-", e["family"] or "-", mix, kind,
                     support_ranges(e["pd_support"], profiles), _hetero_cell(e.get("hetero_tp"))])
    h = next((e["hetero_tp"] for e in entries if e.get("hetero_tp")), None)
    hetero = f"TP {h['prefill_tp']} -> {h['decode_tp']} (vLLM {h['profile']})" if h else "hetero TP"
    return Report(tables=[Table(
        title="Bundled models",
        headers=["id", "aliases", "family", "layers (M / A)", "mamba (groups)", "P/D at TP 1/1", hetero],
        rows=rows,
        caption="P/D at TP 1/1: plan engine, default settings, per vLLM release range; reason = first error code. "
                f"{hetero}: the same check with heterogeneous TP")],
        notes=["Use an id or alias as MODEL, e.g. `hybridpd plan nano-fp8`."])
