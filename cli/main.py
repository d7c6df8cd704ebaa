"""Root command group. Subcommands load lazily so `--help`, completion and `plan` stay light."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from hybridpd import __version__

# command name -> (module, attribute, one-line help). Modules import only when the command runs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("hybridpd_cli.plan", "plan", "Predict vLLM's hybrid KV-cache layout and P/D transfer for a model."),
    "verify": ("hybridpd_cli.verify", "verify", "Diff expected against transferred bytes (rehearsal or live)."),
    "serve": ("hybridpd_cli.serve", "serve", "Launch P/D vLLM pairs and the routing proxy."),
    "convert": ("hybridpd_cli.convert", "convert", "Convert Mamba conv state between SD and DS layouts / TP shards."),
    "models": ("hybridpd_cli.models", "models", "List bundled models and their P/D support per vLLM version."),
    "diff": ("hybridpd_cli.diff", "diff", "What changes between two plans (an upgrade, TP, block size, dtype)."),
    "doctor": ("hybridpd_cli.doctor", "doctor", "Check this machine for what a P/D launch needs."),
    "proxy": ("hybridpd_cli.proxy", "proxy", "Run the P/D routing proxy in the foreground (what `serve` launches)."),
    "completions": ("hybridpd_cli.completions", "completions", "Print the shell completion script."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module, attr, _ = entry
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
                return None
            raise
        cmd: click.Command = getattr(mod, attr)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hybridpd")
def cli() -> None:
    """Plan, launch and verify disaggregated prefill/decode for hybrid SSM + attention models on vLLM.

    \b
    Example:
      hybridpd plan nano-fp8 --ptp 1 --dtp 4
    """


def main(argv: list[str] | None = None) -> Any:
    from ._errors import run_with_errors

    return run_with_errors(cli, argv, debug=os.environ.get("HYBRIDPD_DEBUG") == "1")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
