"""Streams a ``StreamPlan``: bounded chunks in, channel gathers/scatters (transposes) on CPU or GPU, out.

Tensor bytes are moved as same-width integers (int8/16/32/64), never as floats, so every dtype (bf16,
fp16, fp32, fp8 variants) and every bit pattern (NaN payloads, -0.0) round-trips exactly.  Memory is
bounded by ``chunk_bytes``: a few mmap windows of the source in flight plus a ring of reusable output
buffers per sink.  Two I/O threads (source checksums; output checksums and writes) run beside the
main thread's reshaping.  torch is imported only when a chunk needs reshaping.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from hybridpd.convert.files import Source, Window
from hybridpd.convert.header import TensorEntry
from hybridpd.convert.plan import SD, Step, StreamPlan
from hybridpd.errors import UsageError, VerificationFailed
from hybridpd.gpus import require_gpu

DEFAULT_CHUNK = 32 << 20
_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class Sink(Protocol):
    def begin(self, name: str) -> None: ...

    def write(self, data: memoryview) -> None: ...

    def copy(self, window: Window) -> None: ...


class Mismatch(VerificationFailed):
    """First difference found by a CompareSink; ``info`` is the JSON-ready description."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        where = f" at index {info['index']}" if info.get("index") is not None else ""
        super().__init__(f"{info['file']}: tensor {info['tensor']!r}{where}: {info['reason']}",
                         fix="the pair does not match; reconvert, or check --model/--num-speculative-tokens")


def _decode(raw: bytes, dtype: str) -> float | None:
    import numpy as np

    if dtype == "BF16":
        return float(np.frombuffer(b"\0\0" + raw, dtype="<f4")[0])
    np_dtype = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}.get(dtype)
    return float(np.frombuffer(raw, dtype=np_dtype)[0]) if np_dtype else None


def _unravel(i: int, shape: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(i % s if s else 0)
        i //= s if s else 1
    return out[::-1]


class CompareSink:
    """Compares what the engine would write against an existing file's tensor bytes."""

    def __init__(self, target: Source) -> None:
        self.target = target
        self.entries = target.header.by_name()
        self._cur: TensorEntry | None = None
        self._pos = 0

    def begin(self, name: str) -> None:
        self._cur, self._pos = self.entries[name], 0

    def copy(self, window: Window) -> None:
        self.write(window.view)

    def write(self, data: memoryview) -> None:
        import numpy as np

        cur = self._cur
        assert cur is not None
        n = data.nbytes
        with self.target.window(cur, self._pos, n) as mv:
            a = np.frombuffer(data, dtype=np.uint8)
            b = np.frombuffer(mv, dtype=np.uint8)
            if not np.array_equal(a, b):
                byte = int(np.flatnonzero(a != b)[0])
                es = cur.elem or 1
                k = (self._pos + byte) // es
                exp, act = bytes(a[byte - byte % es:][:es]), bytes(b[byte - byte % es:][:es])
                del a, b
                raise Mismatch({"file": str(self.target.header.path), "tensor": cur.name, "reason": "data differs",
                                "index": _unravel(k, cur.shape), "element": k, "expected_hex": exp.hex(),
                                "actual_hex": act.hex(), "expected": _decode(exp, cur.dtype),
                                "actual": _decode(act, cur.dtype)})
            del a, b
        self._pos += n


def resolve_device(device: str) -> str:
    if device == "cpu":
        return device
    if not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise UsageError(f"unknown device {device!r}", field="--device", fix="use cpu, cuda or cuda:N")
    require_gpu(int(device[5:]) if ":" in device else 0, device)
    return device


class _Worker:
    """One background thread running I/O jobs in submission order (checksums, writes, compares), so the
    main thread can reshape the next chunk meanwhile.  The first error stops the rest and is re-raised."""

    def __init__(self, depth: int) -> None:
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=depth)
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hybridpd-convert-io", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if self._err is None:
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._err = e
            finally:
                self._q.task_done()

    def _raise(self) -> None:
        if self._err is not None:
            err, self._err = self._err, None
            raise err

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._q.put(job)

    def drain(self) -> None:
        self._q.join()
        self._raise()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


def counting(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None]:
    """The engine's byte counts (one call per chunk) as ``progress(bytes so far, total)`` calls."""
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    return tick


class Engine:
    """Streams a plan.  ``depth`` jobs may wait for the I/O thread; each sink has ``depth + 2`` output
    buffers in rotation, so a buffer is never refilled while the I/O thread still writes it."""

    def __init__(self, *, device: str = "cpu", chunk_bytes: int = DEFAULT_CHUNK,
                 progress: Callable[[int], None] | None = None, depth: int = 1) -> None:
        self.device = device
        self.chunk_bytes = max(1, chunk_bytes)
        self.progress = progress or (lambda n: None)
        self.depth = depth
        self._pool: dict[tuple[int, int, str], Any] = {}
        self._turn: dict[int, int] = {}
        self._workers: tuple[_Worker, ...] = ()

    # -- buffers -------------------------------------------------------------------------------
    def _buf(self, k: int, nbytes: int, where: str, elem: int, shape: tuple[int, ...]) -> Any:
        """The next buffer of sink ``k``'s ring on ``where``, viewed as ``shape`` of ``elem``-byte ints."""
        import torch

        key = (k, self._turn.get(k, 0) % (self.depth + 2), where)
        buf = self._pool.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=where,
                              pin_memory=where == "cpu" and self.device != "cpu")
            self._pool[key] = buf
        return buf[:nbytes].view(getattr(torch, _INT[elem])).view(shape)

    def _host(self, k: int, t: Any) -> memoryview:
        """Bytes of ``t`` on the host (copied out of the GPU into sink ``k``'s pinned ring buffer)."""
        if t.device.type != "cpu":
            n = t.numel() * t.element_size()
            host = self._buf(k, n, "cpu", 1, (n,))
            host.copy_(t.reshape(-1).view(host.dtype))
            t = host
        self._turn[k] = self._turn.get(k, 0) + 1
        return memoryview(t.numpy()).cast("B")

    def _ds(self, t: Any, layout: str | None, rows: int, channels: int, length: int) -> Any:
        """(rows, channels, length) view of a chunk held in ``layout``."""
        if layout == SD:
            return t.view(rows, length, channels).transpose(1, 2)
        return t.view(rows, channels, length)

    def _place(self, out: Any, out_layout: str | None, out_c0: int, raw: Any, in_layout: str | None, in_c0: int,
               n: int, rows: int, in_channels: int, length: int) -> None:
        """Channels [in_c0, in_c0 + n) of the loaded chunk ``raw`` (flat, held in ``in_layout``) into channels
        [out_c0, out_c0 + n) of ``out`` (viewed in ``out_layout``) on the GPU: one Triton kernel per run."""
        from hybridpd.convert.gpu_transpose import DS as _DS
        from hybridpd.convert.gpu_transpose import channel_copy

        inp = raw.view(rows, length, in_channels) if in_layout == SD else raw.view(rows, in_channels, length)
        channel_copy(out, SD if out_layout == SD else _DS, out_c0, inp, SD if in_layout == SD else _DS, in_c0, n)

    def _load(self, view: memoryview, elem: int) -> Any:
        import torch

        t = torch.frombuffer(view, dtype=getattr(torch, _INT[elem]))
        return t.to(self.device) if self.device != "cpu" else t

    def _submit(self, job: Callable[[], None], *, reads: Callable[[], None] | None = None) -> None:
        """``job`` (writes, in order) to the output thread; ``reads`` (source checksums) to the input thread."""
        assert self._workers
        if reads is not None:
            self._workers[0].submit(reads)
        self._workers[1].submit(job)

    # -- steps ---------------------------------------------------------------------------------
    def run(self, plan: StreamPlan, sources: Sequence[Source], sinks: Sequence[Sink]) -> None:
        threads = _one_torch_thread() if self.device == "cpu" and any(s.mode != "raw" for s in plan.steps) else None
        self._workers = (_Worker(self.depth), _Worker(self.depth))
        try:
            for step in plan.steps:
                self._submit(partial(_begin, sinks, step.name))
                if step.mode == "raw":
                    self._raw(step, sources, sinks)
                elif step.mode == "gather":
                    self._gather(step, sources[0], sinks)
                else:
                    self._scatter(step, sources, sinks[0])
            for w in self._workers:
                w.drain()
        finally:
            for w in self._workers:
                w.close()
            self._workers = ()
            if threads is not None:
                import torch

                torch.set_num_threads(threads)

    def _raw(self, step: Step, sources: Sequence[Source], sinks: Sequence[Sink]) -> None:
        n = step.sources[0].nbytes
        size = max(step.elem, self.chunk_bytes - self.chunk_bytes % step.elem)  # whole elements per chunk
        for off in range(0, n, size):
            k = min(size, n - off)
            wins = [src.map(e, off, k) for src, e in zip(sources, step.sources, strict=False)]
            done = _Release(wins, 2)

            def job(wins: list[Window] = wins, off: int = off, done: _Release = done) -> None:
                try:
                    for i in range(1, len(wins)):
                        _same(step, i, off, wins[0].view, wins[i].view)
                    for sink in sinks:
                        sink.copy(wins[0])
                finally:
                    done()

            self._submit(job, reads=partial(_digest, sources, wins, done))
            self.progress(k * len(wins))

    def _chunks(self, step: Step, row_bytes: int) -> list[tuple[int, int]]:
        per = max(1, self.chunk_bytes // max(row_bytes, 1))
        return [(r, min(per, step.rows - r)) for r in range(0, step.rows, per)]

    def _gather(self, step: Step, src: Source, sinks: Sequence[Sink]) -> None:
        e = step.sources[0]
        row_in = step.in_channels[0] * step.length * step.elem
        for r0, rows in self._chunks(step, row_in):
            win = src.map(e, r0 * row_in, rows * row_in)
            # the source checksum reads the window while this thread reshapes it (the pages come in once);
            # the window closes when both are done
            done = _Release([win], 2)
            self._workers[0].submit(partial(_digest, [src], [win], done))
            try:
                outs = self._gather_chunk(step, win.view, rows)
            finally:
                done()

            def job(outs: list[memoryview] = outs) -> None:
                for sink, out in zip(sinks, outs, strict=True):
                    sink.write(out)

            self._submit(job)
            self.progress(rows * row_in)

    def _gather_chunk(self, step: Step, view: memoryview, rows: int) -> list[memoryview]:
        L = step.length
        raw = self._load(view, step.elem)
        inp = self._ds(raw, step.in_layouts[0], rows, step.in_channels[0], L)
        outs = []
        for k, (ck, lay) in enumerate(zip(step.out_channels, step.out_layouts, strict=True)):
            out = self._buf(k, rows * ck * L * step.elem, self.device, step.elem,
                            (rows, L, ck) if lay == SD else (rows, ck, L))
            out_ds = out.transpose(1, 2) if lay == SD else out
            pos = 0
            for a, b in step.runs[k]:
                if self.device == "cpu":
                    out_ds[:, pos:pos + b - a].copy_(inp[:, a:b])
                else:
                    self._place(out, lay, pos, raw, step.in_layouts[0], a, b - a, rows, step.in_channels[0], L)
                pos += b - a
            outs.append(self._host(k, out))
        return outs

    def _scatter(self, step: Step, sources: Sequence[Source], sink: Sink) -> None:
        L, C = step.length, step.out_channels[0]
        lay = step.out_layouts[0]
        for r0, rows in self._chunks(step, C * L * step.elem):
            out = self._buf(0, rows * C * L * step.elem, self.device, step.elem,
                            (rows, L, C) if lay == SD else (rows, C, L))
            out_ds = out.transpose(1, 2) if lay == SD else out
            wins = []
            for k, src in enumerate(sources):
                row_in = step.in_channels[k] * L * step.elem
                wins.append(src.map(step.sources[k], r0 * row_in, rows * row_in))
                self._scatter_chunk(step, k, wins[-1].view, rows, out_ds, r0, out)
                self.progress(rows * row_in)
            data = self._host(0, out)

            self._submit(partial(sink.write, data), reads=partial(_digest, sources, wins, _Release(wins, 1)))

    def _scatter_chunk(self, step: Step, k: int, view: memoryview, rows: int, out_ds: Any, r0: int,
                       out: Any = None) -> None:
        """``out`` is the output chunk that ``out_ds`` views (in ``step.out_layouts[0]``); the GPU path needs it."""
        import torch

        raw = self._load(view, step.elem)
        inp = self._ds(raw, step.in_layouts[k], rows, step.in_channels[k], step.length)
        pos = 0
        for (a, b), place in zip(step.runs[k], step.place[k], strict=True):
            piece = inp[:, pos:pos + b - a]
            if place and self.device != "cpu" and out is not None:
                self._place(out, step.out_layouts[0], a, raw, step.in_layouts[k], pos, b - a, rows,
                            step.in_channels[k], step.length)
            elif place:
                out_ds[:, a:b].copy_(piece)
            elif not torch.equal(out_ds[:, a:b], piece):
                diff = (out_ds[:, a:b] != piece).nonzero()[0].tolist()
                what = "replicated B/C group" if step.kind == "conv" else "replicated channels"
                raise UsageError(
                    f"tensor {step.name!r}: shard {k} disagrees with an earlier shard on a {what} "
                    f"(row {r0 + diff[0]}, channel {a + diff[1]}, position {diff[2]}); vLLM keeps replicas identical",
                    field="INPUT", fix="pass shards of one consistent state (same step, same request)")
            pos += b - a


def _one_torch_thread() -> int:
    """Run CPU copies on one torch thread; returns the count to restore.  The transposes are memory-bound
    and the two I/O threads want the other core: torch's second OpenMP thread mostly spin-waits between
    chunks (bench/bench_convert.py: ~30% less CPU for the same wall time on 2 cores, more headroom under load)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


class _Release:
    """Closes windows once ``n`` jobs that read them are done."""

    def __init__(self, wins: list[Window], n: int) -> None:
        self.wins, self.n, self.lock = wins, n, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n -= 1
            last = self.n == 0
        if last:
            for w in self.wins:
                w.close()


def _digest(sources: Sequence[Source], wins: list[Window], done: _Release) -> None:
    try:
        for src, w in zip(sources, wins, strict=False):
            src.digest(w.view)
    finally:
        done()


def _begin(sinks: Sequence[Sink], name: str) -> None:
    for sink in sinks:
        sink.begin(name)


def _same(step: Step, i: int, off: int, ref: memoryview, view: memoryview) -> None:
    """Raw tensors of a merge must be identical on every shard."""
    import numpy as np

    a, b = np.frombuffer(ref, dtype=np.uint8), np.frombuffer(view, dtype=np.uint8)
    if not np.array_equal(a, b):
        byte = off + int(np.flatnonzero(a != b)[0])
        del a, b
        raise UsageError(f"tensor {step.name!r} differs between shard 0 and shard {i} (byte {byte}); "
                         "a tensor that is not a recognised state must be identical on every rank",
                         field="INPUT", fix="select per-rank states with --pattern / --model")
