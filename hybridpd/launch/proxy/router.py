"""The routers ``hybridpd serve --router`` can put in front of P and D: hybridpd's own proxy, or ``vllm-router``.

``vllm-router`` (PyPI ``vllm-router``, Rust, from the vLLM project) speaks the same NixlConnector P/D protocol in
its ``--vllm-pd-disaggregation`` mode: checked against the fake P/D of ``tests/proxy_fakes.py`` (0.1.17) it sends P
``max_tokens=1``, ``stream=false``, ``min_tokens=1`` and the ``do_remote_decode`` ``kv_transfer_params``, then D the
client's body with P's ``kv_transfer_params``, under one router-generated ``X-Request-Id`` per request (the client's
id is echoed in the response). It listens only once every worker answers ``/health`` (it polls every
``--worker-startup-check-interval`` seconds, 30 by default: set to 1 here), and it serves ``/health``,
``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``; its Prometheus metrics are on a port of their own.

Differences that matter to hybridpd: vllm-router forwards a request decode will refuse (``max_tokens: 0``) to P
first; it has no least-outstanding policy (``least_outstanding`` maps to its ``power_of_two``, the nearest).
What hybridpd checks on top of any router (the plan's findings, ``verify`` against D's NIXL metrics) talks to P
and D directly and does not depend on which router is in front.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from hybridpd.errors import UsageError

ROUTERS: Final[tuple[str, ...]] = ("hybridpd", "vllm-router")
#: The release the integration test and the benchmark ran against.
VLLM_ROUTER_TESTED: Final = "0.1.17"
VLLM_ROUTER_INSTALL: Final = f"pip install vllm-router=={VLLM_ROUTER_TESTED}"
_POLICIES: Final = {"round_robin": "round_robin", "least_outstanding": "power_of_two"}


def check_router(name: str) -> str:
    if name not in ROUTERS:
        raise UsageError(f"unknown router {name!r}", field="--router", fix=f"use one of {', '.join(ROUTERS)}")
    return name


def find_vllm_router(explicit: str | None = None, *, vllm_python: str | None = None) -> str:
    """The ``vllm-router`` executable: ``explicit``, else ``$HYBRIDPD_VLLM_ROUTER``, else next to
    ``vllm_python``, else on PATH. Raises ``UsageError`` naming the install line when none is found."""
    for candidate in (explicit, os.environ.get("HYBRIDPD_VLLM_ROUTER")):
        if candidate:
            path = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
            if path is None:
                raise UsageError(f"{candidate!r} is not an executable", field="--vllm-router",
                                 fix=f"give the path of vllm-router ({VLLM_ROUTER_INSTALL})")
            return path
    if vllm_python:
        sibling = Path(vllm_python).parent / "vllm-router"
        if sibling.is_file() and os.access(sibling, os.X_OK):
            return str(sibling)
    found = shutil.which("vllm-router")
    if found is None:
        raise UsageError("vllm-router is not installed (not on PATH)", field="--router",
                         fix=f"{VLLM_ROUTER_INSTALL} (a separate venv is fine) and pass --vllm-router PATH")
    return found


def vllm_router_argv(
    executable: str,
    *,
    host: str,
    port: int,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    policy: str = "round_robin",
    prometheus_port: int | None = None,
    request_timeout_s: int = 1800,
    startup_timeout_s: int = 1800,
    log_level: str = "info",
) -> list[str]:
    """argv for ``vllm-router`` in P/D mode with the same P and D URLs hybridpd's proxy would get."""
    if policy not in _POLICIES:
        raise UsageError(f"policy {policy!r} has no vllm-router equivalent", field="--policy",
                         fix=f"use one of {', '.join(_POLICIES)}")
    if not prefill_urls or not decode_urls:
        raise UsageError("vllm-router needs at least one prefill and one decode URL", field="--router")
    argv = [executable, "--vllm-pd-disaggregation", "--host", host, "--port", str(port),
            "--policy", _POLICIES[policy], "--kv-connector", "nixl",
            "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", str(startup_timeout_s),
            "--request-timeout-secs", str(request_timeout_s), "--log-level", log_level]
    if prometheus_port is not None:
        argv += ["--prometheus-port", str(prometheus_port)]
    for url in prefill_urls:
        argv += ["--prefill", url]
    for url in decode_urls:
        argv += ["--decode", url]
    return argv
