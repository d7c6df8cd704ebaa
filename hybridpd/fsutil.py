"""Atomic file writes: a temporary file in the target directory, fsynced, then renamed over the target."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_target(path: str, *, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on any error it is removed."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix=".hybridpd-", suffix=suffix, dir=d)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_atomic(path: str, text: str) -> None:
    with atomic_target(path) as tmp, open(tmp, "w") as f:
        f.write(text)
