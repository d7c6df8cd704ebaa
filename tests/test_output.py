"""The one renderer's plain tables: the piped default is laid out without tabulate, so it is checked here
against tabulate itself (the independent oracle) over generated tables, and the fallbacks are checked too."""

from __future__ import annotations

import string
from typing import Any

from hybridpd_cli._output import PIPE_FORMAT, plain_table
from hypothesis import given, settings
from hypothesis import strategies as st
from tabulate import tabulate

ASCII = st.text(alphabet=string.printable[:95], max_size=12)  # printable ASCII, spaces included
ODD = st.text(alphabet="ab \n\t\x1b[0m→é世", max_size=6)  # multi-line, tabs, escapes, wide and non-ASCII


def oracle(headers: list[str], rows: list[list[str]], fmt: str = PIPE_FORMAT) -> str:
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)


@st.composite
def tables(draw: st.DrawFn, cell: st.SearchStrategy[str]) -> tuple[list[str], list[list[str]]]:
    n = draw(st.integers(1, 5))
    headers = draw(st.lists(cell, min_size=n, max_size=n))
    rows = draw(st.lists(st.lists(cell, min_size=n, max_size=n), max_size=6))
    return headers, rows


@settings(max_examples=400, deadline=None)
@given(tables(ASCII))
def test_simple_matches_tabulate(t: tuple[list[str], list[list[str]]]) -> None:
    headers, rows = t
    assert plain_table(headers, rows, PIPE_FORMAT) == oracle(headers, rows)


@settings(max_examples=150, deadline=None)
@given(tables(ODD))
def test_anything_else_is_tabulates(t: tuple[list[str], list[list[str]]]) -> None:
    headers, rows = t
    assert plain_table(headers, rows, PIPE_FORMAT) == oracle(headers, rows)


def test_cases_by_hand() -> None:
    # header wider than every cell: header + 2; a cell wider than its header; cells stripped, headers kept
    got = plain_table(["id", "bytes"], [["  nano ", "2,146,304"], ["x", ""]], PIPE_FORMAT)
    assert got == ("id    bytes\n"
                   "----  ---------\n"
                   "nano  2,146,304\n"
                   "x")
    assert plain_table(["a"], [], PIPE_FORMAT) == "a\n---"


def test_other_formats_are_tabulates() -> None:
    headers, rows = ["k", "v"], [["a", "1"], ["bb", "22"]]
    assert plain_table(headers, rows, "markdown") == oracle(headers, rows, "pipe")
    for fmt in ("github", "grid", "plain"):
        assert plain_table(headers, rows, fmt) == oracle(headers, rows, fmt)


def test_rich_cells_are_text_not_markup(capsys: Any) -> None:
    # rich reads "[word ...]" as a markup tag: a cell, header or title holding one must still print as given
    from hybridpd_cli._output import Report, Table, emit_report

    emit_report(Report(tables=[Table(title="[b] title", headers=["[x] head"], rows=[["[x|B|C] kept"], ["[bold]b"]])]),
                "rich", width=60)
    out = capsys.readouterr().out
    for s in ("[b] title", "[x] head", "[x|B|C] kept", "[bold]b"):
        assert s in out, out
