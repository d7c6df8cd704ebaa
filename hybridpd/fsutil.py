"""Bounded input reads and atomic output writes.

``read_bounded`` / ``parse_json_bytes`` read an input the user named: a regular file only (a FIFO or device is
refused before it could block or stream for ever), at most a size limit, strict UTF-8 JSON of bounded depth.

Outputs are written atomically, and only as regular files the user named:

``atomic_target(path)`` yields a temporary file beside the real target; on success it is fsynced, given
the mode a new file gets from the umask (or the mode of the file it replaces), and renamed over the target
(and the directory fsynced).
Nothing else is ever replaced: a directory, device, FIFO or socket at PATH is refused; a symlink at PATH is
followed only to an existing regular file (that file is rewritten, the link stays); a missing parent
directory is created only when ``parents=True``.  On any error the temporary file is removed and the error
says that nothing was written.

The pieces (``create_temp``, ``commit_temp``, ``discard_temp``, one naming scheme that ``parse_temp_name``
reads back) also carry ``convert``'s streaming writer, which adds O_DIRECT, sweeps of dead processes'
temporaries and a commit that never clobbers (``clobber=False``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridpd.errors import ConfigError, OutputError, UsageError


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few kB; id2label-heavy ones stay far below this
MAX_JSON_DEPTH = 64  # real configs nest 3-4 levels


def read_bounded(path: str | Path, *, field: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; FIFOs, devices and directories are refused unopened.

    The file is opened with O_NONBLOCK (a FIFO swapped in after the check cannot block) and checked again with
    fstat on the open descriptor, and never more than ``limit + 1`` bytes are read.
    """
    where = str(path)
    fix = "point it at a regular JSON file"
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot read {where}: {reason}", field=field, fix=fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where} is {_kind(st.st_mode)}, not a regular file", field=field, fix=fix)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}", field=field, fix=fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is {_kind(st.st_mode)}, not a regular file", field=field, fix=fix)
        if st.st_size > limit:
            raise ConfigError(f"{where} is {st.st_size:,} bytes, more than the {limit:,}-byte limit", field=field,
                              fix="point it at the model's config.json")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}", field=field, fix=fix) from None
    finally:
        os.close(fd)
    if got > limit:
        raise ConfigError(f"{where} is more than the {limit:,}-byte limit", field=field,
                          fix="point it at the model's config.json")
    return b"".join(chunks)


class NotANumber(str):
    """A number JSON cannot carry (NaN, Infinity, 1e999, an integer over 4,300 digits), kept as text under its key.

    Python's json (and so transformers) accepts such values; a reader that needs a number refuses it and names
    its key, and a key nobody reads stays harmless. It serialises as a plain string, never as NaN/Infinity.
    """

    def __repr__(self) -> str:
        return str(self)


def _constant(name: str) -> NotANumber:
    return NotANumber(name)


def _float(text: str) -> float | NotANumber:
    v = float(text)
    return v if math.isfinite(v) else NotANumber(text[:20] + ("..." if len(text) > 20 else ""))


def _int(text: str) -> int | NotANumber:
    if len(text.lstrip("-")) > 30:  # beyond any config value, and below Python's 4,300-digit limit
        return NotANumber(f"{text[:6]}...({len(text.lstrip('-'))} digits)")
    return int(text)


def _deepest_key(data: Any, limit: int) -> str | None:
    """The top-level key whose value nests beyond ``limit`` levels ('' for the document itself), else None."""
    items = list(data.items()) if isinstance(data, dict) else [("", data)]
    for key, val in items:
        stack: list[tuple[Any, int]] = [(val, 2 if isinstance(data, dict) else 1)]
        while stack:
            node, depth = stack.pop()
            if depth > limit:
                return str(key)
            if isinstance(node, dict):
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return None


def _deep_key_in_text(text: str, limit: int) -> str | None:
    """After a RecursionError: the top-level key being read when nesting passed ``limit`` (a bounded scan)."""
    depth, in_str, esc, start, last = 0, False, False, 0, None
    for i, ch in enumerate(text[: 4 << 20]):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 1:
                    last = text[start:i]
        elif ch == '"':
            in_str, start = True, i + 1
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return last
        elif ch in "]}":
            depth -= 1
    return None


def _too_deep(where: str, key: str | None, field: str, fix: str) -> ConfigError:
    what = f"{key[:60]} nests" if key else "nests"
    return ConfigError(f"{where}: {what} deeper than {MAX_JSON_DEPTH} levels", field=field, fix=fix)


def parse_json_bytes(raw: bytes, *, where: str, field: str, fix: str = "repair the file") -> Any:
    """JSON from bytes: UTF-8, at most MAX_JSON_DEPTH levels; NaN, Infinity, 1e999 and integers of more than 30
    digits come back as ``NotANumber`` text under their key, so that the reader of that key names it."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (bad byte at offset {e.start})", field=field, fix=fix) from None
    try:
        data = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON (line {e.lineno}: {e.msg})", field=field, fix=fix) from None
    except RecursionError:
        raise _too_deep(where, _deep_key_in_text(text, MAX_JSON_DEPTH), field, fix) from None
    deep = _deepest_key(data, MAX_JSON_DEPTH)
    if deep is not None:
        raise _too_deep(where, deep, field, fix)
    return data


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


# --------------------------------------------------------------------------- temporary files, one scheme

# ``.hybridpd-<target name>.<pid>.<8 hex><suffix>`` beside the target: hidden, named after what it will become,
# and carrying the writer's pid, so that a later writer can tell a dead process's leftover (``parse_temp_name``).
TEMP_PREFIX = ".hybridpd-"
_TEMP_RE = re.compile(r"^\.hybridpd-(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.[^.]+$")
_NAME_BYTES = 160  # of the target's name kept in the temporary's: NAME_MAX is 255 bytes


def temp_stem(name: str) -> str:
    """The part of a target's file name that its temporaries carry (at most ``_NAME_BYTES`` bytes of it)."""
    return os.fsdecode(os.fsencode(name)[:_NAME_BYTES])


def parse_temp_name(name: str) -> tuple[str, int] | None:
    """(target stem, writer pid) of a temporary's file name, or None when it is not one of ours."""
    m = _TEMP_RE.match(name)
    return (m["name"], int(m["pid"])) if m else None


def create_temp(target: str | Path, *, suffix: str = ".tmp") -> tuple[int, str]:
    """Create (O_EXCL, mode 0600 until ``commit_temp``) a new temporary file beside ``target``: (fd, path)."""
    parent, name = os.path.split(os.fspath(target))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for attempt in range(8):
        tmp = os.path.join(parent, f"{TEMP_PREFIX}{temp_stem(name)}.{os.getpid()}.{os.urandom(4).hex()}{suffix}")
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:
            if attempt == 7:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def fsync_dir(directory: str | Path) -> None:
    """Make a rename in ``directory`` durable; filesystems that cannot fsync a directory are left as they are."""
    with contextlib.suppress(OSError):
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def commit_temp(tmp: str | Path, target: str | Path, *, mode: int | None = None, clobber: bool = True) -> None:
    """Move a complete temporary over ``target``: fsync it, give it ``mode`` (None: what a new file gets from
    the umask), rename it, fsync the directory.  ``clobber=False`` never replaces anything: FileExistsError
    when ``target`` exists (a hard link, so a file that appears meanwhile is not clobbered either)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
    if clobber:
        os.replace(tmp, target)
    else:
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise
        except OSError:  # filesystems without hard links
            if os.path.lexists(target):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(target)) from None
            os.replace(tmp, target)
        else:
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(target)))


def discard_temp(tmp: str | Path) -> None:
    """Remove a temporary (gone already is fine)."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def nothing_written(path: str, e: OSError, *, field: str) -> OutputError:
    """The error for an output that failed to write: the target is untouched."""
    return OutputError(f"cannot write {path}: {e.strerror or e}; nothing was written", field=field)


@contextmanager
def atomic_target(path: str, *, suffix: str = ".tmp", field: str = "output", parents: bool = False) -> Iterator[str]:
    """Yield a temporary path beside ``path``'s real target; on success it replaces the target, on error it is removed."""
    target, mode = output_target(path, field=field, parents=parents)
    try:
        fd, tmp = create_temp(target, suffix=suffix)
    except OSError as e:
        raise nothing_written(path, e, field=field) from None
    os.close(fd)
    try:
        yield tmp
        commit_temp(tmp, target, mode=mode)
    except BaseException as e:
        discard_temp(tmp)
        if isinstance(e, OSError):  # disk full, read-only file system, permissions: the target is untouched
            raise nothing_written(path, e, field=field) from None
        raise


def write_atomic(path: str, text: str, *, field: str = "output", parents: bool = False) -> None:
    with atomic_target(path, field=field, parents=parents) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
