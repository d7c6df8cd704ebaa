"""The one renderer. Commands hand over data; this module decides JSON, tabulate formats or rich tables.

stdout carries data only; hints, warnings and progress go to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("rich", "json", "markdown", "github", "plain", "simple", "grid")


@dataclass
class Table:
    title: str
    headers: Sequence[str]
    rows: list[Sequence[Any]]
    caption: str | None = None


@dataclass
class Report:
    """A command's human output: ordered tables plus free text lines."""

    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def output_options(func: F) -> F:
    """Stack --json and --fmt on a reporting command."""
    func = click.option("--fmt", "fmt", type=click.Choice(FORMATS), default=None,
                        help="Output format: rich tables (default on a terminal), json, or a tabulate format.")(func)
    func = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON with stable keys.")(func)
    return func


def resolve_format(as_json: bool, fmt: str | None) -> str:
    if as_json:
        return "json"
    return fmt or "rich"


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}"
    if v is None:
        return "-"
    return str(v)


def emit_report(report: Report, fmt: str) -> None:
    if fmt == "rich":
        from rich.console import Console
        from rich.table import Table as RTable

        console = Console(soft_wrap=False)
        for t in report.tables:
            rt = RTable(title=t.title, caption=t.caption, title_justify="left", show_lines=False)
            for h in t.headers:
                rt.add_column(h, overflow="fold")
            for row in t.rows:
                rt.add_row(*(_cell(c) for c in row))
            console.print(rt)
        for n in report.notes:
            console.print(n, markup=False, highlight=False)
        return
    from tabulate import tabulate

    tf = {"markdown": "pipe"}.get(fmt, fmt)
    parts = []
    for t in report.tables:
        head = f"### {t.title}" if fmt in ("markdown", "github") else t.title
        body = tabulate([[_cell(c) for c in r] for r in t.rows], headers=list(t.headers), tablefmt=tf)
        parts.append(f"{head}\n\n{body}" + (f"\n\n{t.caption}" if t.caption else ""))
    parts.extend(report.notes)
    click.echo("\n\n".join(parts))


def hint(message: str) -> None:
    click.echo(message, err=True)


def fmt_bytes(n: int | float) -> str:
    """Human size for tables (JSON always carries raw integers)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:,.0f} {unit}" if unit == "B" else f"{x:,.2f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


class HealthProgressDisplay:
    """Rich spinner per child while `serve --role all` waits for /health (stderr)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._p = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                           console=Console(stderr=True), transient=False)
        self._tasks: dict[str, Any] = {}
        self._p.start()

    def waiting(self, name: str, url: str) -> None:
        self._tasks[name] = self._p.add_task(f"{name} waiting for {url}", total=1)

    def healthy(self, name: str, seconds: float) -> None:
        self._p.update(self._tasks[name], completed=1, description=f"{name} healthy ({seconds:.1f} s)")

    def close(self) -> None:
        self._p.stop()
