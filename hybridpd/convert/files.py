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
import errno
import hashlib
import json
import mmap
import os
import re
import secrets
import stat
import struct
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.errors import HybridPDError, UsageError
from hybridpd.host import pid_alive

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
CHECKSUMS = ("xxh3", "crc32", "sha256", "none")
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


class Checksum:
    """Running checksum of a byte stream; ``value`` is ``"<algo>:<hex>"``, fixed length per algorithm.

    xxh3 (64-bit XXH3, the ``xxhash`` package) is the default: it catches corruption and truncation at
    ~4x zlib's crc32 speed on this 2-core machine (2.7 vs 0.63 GB/s, 256 MiB, bench/bench_convert.py), which
    decides whether convert keeps up with the disk.  crc32 needs nothing but the standard library; sha256 is
    there for content identity.  All three release the GIL, so they run beside the transposes.
    """

    _HEX = {"xxh3": 16, "crc32": 8, "sha256": 64}

    def __init__(self, algo: str) -> None:
        if algo not in self._HEX:
            raise UsageError(f"unknown checksum {algo!r}", field="--checksum", fix="use xxh3, crc32, sha256 or none")
        self.algo = algo
        self._h: Any = None
        if algo == "sha256":
            self._h = hashlib.sha256()
        elif algo == "xxh3":
            try:
                import xxhash
            except ImportError:
                raise UsageError("the xxh3 checksum needs the xxhash package", field="--checksum",
                                 fix="pip install xxhash (or 'hybridpd[convert]'), or pass --checksum crc32") from None
            self._h = xxhash.xxh3_64()
        self._crc = 0

    def update(self, data: memoryview | bytes) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    @property
    def value(self) -> str:
        return f"{self.algo}:{self._h.hexdigest()}" if self._h is not None else f"crc32:{self._crc:08x}"

    @staticmethod
    def placeholder(algo: str) -> str:
        return f"{algo}:" + "0" * Checksum._HEX[algo]


def new_checksum(algo: str) -> Checksum | None:
    return None if algo == "none" else Checksum(algo)


def _corrupt(path: Path, what: str) -> HybridPDError:
    return UsageError(f"{path} is not a valid safetensors file: {what}", field="INPUT",
                      fix="pass a .safetensors file written by safetensors, vLLM tooling or hybridpd")


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header (offsets contiguous, sizes consistent with shapes)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # #15: a FIFO or device would block or stream for ever
            raise _corrupt(path, "not a regular file")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"only {size} bytes long")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _corrupt(path, f"header length {n} exceeds the file ({size} bytes)")
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # #15 (never reached for a FIFO: open blocks first)
                raise _corrupt(path, "not a regular file")
            from hybridpd.fsutil import parse_json_bytes  # #15: deep nesting, 5,001-digit ints, NaN -> a clean error

            try:
                raw = parse_json_bytes(f.read(n), where="header", field="INPUT")
            except HybridPDError as e:
                why = str(e).removeprefix("INPUT: ").split(" (fix:")[0].replace("header is not valid JSON", "header is not JSON")
                raise _corrupt(path, why) from None
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
            ok = (isinstance(dtype, str) and all(type(s) is int and s >= 0 for s in shape)
                  and type(begin) is int and type(end) is int and 0 <= begin <= end)  # #15: no floats/bools
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
        self.hasher: Checksum | None = None
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
        self.fd, self.start, self.length = fd, start, length
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




def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove temporaries for ``final`` left by killed processes; returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for p in final.parent.iterdir():
            m = _TMP_RE.match(p.name)
            if m and m["name"] == final.name and int(m["pid"]) != os.getpid() and not pid_alive(int(m["pid"])):
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


class AtomicFile:
    """Write ``final`` through a temporary file in the same directory; ``commit`` makes it appear whole.

    Bytes are appended with ``write``/``copy``.  Where the filesystem allows it they go to disk with
    O_DIRECT through a page-aligned staging buffer: no copy into the page cache, which costs more CPU
    than the conversion itself on small machines (buffered writes ran at ~0.5 GB/s on a 2-core VM,
    O_DIRECT at ~1.4 GB/s), and the output does not crowd the page cache.  Elsewhere (tmpfs, macOS,
    ``direct=False``) writes are buffered and unchanged tensors use in-kernel ``copy_file_range``.
    """

    ALIGN = 4096
    STAGE = 8 << 20

    def __init__(self, final: Path, *, force: bool, direct: bool = True) -> None:
        self.final = final
        self.force = force
        sweep_stale_temporaries(final)
        self.tmp = final.parent / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.hybridpd-tmp"
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            raise UsageError(f"cannot create a file in {final.parent}: {e.strerror}", field="OUTPUT",
                             fix="choose a writable OUTPUT directory") from None
        self._direct: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            with contextlib.suppress(OSError):
                self._direct = os.open(self.tmp, os.O_WRONLY | os.O_DIRECT)
        # two staging buffers: one fills while a flusher thread writes the other (the disk wait overlaps)
        self._stages = [mmap.mmap(-1, self.STAGE) for _ in range(2)] if self._direct is not None else []
        self._cur = 0
        self._fill = 0  # bytes staged in the current buffer
        self._pos = 0  # file offset of the current buffer's first byte (everything before is written/in flight)
        self._flusher: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def _pwrite(self, fd: int, data: memoryview, offset: int) -> None:
        while data.nbytes:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n

    def _flush(self, stage: mmap.mmap, n: int, offset: int) -> None:
        """Write the first ``n`` bytes of ``stage`` at ``offset``: O_DIRECT when aligned, else buffered."""
        view = memoryview(stage)[:n]
        try:
            if self._direct is not None and n % self.ALIGN == 0:
                try:
                    self._pwrite(self._direct, view, offset)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    os.close(self._direct)  # the filesystem refuses O_DIRECT after all: buffered from here
                    self._direct = None
            self._pwrite(self.fd, view, offset)
        finally:
            view.release()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def write(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B") if isinstance(data, memoryview) and data.format != "B" else memoryview(data)
        if not self._stages:
            self._pwrite(self.fd, mv, self._pos)
            self._pos += mv.nbytes
            return
        done, n = 0, mv.nbytes
        while done < n:
            stage = self._stages[self._cur]
            k = min(self.STAGE - self._fill, n - done)
            stage[self._fill:self._fill + k] = mv[done:done + k]
            self._fill += k
            done += k
            if self._fill == self.STAGE:
                self._wait()  # the other buffer's write is done: it is free
                if self._flusher is None:
                    self._flusher = ThreadPoolExecutor(1, thread_name_prefix="hybridpd-flush")
                self._pending = self._flusher.submit(self._flush, stage, self.STAGE, self._pos)
                self._cur, self._fill, self._pos = 1 - self._cur, 0, self._pos + self.STAGE

    def copy(self, fd: int, offset: int, view: memoryview) -> None:
        """Append ``view``, which is bytes [offset, offset+len) of file ``fd``: in-kernel when buffered."""
        left = view.nbytes
        if not self._stages:
            with contextlib.suppress(AttributeError, OSError):  # no copy_file_range: plain writes below
                while left:
                    k = os.copy_file_range(fd, self.fd, left, offset, self._pos)
                    if k == 0:
                        break
                    offset, left, self._pos = offset + k, left - k, self._pos + k
        if left:
            self.write(view[view.nbytes - left:])

    def pwrite(self, data: bytes, offset: int) -> None:
        """Overwrite bytes already written (the header's placeholders); call after the last ``write``."""
        self._finish()
        self._pwrite(self.fd, memoryview(data), offset)

    def _finish(self) -> None:
        self._wait()
        if self._stages and self._fill:
            stage, fill = self._stages[self._cur], self._fill
            aligned = fill - fill % self.ALIGN
            if aligned:
                self._flush(stage, aligned, self._pos)
            if fill > aligned:  # the unaligned tail goes through the page cache
                with memoryview(stage) as mv:
                    self._pwrite(self.fd, mv[aligned:fill], self._pos + aligned)
            self._pos += fill
            self._fill = 0

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()
        if self._flusher is not None:
            self._flusher.shutdown()
            self._flusher = None
        for fd in (self._direct, self.fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._direct, self.fd = None, -1  # closed: a second _close must not close a reused fd number
        for stage in self._stages:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view; GC unmaps it
                stage.close()
        self._stages = []

    def commit(self) -> None:
        try:
            self._finish()
            os.fsync(self.fd)
        finally:
            self._close()
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
        self._close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


class Writer:
    """Streams one safetensors file: header first, then each tensor's bytes in header order.

    ``patchable`` metadata keys hold fixed-length placeholders that ``finish`` overwrites in place
    (the source checksum is only known once every input byte has been read).
    """

    def __init__(self, out: AtomicFile, entries: Sequence[tuple[str, str, Sequence[int], int]],
                 metadata: Mapping[str, str], *, checksum: str) -> None:
        self.out = out
        self.entries = list(entries)
        self.metadata = dict(metadata)
        self.header = build_header(self.entries, self.metadata)
        self.out.write(self.header)
        self.hasher = new_checksum(checksum)
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
        self.out.write(data)
        self.bytes_written += n

    def copy(self, window: Window) -> None:
        """Write a source window's bytes unchanged (in-kernel copy where the output is buffered)."""
        n = window.length
        if n > self._left:  # pragma: no cover - engine bug guard
            raise AssertionError("tensor overflow")
        if self.hasher is not None:
            self.hasher.update(window.view)
        self.out.copy(window.fd, window.start, window.view)
        self._left -= n
        self.bytes_written += n

    def _end_tensor(self) -> None:
        if self._index >= 0 and self._left:  # pragma: no cover - engine bug guard
            raise AssertionError(f"tensor {self.entries[self._index][0]} short by {self._left} bytes")
        if self._index >= 0 and self._slow:
            time.sleep(self._slow)

    def finish(self, patch: Mapping[str, str]) -> str | None:
        """Close the last tensor, patch placeholders, commit atomically; returns the data checksum."""
        self._end_tensor()
        if self._index != len(self.entries) - 1:  # pragma: no cover
            raise AssertionError("not every tensor was written")
        if patch:
            meta = {**self.metadata, **patch}
            header = build_header(self.entries, meta)
            if len(header) != len(self.header):  # pragma: no cover - placeholders are fixed-length
                raise AssertionError("patched header changed length")
            self.out.pwrite(header, 0)
        self.out.commit()
        return self.hasher.value if self.hasher is not None else None

    def abort(self) -> None:
        self.out.abort()
