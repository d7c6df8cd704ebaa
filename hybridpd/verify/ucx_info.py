"""Which UCX transport carried a NIXL transfer, read from UCX's own protocol-selection report.

With ``UCX_PROTO_INFO=y`` UCX (1.15+, the one inside the nixl wheel) logs, once per endpoint
configuration and operation, a table such as::

    | decode intra-node cfg#1                                          |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-------------------------------------------+
    | Range  | Description |                  Config                   |
    +--------+-------------+-------------------------------------------+
    | 0..inf | zero-copy   | cma/memory                                |

The rehearsal sends each rank's UCX log to a file (``UCX_LOG_FILE``) and reads back the tables whose
operation is a *remote memory read* (what a NIXL READ becomes): their ``Config`` column names the
transport/device, e.g. ``cma/memory`` (DRAM, cross-memory attach), ``tcp/lo`` (through the loopback
socket), ``cuda_ipc/cuda`` (GPU to GPU, peer mapping) or ``cuda_copy/cuda`` (staged copies).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")
_RANGE = re.compile(r"^(\d+(\.\.(\d+|inf))?)$")
_WARN = re.compile(r"\b(WARN|ERROR)\b|disabled")


@dataclass(frozen=True)
class ProtoRow:
    range: str
    description: str
    config: str


@dataclass(frozen=True)
class ProtoTable:
    endpoint: str  # e.g. "decode intra-node cfg#1"
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into cuda memory from cuda"
    rows: tuple[ProtoRow, ...]

    @property
    def is_read(self) -> bool:
        return self.operation.startswith("remote memory read")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> list[ProtoTable]:
    """Every protocol table in a UCX log (lines may carry UCX's ``[time] [host:pid:tid]`` prefix)."""
    tables: list[ProtoTable] = []
    title: list[str] = []
    rows: list[ProtoRow] = []
    in_rows = False

    def close() -> None:
        nonlocal rows, in_rows
        if len(title) >= 2 and rows:
            tables.append(ProtoTable(endpoint=title[0], operation=title[1], rows=tuple(rows)))
        rows, in_rows = [], False

    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line.startswith(("|", "+")):
            continue
        if line.startswith("+"):
            continue
        cells = _cells(line)
        if len(cells) == 1:
            if in_rows or len(title) >= 2:
                close()
                title = []
            title.append(cells[0])
        elif len(cells) >= 3 and cells[0] == "Range":
            in_rows = True
        elif len(cells) >= 3 and in_rows and _RANGE.match(cells[0]):
            rows.append(ProtoRow(range=cells[0], description=cells[1], config=cells[2]))
    close()
    return tables


def read_transports(text: str) -> list[str]:
    """Distinct transports UCX selected for remote memory reads, in first-seen order."""
    seen: list[str] = []
    for t in parse(text):
        if t.is_read:
            for r in t.rows:
                if r.config and r.config not in seen:
                    seen.append(r.config)
    return seen


def read_operations(text: str) -> list[str]:
    """The read operations' titles (they name the memory types: 'into cuda memory from cuda')."""
    return list(dict.fromkeys(t.operation for t in parse(text) if t.is_read))


def warnings(text: str, limit: int = 5) -> list[str]:
    """UCX warning lines worth showing (e.g. 'cuda-ipc get zcopy disabled as no nvlinks detected')."""
    out: list[str] = []
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if line and not line.startswith(("|", "+")) and _WARN.search(line) and line not in out:
            out.append(line)
            if len(out) >= limit:
                break
    return out
