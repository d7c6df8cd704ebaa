"""The deployment record: what `hybridpd serve` launched, written atomically to a JSON file.

`serve` writes it when every process is healthy and rewrites it on each restart and at the stop; `verify
--deployment FILE` and `doctor --deployment FILE` read it back and use exactly these settings (model, release,
platform, every engine setting the plan depends on, URLs, ports), so a check cannot silently plan for something
other than what runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError

SCHEMA = "hybridpd.launch.deployment/1"
FIELD = "--deployment"
_SETTING_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings))


def default_path(proxy_port: int, role: str = "all") -> str:
    """Where `serve` records a deployment nobody named: $XDG_STATE_HOME/hybridpd/ (else ~/.local/state)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "hybridpd", f"deployment-{role}-{proxy_port}.json")


def _argv_value(argv: tuple[str, ...], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _effective(s: EngineSettings, argv: tuple[str, ...]) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    mml = _argv_value(argv, "--max-model-len")
    if mml is not None and mml.isdigit():
        d["max_model_len"] = int(mml)  # the launch may have set it (cpu: capped at 4096)
    return d


def build_record(lp: Any, *, model_arg: str, state: str = "running", supervisor: Any = None) -> dict[str, Any]:
    """The record of LaunchPlan ``lp`` (``model_arg``: MODEL as given to serve)."""
    plan = lp.plan
    procs = {p.name: p for p in lp.processes}
    first = {role: next((p for p in lp.processes if p.role == role), None) for role in ("prefill", "decode")}
    sides = {}
    for role, layout in (("prefill", plan.prefill), ("decode", plan.decode)):
        spec = first[role]
        sides[role] = _effective(layout.settings, spec.argv if spec else ())
    served = lp.model
    for p in lp.servers:
        name = _argv_value(p.argv, "--served-model-name")
        if name:
            served = name
    model = os.path.abspath(model_arg) if os.path.exists(model_arg) else model_arg
    kids: dict[str, Any] = {}
    if supervisor is not None:
        for c in supervisor.children:
            kids[c.spec.name] = {"keeper_pid": c.pid, "state": c.state, "restarts": c.restarts,
                                 "failures": list(c.history)}
    px = lp.proxy
    return {
        "schema": SCHEMA,
        "state": state,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "supervisor_pid": os.getpid() if supervisor is not None else None,
        "model": model,
        "vllm_model": lp.model,
        "served_model_name": served,
        "vllm": {"version": plan.target.text, "profile": plan.profile.name, "source": plan.target.source,
                 "installed": lp.entry.version, "distribution": lp.entry.distribution, "python": lp.entry.python},
        "platform": lp.platform,
        "role": lp.role,
        "block_size": {"prefill": plan.prefill.block_size, "decode": plan.decode.block_size},
        "settings": sides,
        "urls": {"proxy": px.url if px else None,
                 "prefill": [p.url for p in lp.by_role("prefill")], "decode": [p.url for p in lp.by_role("decode")]},
        "side_channel": {"host": lp.side_channel_host,
                         "ports": {p.name: p.side_channel_port for p in lp.servers}},
        "processes": {name: {"role": p.role, "url": p.url, "health_url": p.health_url, "port": p.port,
                             "side_channel_port": p.side_channel_port, "tp": p.tp, "argv": list(p.argv),
                             "env": dict(p.env), **kids.get(name, {})} for name, p in procs.items()},
        "notes": list(lp.notes),
    }


def write(path: str, record: dict[str, Any]) -> None:
    from hybridpd.fsutil import write_atomic

    write_atomic(path, json.dumps(record, indent=2, sort_keys=False) + "\n", field="--deployment-file",
                 parents=True)


@dataclass(frozen=True)
class Deployment:
    path: str
    record: dict[str, Any]
    model: str
    vllm_version: str
    platform: str
    prefill: EngineSettings
    decode: EngineSettings
    served_model_name: str
    proxy_url: str | None
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    side_channel_ports: tuple[int, ...]

    @property
    def state(self) -> str:
        return str(self.record.get("state", "unknown"))

    def supervisor_alive(self) -> bool:
        """Whether the recorded supervisor process still exists (on this host)."""
        pid = self.record.get("supervisor_pid")
        if not isinstance(pid, int) or pid <= 0:
            return False
        from hybridpd.host import pid_alive

        return pid_alive(pid)


def _settings(d: Any, side: str, path: str) -> EngineSettings:
    if not isinstance(d, dict):
        raise UsageError(f"{path}: settings.{side} is missing or not an object", field=FIELD,
                         fix="pass a file written by `hybridpd serve`")
    unknown = sorted(set(d) - set(_SETTING_FIELDS))
    if unknown:
        raise UsageError(f"{path}: settings.{side} has unknown key(s) {', '.join(unknown)}", field=FIELD,
                         fix="upgrade hybridpd to the version that wrote the file")
    from hybridpd.core.validate import check_engine_settings

    check_engine_settings(d, where=f"{path}: settings.{side}.", field=FIELD)
    try:
        return EngineSettings(**d)
    except TypeError as e:
        raise UsageError(f"{path}: settings.{side}: {e}", field=FIELD) from None


def load(path: str) -> Deployment:
    """Read and check a record; a clear one-line error names what is wrong."""
    from hybridpd.fsutil import parse_json_bytes, read_bounded

    data = parse_json_bytes(read_bounded(path, field=FIELD), where=path, field=FIELD,
                            fix="pass a file written by `hybridpd serve`")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{path}: not a hybridpd deployment record (schema {got!r}, expected {SCHEMA!r})",
                         field=FIELD, fix="pass the file `hybridpd serve` wrote (--deployment-file)")
    try:
        settings = data["settings"]
        urls = data["urls"]
        vllm = data["vllm"]
        dep = Deployment(
            path=path, record=data, model=str(data["model"]), vllm_version=str(vllm["version"]),
            platform=str(data["platform"]), prefill=_settings(settings.get("prefill"), "prefill", path),
            decode=_settings(settings.get("decode"), "decode", path),
            served_model_name=str(data.get("served_model_name") or data["vllm_model"]),
            proxy_url=urls.get("proxy"), prefill_urls=tuple(urls.get("prefill") or ()),
            decode_urls=tuple(urls.get("decode") or ()),
            side_channel_ports=tuple(int(v) for v in (data.get("side_channel", {}).get("ports") or {}).values()
                                     if v is not None))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise UsageError(f"{path}: incomplete deployment record ({e})", field=FIELD,
                         fix="pass the file `hybridpd serve` wrote") from None
    for name, val in (("model", data.get("model")), ("vllm.version", vllm.get("version"))):
        if not isinstance(val, str) or not val or len(val) > 4096:
            raise UsageError(f"{path}: {name} must be a non-empty string", field=FIELD,
                             fix="pass the file `hybridpd serve` wrote")
    if any(not 0 < p < 65536 for p in dep.side_channel_ports):
        raise UsageError(f"{path}: side_channel.ports must be in 1..65535", field=FIELD)
    if dep.platform not in ("cuda", "cpu"):
        raise UsageError(f"{path}: unknown platform {dep.platform!r}", field=FIELD)
    return dep
