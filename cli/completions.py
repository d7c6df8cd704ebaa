"""`hybridpd completions SHELL`: click's native completion script for bash, zsh or fish."""

from __future__ import annotations

import os
from typing import Any

import click

SHELLS = ("bash", "zsh", "fish")
PROG_NAME = "hybridpd"
COMPLETE_VAR = "_HYBRIDPD_COMPLETE"


def path_items(incomplete: str, limit: int = 200) -> list[Any]:
    """File and directory names under the typed prefix, as plain completion items (directories end in '/')."""
    from click.shell_completion import CompletionItem

    head, _, prefix = incomplete.rpartition("/")
    base = os.path.expanduser(head + "/" if head else ".") if (head or not incomplete.startswith("/")) else "/"
    out: list[Any] = []
    try:
        with os.scandir(base) as it:
            for entry in sorted(it, key=lambda e: e.name):
                if not entry.name.startswith(prefix) or (entry.name.startswith(".") and not prefix.startswith(".")):
                    continue
                name = (head + "/" if head or incomplete.startswith("/") else "") + entry.name
                out.append(CompletionItem(name + ("/" if entry.is_dir() else "")))
                if len(out) >= limit:
                    break
    except OSError:
        return []
    return out


def model_items(incomplete: str) -> list[Any]:
    """MODEL: bundled ids and aliases, and file names (a model directory or config.json) beside them.

    With no id matching, the shell's own file-name completion takes over (type 'file')."""
    from click.shell_completion import CompletionItem

    from hybridpd.core.models import completion_candidates

    ids = [CompletionItem(c) for c in completion_candidates() if c.startswith(incomplete)]
    if not ids:
        return [CompletionItem(incomplete, type="file")]
    return ids + path_items(incomplete)


def link_items(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """--link: entry names of the calibration table (--calibration FILE if already given, else the bundled one)."""
    from click.shell_completion import CompletionItem

    from hybridpd.core.estimate import load_calibration
    from hybridpd.errors import HybridPDError

    try:
        entries = load_calibration(ctx.params.get("calibration_path"))
    except (HybridPDError, OSError, ValueError):
        return []
    return [CompletionItem(e.name) for e in entries if e.name.startswith(incomplete)]


def completion_script(shell: str) -> str:
    """The script click generates for SHELL (checked in under completions/hybridpd.SHELL)."""
    from click.shell_completion import get_completion_class

    from .main import cli

    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - SHELLS are all built into click
        raise click.BadParameter(f"unsupported shell {shell!r}")
    return cls(cli, {}, PROG_NAME, COMPLETE_VAR).source()


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completions(shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish).

    MODEL arguments complete to bundled ids and aliases (e.g. `hybridpd plan nan<TAB>` offers nano,
    nano-fp8, ...) and to file names (a model directory or config.json); INPUT/OUTPUT paths complete to
    file names; --vllm-version to the releases hybridpd has profiles for; --link to calibration entries.
    Pre-generated scripts live in completions/ in the repository.

    \b
    Examples:
      eval "$(hybridpd completions bash)"                 # in ~/.bashrc
      hybridpd completions zsh > "${fpath[1]}/_hybridpd"
      hybridpd completions fish > ~/.config/fish/completions/hybridpd.fish
    """
    click.echo(completion_script(shell), nl=False)
