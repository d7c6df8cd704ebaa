"""The one error table: library exceptions -> one line on stderr + exit code. Unknown errors are bugs."""

from __future__ import annotations

import sys
from typing import Any

import click

from hybridpd.errors import HybridPDError

from ._output import wrap_message

# optional dependencies -> how to install them (pyproject extras)
_EXTRAS = {
    "torch": "pip install 'hybridpd[convert]'", "safetensors": "pip install 'hybridpd[convert]'",
    "xxhash": "pip install 'hybridpd[convert]', or pass --checksum crc32",
    "numpy": "pip install 'hybridpd[rehearse]'",
    "nixl": "pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1", "nixl_cu13": "pip install --no-deps nixl-cu13==1.5.1",
    "matplotlib": "pip install 'hybridpd[plot]'", "yaml": "pip install pyyaml",
}


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
        click.echo(wrap_message(f"Error: {e}"), err=True)
        sys.exit(e.exit_code)
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        if extra is None or debug:
            raise
        click.echo(wrap_message(f"Error: this command needs {e.name}, which is not installed (fix: {extra})"),
                   err=True)
        sys.exit(1)
    except BrokenPipeError:  # `hybridpd plan ... | head`
        sys.exit(0)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
