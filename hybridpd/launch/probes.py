"""The launch's probes of this host: can a port be bound, and does vLLM's own parser take the argv.

The one port probe (``bind_error``) serves `serve` (every port of a launch plan, before anything starts),
the supervisor (what a dead child still holds) and `doctor` (the ports a default launch binds).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from typing import TYPE_CHECKING, Any

from hybridpd.errors import ExternalToolError, HybridPDError

if TYPE_CHECKING:  # only the types: `doctor` imports the port probe without the planning pipeline
    from hybridpd.launch.commands import LaunchPlan, ProcessSpec


class PortConflict(HybridPDError):
    """A port the plan needs is already bound on its host."""


def bind_error(host: str, port: int) -> str | None:
    """None when a server could bind TCP ``(host, port)`` now, else why not (the OS's words).

    The probe binds as vLLM's HTTP server (uvicorn) and ZMQ's side-channel listener do, with SO_REUSEADDR: a
    port that a stopped server left in TIME_WAIT counts as free, one held by a listener does not. The host is
    resolved like theirs (getaddrinfo), so names and IPv6 literals work."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve {host}: {e}"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def port_in_use(host: str, port: int) -> bool:
    return bind_error(host, port) is not None


def check_ports(lp: LaunchPlan) -> None:
    """Raise PortConflict naming every port of the plan that is already bound on its host."""
    busy = [(h, p, w) for h, p, w in lp.bindings() if port_in_use(h, p)]
    if busy:
        text = ", ".join(f"{h}:{p} ({w})" for h, p, w in busy)
        raise PortConflict(f"port(s) already in use: {text}",
                           field="--prefill-port/--decode-port/--proxy-port/--side-channel-port",
                           fix="stop what holds them (ss -ltnp) or choose other port bases")


_CHECK = r"""
import json, sys, io, contextlib
cases = json.loads(sys.stdin.read())
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
out = []
for name, args in cases:
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(args)
        out.append({"name": name, "ok": True, "error": None})
    except SystemExit:
        out.append({"name": name, "ok": False, "error": err.getvalue().strip().splitlines()[-1:] })
print("@@CHECK@@" + json.dumps(out))
"""


def vllm_parser_args(p: ProcessSpec, lp: LaunchPlan) -> list[str]:
    """The flags of P/D's argv in the form vLLM's serve parser takes (--model MODEL ...)."""
    argv = list(p.argv)
    n = len(lp.entry.prefix)
    rest = argv[n:]
    if lp.entry.kind == "cli":
        rest = rest[1:]  # "serve"
        return ["--model", rest[0], *rest[1:]]
    return rest


def check_vllm_args(lp: LaunchPlan, python: str, *, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Parse every P/D argv with vLLM's own `vllm serve` parser in PYTHON; returns per-process results."""
    cases = [[p.name, vllm_parser_args(p, lp)] for p in lp.servers]
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        res = subprocess.run([python, "-c", _CHECK], input=json.dumps(cases), capture_output=True, text=True,
                             timeout=timeout, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ExternalToolError(f"cannot run vLLM's parser in {python}: {e}", field="--check") from None
    for line in res.stdout.splitlines():
        if line.startswith("@@CHECK@@"):
            results: list[dict[str, Any]] = json.loads(line[len("@@CHECK@@"):])
            for r in results:
                if r["error"] is not None:
                    r["error"] = " ".join(r["error"])
            return results
    raise ExternalToolError(f"vLLM's parser did not run in {python}: {res.stderr.strip()[-500:]}",
                            field="--check", fix="pass --vllm-python with a venv that has vllm installed")
