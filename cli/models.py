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

    P/D support is decided by the plan engine at TP 1/1 with default settings; "no" carries the first
    error finding's code (see `hybridpd plan MODEL --vllm-version V` for the full story).

    \b
    Examples:
      hybridpd models
      hybridpd models --json | jq '.[] | select(.pd_support["0.32"].supported) | .id'
      hybridpd models --fmt markdown
    """
    from hybridpd.catalog import catalog, profile_names

    entries = [e.as_dict() for e in catalog()]
    if supported_only:
        entries = [e for e in entries if any(s["supported"] for s in e["pd_support"].values())]
    out = resolve_format(as_json, fmt)
    if out == "json":
        emit_json(entries)
        return
    emit_report(render(entries, profile_names()), out)


def _support_cell(s: dict[str, Any]) -> str:
    return "yes" if s["supported"] else f"no ({s['reason']})"


def render(entries: list[dict[str, Any]], profiles: list[str]) -> Report:
    rows: list[Sequence[Any]] = []
    for e in entries:
        mix = f"{e['mamba_layers']}M / {e['attention_layers']}A"
        kind = e["mamba_type"] or "-"
        if e["n_groups"]:
            kind = f"{kind} g{e['n_groups']}"
        rows.append([e["id"], ", ".join(e["aliases"]) or "-", e["family"] or "-", mix, kind,
                     *(_support_cell(e["pd_support"][p]) for p in profiles)])
    return Report(tables=[Table(
        title="Bundled models",
        headers=["id", "aliases", "family", "layers (M / A)", "mamba (groups)", *(f"vLLM {p}" for p in profiles)],
        rows=rows,
        caption="P/D support: plan engine at TP 1/1, default settings; reason = first error code")],
        notes=["Use an id or alias as MODEL, e.g. `hybridpd plan nano-fp8`."])
