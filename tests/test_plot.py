"""--plot (#16 item 9): the format follows the extension, unknown extensions are refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from hybridpd.core.plan import build_plan  # noqa: E402
from hybridpd.core.plotting import plot_transfer  # noqa: E402
from hybridpd.core.settings import EngineSettings as E  # noqa: E402
from hybridpd.errors import UsageError  # noqa: E402


@pytest.fixture(scope="module")
def nano_plan():  # type: ignore[no-untyped-def]
    return build_plan("nano", prefill=E(tp=1), decode=E(tp=2), isls=(1024, 8192))


@pytest.mark.parametrize("ext,magic", [("png", b"\x89PNG\r\n\x1a\n"), ("svg", b"<?xml"), ("pdf", b"%PDF-")])
def test_format_follows_extension(tmp_path: Path, nano_plan, ext: str, magic: bytes) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / f"x.{ext}"
    plot_transfer(nano_plan, str(p))
    assert p.read_bytes().startswith(magic)  # the old code wrote PNG bytes into x.svg


def test_unknown_extension_refused(tmp_path: Path, nano_plan) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match=r"\.png, \.svg or \.pdf"):
        plot_transfer(nano_plan, str(tmp_path / "x.jpg"))
    assert not list(tmp_path.iterdir())
