"""Streaming safetensors I/O for ``convert``: windowed mmap reads, running checksums, atomic writes.

Speaking the format ourselves (``header``) lets ``convert`` read through bounded mmap windows and write
tensor by tensor, so a file larger than RAM converts with a few chunk-sized buffers.

Outputs go to a hidden temporary file in the target directory (``fsutil``'s one naming scheme) and are
renamed into place only when complete (a hard link when not forcing, so an existing file is never
clobbered by a race); a process killed mid-write leaves the final name untouched.  Stale temporaries of
dead processes are removed by the next write to the same name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridpd.convert.header import Header, TensorEntry, build_header
from hybridpd.errors import UsageError
from hybridpd.fsutil import commit_temp, create_temp, discard_temp, parse_temp_name, temp_stem
from hybridpd.host import pid_alive

CHECKSUMS = ("xxh3", "crc32", "sha256", "none")
SLOW_WRITE_ENV = "HYBRIDPD_TEST_SLOW_WRITE"  # test hook: seconds to sleep after each tensor written
_OLD_TMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.hybridpd-tmp$")  # hybridpd 0.1.0's names


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



def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove temporaries for ``final`` left by killed processes; returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for p in final.parent.iterdir():
            pid = _writer_of(p.name, final)
            if pid is not None and pid != os.getpid() and not pid_alive(pid):
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


def _writer_of(name: str, final: Path) -> int | None:
    """The pid that wrote temporary ``name`` for ``final`` (either naming), or None when it is not one."""
    old = _OLD_TMP_RE.match(name)
    got, stem = ((old["name"], int(old["pid"])), final.name) if old else (parse_temp_name(name), temp_stem(final.name))
    return got[1] if got is not None and got[0] == stem else None


def _bytes(data: memoryview | bytes) -> memoryview:
    """``data`` as a flat view of bytes (a typed memoryview is cast, not copied)."""
    return memoryview(data).cast("B") if isinstance(data, memoryview) and data.format != "B" else memoryview(data)


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
        try:
            self.fd, tmp = create_temp(final)
        except OSError as e:
            raise UsageError(f"cannot create a file in {final.parent}: {e.strerror}", field="OUTPUT",
                             fix="choose a writable OUTPUT directory") from None
        self.tmp = Path(tmp)
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
        mv = _bytes(data)
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
        finally:
            self._close()
        try:
            commit_temp(self.tmp, self.final, clobber=self.force)
        except FileExistsError:  # the final name appeared meanwhile: never clobber it
            self.abort()
            raise UsageError(f"{self.final} appeared while converting", field="OUTPUT",
                             fix="pass --force to overwrite") from None

    def abort(self) -> None:
        self._close()
        discard_temp(self.tmp)


class Writer:
    """Streams one safetensors file: header first, then each tensor's bytes in header order.

    ``patchable`` metadata keys hold fixed-length placeholders that ``finish`` overwrites in place
    (the source checksum is only known once every input byte has been read).
    """

    PIECE = 1 << 20  # bytes hashed and staged together (fits in L2)

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
        if self.hasher is None:
            self.out.write(data)
        else:  # hash a piece, then stage it while it is still in cache: one pass over memory, not two
            mv = _bytes(data)
            for off in range(0, n, self.PIECE):
                piece = mv[off:off + self.PIECE]
                self.hasher.update(piece)
                self.out.write(piece)
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
