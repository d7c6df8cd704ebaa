"""Reading everything a child process wrote to a pseudo-terminal (shared by the terminal-output tests)."""

from __future__ import annotations

import os


def read_pty(master: int) -> bytes:
    """All bytes from ``master`` until the child's side closes (EOF or EIO), then close ``master``."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return b"".join(chunks)
