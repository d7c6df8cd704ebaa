"""Output files: written atomically, and only as regular files the user named.

``atomic_target(path)`` yields a temporary file beside the real target; on success it is fsynced, given
the mode a new file gets from the umask (or the mode of the file it replaces), and renamed over the target.
Nothing else is ever replaced: a directory, device, FIFO or socket at PATH is refused; a symlink at PATH is
followed only to an existing regular file (that file is rewritten, the link stays); a missing parent
directory is created only when ``parents=True``.  On any error the temporary file is removed and the error
says that nothing was written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import OutputError, UsageError


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def output_target(path: str, *, field: str = "output", parents: bool = False) -> tuple[str, int | None]:
    """(the real file to replace, its current permission bits or None when new) for an output PATH."""
    if not path or "\x00" in path:
        raise UsageError("the output path is empty or contains a NUL byte", field=field, fix="name a file")
    target = os.path.abspath(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"cannot use {path}: {e.strerror}", field=field, fix="name a writable file") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(target)
        try:
            st = os.stat(real)
        except OSError:
            raise UsageError(f"{path} is a symlink to {real}, which does not exist", field=field,
                             fix="name the file itself, or remove the dangling link") from None
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is a symlink to {_kind(st.st_mode)} ({real}); refusing to write through it",
                             field=field, fix="name a regular file")
        target = real
    elif st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is {_kind(st.st_mode)}; refusing to replace it", field=field,
                         fix="name a regular file (a new one, or one to overwrite)")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise UsageError(f"{os.path.dirname(path) or parent} is not a directory", field=field,
                             fix="name a file inside a directory")
        if not parents:
            raise UsageError(f"directory {os.path.dirname(path) or parent} does not exist", field=field,
                             fix="create it first")
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create directory {parent}: {e.strerror}; nothing was written",
                              field=field) from None
    return target, (stat.S_IMODE(st.st_mode) if st is not None else None)


@contextmanager
def atomic_target(path: str, *, suffix: str = ".tmp", field: str = "output", parents: bool = False) -> Iterator[str]:
    """Yield a temporary path beside ``path``'s real target; on success it replaces the target, on error it is removed."""
    target, mode = output_target(path, field=field, parents=parents)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".hybridpd-", suffix=suffix, dir=os.path.dirname(target))
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror}; nothing was written", field=field) from None
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # disk full, read-only file system, permissions: the target is untouched
            raise OutputError(f"cannot write {path}: {e.strerror or e}; nothing was written", field=field) from None
        raise


def write_atomic(path: str, text: str, *, field: str = "output", parents: bool = False) -> None:
    with atomic_target(path, field=field, parents=parents) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
