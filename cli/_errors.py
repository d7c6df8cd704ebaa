"""The one error table: library exceptions -> one line on stderr + exit code. Unknown errors are bugs."""

from __future__ import annotations

import sys
from typing import Any

import click

from hybridpd.errors import HybridPDError


def run_with_errors(cmd: click.Command, argv: list[str] | None, *, debug: bool = False) -> Any:
    try:
        return cmd.main(args=argv, prog_name="hybridpd", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except HybridPDError as e:
        if debug:
            raise
        click.echo(f"Error: {e}", err=True)
        sys.exit(e.exit_code)
    except BrokenPipeError:  # `hybridpd plan ... | head`
        sys.exit(0)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
