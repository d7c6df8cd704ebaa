"""The one renderer. Commands hand over data; this module decides JSON, tabulate formats or rich tables.

stdout carries data only; hints, warnings and progress go to stderr.

Human output never splits a number or an identifier across lines: every column is at least as wide
as its widest unbreakable token (a numeric cell such as ``2,146,304`` or ``24576+1536`` counts as one
token), text wraps only at spaces, and a table whose columns cannot all fit the terminal is printed as
key/value blocks instead. Rich boxes and colour are the default only when stdout is a terminal;
piped or redirected output is plain text (tabulate's ``simple`` format, no box characters).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("rich", "json", "markdown", "github", "plain", "simple", "grid")
PIPE_FORMAT = "simple"  # the default when stdout is not a terminal


@dataclass
class Table:
    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str | None = None
    heading_columns: int = 1  # leading cells that head each block in the key/value (narrow) layout


@dataclass(frozen=True)
class Verdict:
    """The first line of a report: 'ok', 'warning' or 'error', and what to do."""

    level: str
    text: str


@dataclass
class Report:
    """A command's human output: a verdict, lines under it, ordered tables, then free text lines."""

    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    preface: list[str] = field(default_factory=list)  # shown right under the verdict (assumptions)


def output_options(func: F) -> F:
    """Stack --json and --fmt on a reporting command."""
    func = click.option("--fmt", "fmt", type=click.Choice(FORMATS), default=None,
                        help="Output format: rich tables (default on a terminal), plain text tables "
                             f"(default when piped or redirected: tabulate '{PIPE_FORMAT}'), json, or a "
                             "tabulate format.")(func)
    func = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON with stable keys.")(func)
    return func


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def resolve_format(as_json: bool, fmt: str | None) -> str:
    if as_json:
        return "json"
    if fmt:
        return fmt
    return "rich" if stdout_is_tty() else PIPE_FORMAT


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


# --- width planning --------------------------------------------------------------------------------

_UNIT_TOKENS = {"B", "KiB", "MiB", "GiB", "TiB", "µs", "ms", "s", "%", "+", "/", "-", "x", "->", "→", "×",
                "blocks", "tokens"}
_NUMERIC = re.compile(r"[-+~]?[\d.,+/x%\-]*\d[\d.,+/x%\-]*")


def _numeric_token(tok: str) -> bool:
    return bool(_NUMERIC.fullmatch(tok.strip("()[];:")))


def atomic(text: str) -> bool:
    """A cell that must stay on one line: numbers with their units, spans, ratios (e.g. '12,288 B (0.58%)')."""
    toks = text.split()
    return (bool(toks) and len(text) <= 32 and any(_numeric_token(t) for t in toks)
            and all(_numeric_token(t) or t.strip("()") in _UNIT_TOKENS for t in toks))


def _width(text: str) -> int:
    if text.isascii() and text.isprintable():  # one cell per character (rich agrees); most cells, no lookups
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def min_width(text: str) -> int:
    """The narrowest a cell can be without breaking a number or a word (ids included)."""
    if atomic(text):
        return _width(text)
    return max((_width(t) for t in text.split()), default=0)


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[str]], total: int) -> list[int] | None:
    """Content widths for a rich table of ``total`` columns, or None when it cannot fit unbroken.

    Overhead per column: one space of padding each side plus one border; plus the left edge.
    """
    n = len(headers)
    cols = [[headers[i], *(r[i] for r in rows)] for i in range(n)]
    lo = [max(min_width(c) for c in col) for col in cols]
    hi = [max(max(_width(line) for line in c.splitlines() or [""]) for c in col) for col in cols]
    hi = [max(a, b) for a, b in zip(lo, hi, strict=True)]
    room = total - (3 * n + 1)
    if sum(hi) <= room:
        return hi
    if sum(lo) > room:
        return None
    extra, slack = room - sum(lo), sum(h - lo_ for h, lo_ in zip(hi, lo, strict=True))
    widths = [lo_ + (extra * (h - lo_)) // slack for h, lo_ in zip(hi, lo, strict=True)]
    return widths


_PLAIN_NUMBER = re.compile(r"-|[-+]?[\d,]+(\.\d+)?( (B|KiB|MiB|GiB|TiB|µs|ms|s))?")


def transpose(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[list[str], list[list[str]]]:
    """Rows become columns: the first column's values head the new columns, each other header a row."""
    first = headers[0]
    new_headers = [first, *(r[0] for r in rows)]
    return new_headers, [[h, *(r[i] for r in rows)] for i, h in enumerate(headers) if i]


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    if atomic(text):
        return [first + text]
    out = textwrap.wrap(text, width=max(width, 1), initial_indent=first, subsequent_indent=rest,
                        break_long_words=False, break_on_hyphens=False)
    return out or [first.rstrip()]


def key_value_lines(t: Table, width: int) -> list[str]:
    """A table as blocks, one per row: the heading cells, then 'header: value' lines (nothing broken)."""
    lines: list[str] = []
    k = max(1, min(t.heading_columns, len(t.headers) - 1))
    for row in t.rows:
        cells = [_cell(c) for c in row]
        head = " ".join(c for c in cells[:k] if c)
        if len(t.headers) == 2 and k == 1:  # a field/value table stays one line per field
            lines.extend(_wrap(cells[1], width, f"  {head}: ", "      "))
            continue
        lines.append(f"  {head}")
        for h, c in zip(t.headers[k:], cells[k:], strict=True):
            if not c.strip():
                continue
            lines.extend(_wrap(c, width, f"    {h}: " if h else "    ", "        "))
    return lines


# --- rendering -------------------------------------------------------------------------------------

_VERDICT_STYLE = {"ok": "bold green", "warning": "bold yellow", "error": "bold red"}


def emit_report(report: Report, fmt: str, width: int | None = None) -> None:
    if fmt == "rich":
        _emit_rich(report, width)
        return
    parts = []
    if report.verdict is not None:
        parts.append("\n".join([report.verdict.text, *report.preface]))
    for t in report.tables:
        head = f"### {t.title}" if fmt in ("markdown", "github") else t.title
        body = plain_table(list(t.headers), [[_cell(c) for c in r] for r in t.rows], fmt)
        parts.append(f"{head}\n\n{body}" + (f"\n\n{t.caption}" if t.caption else ""))
    parts.extend(report.notes)
    click.echo("\n\n".join(parts))


_PRINTABLE_ASCII = re.compile(r"[ -~]*")


def plain_table(headers: list[str], rows: list[list[str]], fmt: str) -> str:
    """A tabulate table (``disable_numparse``: every cell a left-aligned string) in format ``fmt``.

    The piped default, ``simple``, is laid out here when every header and cell is printable ASCII on one line
    and the rows are as wide as the headers: the same bytes tabulate writes (tests/test_output.py checks them
    against tabulate), without importing it, which costs ~25 ms of a cold `plan` (tabulate reads its own
    version through importlib.metadata).  Anything else goes to tabulate."""
    if fmt == PIPE_FORMAT and all(_PRINTABLE_ASCII.fullmatch(s) for s in headers) and all(
            len(r) == len(headers) and all(_PRINTABLE_ASCII.fullmatch(c) for c in r) for r in rows):
        cells = [[c.strip() for c in r] for r in rows]
        widths = [max([len(h) + 2, *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
        return "\n".join(lines)
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt={"markdown": "pipe"}.get(fmt, fmt), disable_numparse=True)


def _emit_rich(report: Report, width: int | None) -> None:
    from rich.console import Console

    console = Console(soft_wrap=False, highlight=False, width=width)
    with console:  # buffered: the whole report is written once, at the end
        _rich_report(console, report)


def _rich_report(console: Any, report: Report) -> None:
    from rich.table import Table as RTable
    from rich.text import Text

    total = console.width
    if report.verdict is not None:
        v = report.verdict
        for line in _wrap(v.text, total, "", "  "):
            console.print(Text(line, style=_VERDICT_STYLE.get(v.level, "bold")), no_wrap=True, crop=False)
        for line in report.preface:
            for wrapped in _wrap(line, total, "", "  "):
                console.print(Text(wrapped, style="yellow"), no_wrap=True, crop=False)
    for t in report.tables:
        cells = [[_cell(c) for c in r] for r in t.rows]
        headers: Sequence[str] = t.headers
        widths = column_widths(headers, cells, total)
        if widths is None and t.heading_columns == 1 and 1 < len(cells) <= 8:
            headers, cells = transpose(t.headers, cells)  # fields as rows, one column per row of the table
            widths = column_widths(headers, cells, total)
        console.print()
        if widths is None:
            console.print(Text(t.title, style="bold"))
            for line in key_value_lines(t, total):
                console.print(Text(line), overflow="ignore", crop=False, no_wrap=True)
            if t.caption:
                for line in _wrap(t.caption, total, "", ""):
                    console.print(Text(line, style="dim"), overflow="ignore", crop=False, no_wrap=True)
            continue
        # Text, never str: rich would read "[word ...]" in a cell as markup and drop it (and parsing costs time)
        rt = RTable(title=Text(t.title), title_justify="left", title_style="bold", show_lines=False, expand=False)
        for h, w, col in zip(headers, widths, zip(*cells, strict=True) if cells else [()] * len(widths),
                             strict=True):
            numeric = bool(col) and all(_PLAIN_NUMBER.fullmatch(c) for c in col)
            rt.add_column(Text(h), width=w, overflow="fold", no_wrap=False, justify="right" if numeric else "left")
        for row in cells:
            rt.add_row(*(Text(c) for c in row))
        console.print(rt)
        if t.caption:
            for line in _wrap(t.caption, total, "", ""):
                console.print(Text(line, style="dim"), overflow="ignore", crop=False, no_wrap=True)
    for n in report.notes:
        console.print()
        for line in _wrap(n, total, "", ""):
            console.print(Text(line), overflow="ignore", crop=False, no_wrap=True)


_GLUE = re.compile(r"\bHTTP \d{3}\b|\b\d[\d,.]* (?:B|KiB|MiB|GiB|TiB|µs|ms|s|tokens)\b")


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def stderr_width() -> int | None:
    """The width to wrap stderr messages to: the terminal's (``COLUMNS`` first, as shutil reads it) when stderr
    is a terminal; None otherwise (piped to a log: one line per message, for grep)."""
    import os
    import shutil

    if not stderr_is_terminal():
        return None
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:  # stderr's own terminal (stdout may be piped: `hybridpd plan ... | less`)
        return os.get_terminal_size(sys.stderr.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return shutil.get_terminal_size(fallback=(80, 24)).columns


def wrap_message(text: str, width: int | None = None, indent: str = "  ") -> str:
    """Wrap ``text`` at spaces only (a number with its unit and ``HTTP 500`` kept together, ids and URLs whole,
    never at hyphens), each continuation line indented; every input line is wrapped on its own."""
    width = stderr_width() if width is None else width
    if width is None:
        return text
    out: list[str] = []
    for line in text.splitlines() or [""]:
        lead = line[:len(line) - len(line.lstrip())]
        glued = _GLUE.sub(lambda m: m.group(0).replace(" ", "\xa0"), line)  # textwrap never breaks at U+00A0
        out.extend(w.replace("\xa0", " ") for w in textwrap.wrap(
            glued, width=max(width, 20), subsequent_indent=lead + indent, break_long_words=False,
            break_on_hyphens=False) or [line])
    return "\n".join(out)


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
