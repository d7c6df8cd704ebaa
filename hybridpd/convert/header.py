"""The safetensors header, spoken directly: its tensor entries, parsing with validation, and building.

The format is small enough to speak ourselves: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with
spaces, then the raw tensor bytes, contiguous, in offset order.  ``read_header`` refuses anything else
with a one-line error naming the file; ``files`` streams the bytes the header describes.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridpd.errors import HybridPDError, UsageError

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
