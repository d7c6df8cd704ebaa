"""Streaming safetensors I/O for ``convert``: header parsing, windowed mmap reads, atomic writes.

The safetensors format is small enough to speak directly: an 8-byte little-endian header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
padded with spaces, then the raw tensor bytes, contiguous, in offset order.  Speaking it ourselves
lets ``convert`` read through bounded mmap windows and write tensor by tensor, so a file larger than
RAM converts with a few chunk-sized buffers.

Outputs go to a hidden temporary file in the target directory and are renamed into place only when
complete (``os.link`` when not forcing, so an existing file is never clobbered by a race); a process
killed mid-write leaves the final name untouched.  Stale temporaries of dead processes are removed
by the next write to the same name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .errors import HybridPDError, UsageError

# safetensors dtype -> bytes per element (sub-byte and unknown dtypes are copied as raw bytes only).
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
# dtypes a Mamba state can have (what vLLM allocates: bf16, fp16, fp32, the fp8 variants; fp64 for tests)
STATE_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
SLOW_WRITE_ENV = "HYBRIDPD_TEST_SLOW_WRITE"  # test hook: seconds to sleep after each tensor written
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.hybridpd-tmp$")


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def elem(self) -> int | None:
        return DTYPE_BYTES.get(self.dtype)


@dataclass(frozen=True, kw_only=True)
class Header:
    path: Path
    data_start: int  # 8 + header length
    tensors: tuple[TensorEntry, ...]  # in offset order
    metadata: Mapping[str, str]
    file_size: int

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


def _corrupt(path: Path, what: str) -> HybridPDError:
    return UsageError(f"{path} is not a valid safetensors file: {what}", field="INPUT",
                      fix="pass a .safetensors file written by safetensors, vLLM tooling or hybridpd")


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header (offsets contiguous, sizes consistent with shapes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"only {size} bytes long")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _corrupt(path, f"header length {n} exceeds the file ({size} bytes)")
            raw = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}", field="INPUT") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"header is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _corrupt(path, "header is not a JSON object")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    entries = []
    for name, info in raw.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(s, int) and s >= 0 for s in shape) and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _corrupt(path, f"bad entry for tensor {name!r}")
        t = TensorEntry(name=name, dtype=dtype, shape=shape, begin=begin, end=end)
        numel = 1
        for s in shape:
            numel *= s
        if t.elem is not None and numel * t.elem != t.nbytes:
            raise _corrupt(path, f"tensor {name!r}: shape {list(shape)} x {dtype} needs {numel * t.elem} bytes, "
                                 f"data_offsets give {t.nbytes}")
        entries.append(t)
    entries.sort(key=lambda t: (t.begin, t.end))
    pos = 0
    for t in entries:
        if t.begin != pos:
            raise _corrupt(path, f"tensor {t.name!r} starts at {t.begin}, expected {pos} (gap or overlap)")
        pos = t.end
    if 8 + n + pos != size:
        raise _corrupt(path, f"data section holds {size - 8 - n} bytes, tensors cover {pos} (truncated?)")
    return Header(path=path, data_start=8 + n, tensors=tuple(entries), metadata=dict(meta), file_size=size)


class Source:
    """An open input file; ``window`` maps a byte range of one tensor, read-only (copy-on-write)."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self._fd = os.open(header.path, os.O_RDONLY)
        self.hasher: hashlib._Hash | None = None
        self.bytes_read = 0

    def close(self) -> None:
        os.close(self._fd)

    def map(self, entry: TensorEntry, offset: int, length: int) -> Window:
        """Map bytes [offset, offset+length) of ``entry`` (private, read-only use); close when done."""
        self.bytes_read += length
        return Window(self._fd, self.header.data_start + entry.begin + offset, length)

    @contextlib.contextmanager
    def window(self, entry: TensorEntry, offset: int, length: int) -> Iterator[memoryview]:
        """Bytes [offset, offset+length) of ``entry``; the view is only valid inside the block."""
        w = self.map(entry, offset, length)
        try:
            yield w.view
        finally:
            w.close()

    def digest(self, view: memoryview) -> None:
        """Feed the source checksum; views must arrive in file order."""
        if self.hasher is not None:
            self.hasher.update(view)


class Window:
    """One mmap window (copy-on-write, so nothing can reach the file) and a view of the asked range."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        if length == 0:
            self._mm: mmap.mmap | None = None
            self.view = memoryview(b"")
            return
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        self._mm = mmap.mmap(fd, length + start - aligned, offset=aligned, access=mmap.ACCESS_COPY)
        with contextlib.suppress(AttributeError, OSError):
            self._mm.madvise(mmap.MADV_SEQUENTIAL)
        self.view = memoryview(self._mm)[start - aligned:]

    def close(self) -> None:
        try:
            self.view.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # an exception's traceback still holds an array on it; GC unmaps it
            pass


def build_header(entries: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str]) -> bytes:
    """Header bytes (length prefix included) for tensors laid out contiguously in the given order."""
    body: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        body[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data section starts 8-byte aligned, like safetensors
    return struct.pack("<Q", len(text)) + text


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove temporaries for ``final`` left by killed processes; returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for p in final.parent.iterdir():
            m = _TMP_RE.match(p.name)
            if m and m["name"] == final.name and int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"])):
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


class AtomicFile:
    """Write ``final`` through a temporary file in the same directory; ``commit`` makes it appear whole."""

    def __init__(self, final: Path, *, force: bool) -> None:
        self.final = final
        self.force = force
        sweep_stale_temporaries(final)
        self.tmp = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.hybridpd-tmp"
        try:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            raise UsageError(f"cannot create a file in {final.parent}: {e.strerror}", field="OUTPUT",
                             fix="choose a writable OUTPUT directory") from None
        self.file: IO[bytes] = os.fdopen(fd, "wb", buffering=0)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.force:
            os.replace(self.tmp, self.final)
        else:
            try:
                os.link(self.tmp, self.final)  # fails if final appeared meanwhile: never clobber
            except FileExistsError:
                self.abort()
                raise UsageError(f"{self.final} appeared while converting", field="OUTPUT",
                                 fix="pass --force to overwrite") from None
            except OSError:  # filesystems without hard links
                if self.final.exists():
                    self.abort()
                    raise UsageError(f"{self.final} exists", field="OUTPUT", fix="pass --force") from None
                os.replace(self.tmp, self.final)
            else:
                os.unlink(self.tmp)
        with contextlib.suppress(OSError):
            dfd = os.open(self.final.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


class Writer:
    """Streams one safetensors file: header first, then each tensor's bytes in header order.

    ``patchable`` metadata keys hold fixed-length placeholders that ``finish`` overwrites in place
    (the source checksum is only known once every input byte has been read).
    """

    def __init__(self, out: AtomicFile, entries: Sequence[tuple[str, str, Sequence[int], int]],
                 metadata: Mapping[str, str], *, checksum: bool) -> None:
        self.out = out
        self.entries = list(entries)
        self.metadata = dict(metadata)
        self.header = build_header(self.entries, self.metadata)
        self.out.file.write(self.header)
        self.hasher = hashlib.sha256() if checksum else None
        self.bytes_written = 0
        self._index = -1
        self._left = 0
        self._slow = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)

    def begin(self, name: str) -> None:
        self._end_tensor()
        self._index += 1
        ename, _, _, nbytes = self.entries[self._index]
        if ename != name:  # pragma: no cover - the plan orders both
            raise AssertionError(f"writer expected {ename}, got {name}")
        self._left = nbytes

    def write(self, data: memoryview | bytes) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n > self._left:  # pragma: no cover - engine bug guard
            raise AssertionError("tensor overflow")
        self._left -= n
        if self.hasher is not None:
            self.hasher.update(data)
        self.out.file.write(data)
        self.bytes_written += n

    def _end_tensor(self) -> None:
        if self._index >= 0 and self._left:  # pragma: no cover - engine bug guard
            raise AssertionError(f"tensor {self.entries[self._index][0]} short by {self._left} bytes")
        if self._index >= 0 and self._slow:
            time.sleep(self._slow)

    def finish(self, patch: Mapping[str, str]) -> str | None:
        """Close the last tensor, patch placeholders, commit atomically; returns the data sha256."""
        self._end_tensor()
        if self._index != len(self.entries) - 1:  # pragma: no cover
            raise AssertionError("not every tensor was written")
        if patch:
            meta = {**self.metadata, **patch}
            header = build_header(self.entries, meta)
            if len(header) != len(self.header):  # pragma: no cover - placeholders are fixed-length
                raise AssertionError("patched header changed length")
            os.pwrite(self.out.file.fileno(), header, 0)
        self.out.commit()
        return self.hasher.hexdigest() if self.hasher is not None else None

    def abort(self) -> None:
        self.out.abort()
