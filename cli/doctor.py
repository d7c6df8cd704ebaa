"""`hybridpd doctor`: what this machine lacks for a P/D launch, and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from ._options import ModelArg
from ._output import Report, Table, emit_json, emit_report, hint, output_options, resolve_format


def _ports(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: use comma-separated port numbers, e.g. 5600,5700") from None
    if not out or any(not 0 < p < 65536 for p in out):
        raise click.BadParameter("ports must be in 1..65535")
    return out


@click.command()
@click.option("--model", "model", type=ModelArg(), default=None,
              help="Also check the env vars and P/D support this model needs (bundled id, alias or path).")
@click.option("--ports", callback=_ports, default="5600,5700", show_default=True,
              help="NIXL side-channel ports (VLLM_NIXL_SIDE_CHANNEL_PORT of P and D) that must be free.")
@click.option("--platform", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Platform to check for (default: cuda when nvidia-smi lists a GPU, else cpu).")
@click.option("--no-probe", is_flag=True, help="Skip importing NIXL in a subprocess to list its plugins.")
@output_options
def doctor(model: str | None, ports: tuple[int, ...], platform: str | None, no_probe: bool, as_json: bool,
           fmt: str | None) -> None:
    """Check this machine for what a P/D launch needs and say what to fix.

    Checks Python, vLLM (version and hybridpd profile), NIXL and its UCX plugin, UCX transports, GPUs,
    the env vars MODEL needs, and that the side-channel ports are free. Each check is ok, warn, fail or
    info; exit status 1 when any check fails (something blocks a launch), else 0.

    \b
    Examples:
      hybridpd doctor
      hybridpd doctor --model nano-fp8 --ports 5600,5700
      hybridpd doctor --platform cpu --json
    """
    from hybridpd.doctor import blocking, run_checks

    checks = run_checks(model=model, ports=ports, platform=platform, probe_nixl=not no_probe)
    failed = blocking(checks)
    out = resolve_format(as_json, fmt)
    if out == "json":
        emit_json({"ok": not failed, "checks": [c.as_dict() for c in checks]})
    else:
        rows: list[Sequence[Any]] = [
            [c.status.upper() if c.status == "fail" else c.status, c.name, c.detail, c.fix or ""] for c in checks]
        emit_report(Report(tables=[Table(title="hybridpd doctor", headers=["status", "check", "detail", "fix"],
                                         rows=rows)]), out)
    if failed:
        hint(f"{len(failed)} check(s) block a P/D launch: {', '.join(c.name for c in failed)}")
        raise SystemExit(1)
