"""Golden files: compare an output with tests/golden/<area>/<name>; HYBRIDPD_REGEN_GOLDEN=1 rewrites them.

Regenerate only after an intended change, and read the diff (`git diff tests/golden`) before committing it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = "HYBRIDPD_REGEN_GOLDEN"


def check_golden(area: str, name: str, got: str) -> None:
    """Assert ``got`` equals tests/golden/AREA/NAME (written first when HYBRIDPD_REGEN_GOLDEN=1)."""
    path = GOLDEN / area / name
    if os.environ.get(REGEN) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert path.exists(), f"{path} missing: run {REGEN}=1 pytest on this test"
    want = path.read_text()
    if got != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "got"))[:60])
        raise AssertionError(f"{area}/{name} differs; check the change, then {REGEN}=1 regenerates it\n{diff}")


def text_lines(out: str) -> str:
    """Terminal text as a golden stores it: trailing spaces dropped, one final newline."""
    return "\n".join(ln.rstrip() for ln in out.splitlines()) + "\n"


def mask_text(out: str, replacements: dict[str, str]) -> str:
    """Replace each literal key (longest first) by its placeholder, then any Python executable path."""
    for k in sorted(replacements, key=len, reverse=True):
        out = out.replace(k, replacements[k])
    return re.sub(r"(?<![\w<])/\S*/bin/python[\d.]*", "<python>", out)


def mask_json(obj: Any, keys: dict[str, str], replacements: dict[str, str] | None = None) -> Any:
    """Copy of a JSON value with every value under a key in ``keys`` replaced (whole) by its placeholder, and
    literal strings masked as in mask_text (dict keys too)."""
    reps = replacements or {}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            mk = mask_text(k, reps)
            if k in keys:
                out[mk] = keys[k]
            else:
                out[mk] = mask_json(v, keys, reps)
        return out
    if isinstance(obj, list):
        return [mask_json(v, keys, reps) for v in obj]
    if isinstance(obj, str):
        return mask_text(obj, reps)
    return obj


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"
