"""The library never imports the CLI, click or rich (ARCHITECTURE: hybridpd/ is usable without them)."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridpd

FORBIDDEN = ("click", "rich", "hybridpd_cli", "cli")


def test_library_does_not_import_cli_click_or_rich() -> None:
    root = Path(hybridpd.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in FORBIDDEN]
    assert not bad, bad
