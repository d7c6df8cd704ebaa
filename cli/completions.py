"""`hybridpd completions SHELL`: click's native completion script for bash, zsh or fish."""

from __future__ import annotations

import click

SHELLS = ("bash", "zsh", "fish")
PROG_NAME = "hybridpd"
COMPLETE_VAR = "_HYBRIDPD_COMPLETE"


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
    nano-fp8, ...). Pre-generated scripts live in completions/ in the repository.

    \b
    Examples:
      eval "$(hybridpd completions bash)"                 # in ~/.bashrc
      hybridpd completions zsh > "${fpath[1]}/_hybridpd"
      hybridpd completions fish > ~/.config/fish/completions/hybridpd.fish
    """
    click.echo(completion_script(shell), nl=False)
