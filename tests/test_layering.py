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


def _imports(root: Path) -> dict[str, set[str]]:
    """Module -> the hybridpd modules it imports (module level and inside functions)."""
    mods: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = ("hybridpd", *path.relative_to(root).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                head = ".".join([*base, node.module] if node.module else base)
                targets = [head, *(f"{head}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def test_library_import_graph_has_no_cycle() -> None:
    graph = _imports(Path(hybridpd.__file__).parent)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n):], n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
