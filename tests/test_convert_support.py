"""Helpers shared by the tests/test_convert*.py modules (no tests here)."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridpd.convert.plan import Geometry
from hybridpd.core.families import MambaDims
from hybridpd.core.mamba import global_conv_channel_index, rank_channels

# Mamba2 dims of tests/conftest.py's tiny models: NemotronH (n_groups 2) and Granite (n_groups 1).
NEMOH = MambaDims(num_heads=8, head_dim=32, n_groups=2, state_size=16, conv_kernel=4, intermediate_size=256)
GRANITE = MambaDims(num_heads=8, head_dim=32, n_groups=1, state_size=16, conv_kernel=4, intermediate_size=256)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def geo(dims: MambaDims, num_spec: int = 0) -> Geometry:
    return Geometry(dims=dims, num_spec=num_spec, model="tiny")


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, -0.0, infinities included) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    es = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    return torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def load(path: Path | str) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def meta(path: Path | str) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_sha(path: Path) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return hashlib.sha256(raw[8 + n:]).hexdigest()


def data_xxh3(path: Path) -> str:
    import xxhash

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return xxhash.xxh3_64(raw[8 + n:]).hexdigest()


def data_crc(path: Path) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return f"{zlib.crc32(raw[8 + n:]):08x}"


def header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return dict(json.loads(raw[8:8 + n]))


def conv_ds(t: torch.Tensor, layout: str) -> torch.Tensor:
    """(..., dim, state_len) view of a conv state held in ``layout``."""
    return t if layout == "DS" else t.transpose(-1, -2)


def reference_shard(full_ds: torch.Tensor, dims: MambaDims, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s DS conv state, by index_select with the ground-truth channel map."""
    idx = torch.tensor(global_conv_channel_index(dims, rank_channels(dims, tp, rank)))
    return full_ds.index_select(-2, idx)


def reference_ssm(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    h = full.shape[-3] // tp
    return full[..., rank * h:(rank + 1) * h, :, :]
