"""channel_copy (hybridpd.convert.gpu_transpose) against an independent numpy reference, three ways:

- the CPU fallback (torch strided copy): always runs;
- the Triton kernels in Triton's interpreter on CPU tensors: needs triton importable.  TRITON_INTERPRET must be
  set before triton is first imported, and must not leak into the CUDA tests of this process, so these cases
  run in a child interpreter (``python -c ... _child(variant)``) started with TRITON_INTERPRET=1;
- the Triton kernels on CUDA tensors: needs a GPU (and skips under TRITON_INTERPRET=1, which would route the
  kernel through the interpreter instead).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_convert_support import NEMOH, data_sha, geo, rand, save

import hybridpd.convert.gpu_transpose as gt
from hybridpd.convert.gpu_transpose import channel_copy
from hybridpd.convert.run import ConvertOptions, convert

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LAYOUTS = list(product(("SD", "DS"), repeat=2))  # (out, in)
DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64]
LENGTHS = [1, 2, 3, 4, 7]


def shaped(rows: int, L: int, C: int, layout: str) -> tuple[int, int, int]:
    return (rows, L, C) if layout == "SD" else (rows, C, L)


def reference(out: np.ndarray, out_layout: str, out_c0: int, inp: np.ndarray, in_layout: str, in_c0: int,
              n: int) -> np.ndarray:
    """What channel_copy must leave in ``out``: both sides as (rows, C, L), assign the channel slice."""
    o = np.array(np.transpose(out, (0, 2, 1)) if out_layout == "SD" else out)
    i = np.transpose(inp, (0, 2, 1)) if in_layout == "SD" else inp
    o[:, out_c0:out_c0 + n] = i[:, in_c0:in_c0 + n]
    return np.ascontiguousarray(np.transpose(o, (0, 2, 1)) if out_layout == "SD" else o)


# (rows, L, C_in, C_out, in_c0, out_c0, n): sub-ranges at non-zero offsets, whole tensors, one channel
GEOMETRIES = [(rows, L, 37, 53, 7, 23, 19) for rows in (1, 9) for L in LENGTHS]
GEOMETRIES += [(4, 3, 40, 40, 0, 0, 40), (2, 7, 5, 9, 4, 0, 1), (3, 3, 3000, 2100, 500, 77, 2023)]
# whole channel pairs at L = 3 (the "pair" kernel's domain for 2-byte elements): offsets, a slice, one pair
GEOMETRIES += [(3, 3, 3000, 2100, 500, 76, 2024), (2, 3, 64, 32, 10, 4, 20), (5, 3, 2, 4, 0, 2, 2)]


def case_ids() -> list[tuple[Any, ...]]:
    return [(lay, dt, g) for lay in LAYOUTS for dt in DTYPES for g in GEOMETRIES]


def check(device: str, layouts: tuple[str, str], dtype: torch.dtype, g: tuple[int, ...], variant: str | None,
          force: bool = False) -> None:
    (out_layout, in_layout), (rows, L, c_in, c_out, in_c0, out_c0, n) = layouts, g
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(rows * 1000 + L * 100 + c_in)
    inp = torch.randint(info.min, info.max, shaped(rows, L, c_in, in_layout), dtype=dtype, generator=gen)
    out = torch.randint(info.min, info.max, shaped(rows, L, c_out, out_layout), dtype=dtype, generator=gen)
    want = reference(out.numpy(), out_layout, out_c0, inp.numpy(), in_layout, in_c0, n)
    o, i = out.to(device), inp.to(device)
    kw = {"variant": variant} if variant else {}
    channel_copy(o, out_layout, out_c0, i, in_layout, in_c0, n, force=force, **kw)
    got = o.cpu().numpy()
    assert got.dtype == want.dtype and np.array_equal(got, want), (layouts, dtype, g, variant)
    assert torch.equal(i.cpu(), inp)  # the input is untouched


# -- (a) CPU fallback ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("layouts", "dtype", "g"), case_ids())
def test_cpu_fallback(layouts: tuple[str, str], dtype: torch.dtype, g: tuple[int, ...]) -> None:
    check("cpu", layouts, dtype, g, None)


def test_rejects_bad_arguments() -> None:
    a, b = torch.zeros(2, 3, 8, dtype=torch.int16), torch.zeros(2, 8, 3, dtype=torch.int16)
    with pytest.raises(ValueError, match="layout"):
        channel_copy(a, "XY", 0, b, "DS", 0, 1)
    with pytest.raises(ValueError, match="variant"):
        channel_copy(a, "SD", 0, b, "DS", 0, 1, variant="fast")
    with pytest.raises(ValueError, match="channel range"):
        channel_copy(a, "SD", 4, b, "DS", 0, 5)
    with pytest.raises(ValueError, match="mismatched"):
        channel_copy(a, "SD", 0, b.to(torch.int32), "DS", 0, 1)
    with pytest.raises(ValueError, match="mismatched"):
        channel_copy(a, "SD", 0, torch.zeros(2, 8, 4, dtype=torch.int16), "DS", 0, 1)


def test_module_imports_nothing_heavy() -> None:
    code = "import sys, hybridpd.convert.gpu_transpose; print([m for m in ('torch', 'triton', 'numpy') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- (b) Triton's interpreter, in a child process ---------------------------------------------------------
def _child(variant: str) -> None:
    """Entry point of the TRITON_INTERPRET=1 child: every case through the kernel; prints the failures as JSON."""
    from triton.runtime.interpreter import InterpretedFunction

    kernels = gt._kernels()
    assert kernels is not None and all(isinstance(k, InterpretedFunction) for k in kernels), kernels
    failures = []
    cases = case_ids() + [(lay, torch.int16, (7, 3, 50, 60, 3, 5, 40)) for lay in LAYOUTS]
    for k, (lay, dt, g) in enumerate(cases):
        grid_max, gt._GRID_MAX = gt._GRID_MAX, (3 if k >= len(cases) - len(LAYOUTS) else gt._GRID_MAX)
        try:  # the last cases force several launches (rows in batches)
            check("cpu", lay, dt, g, variant, force=True)
        except AssertionError as e:
            failures.append(f"{lay} {dt} {g}: {e}")
        finally:
            gt._GRID_MAX = grid_max
    print(json.dumps({"cases": len(cases), "failures": failures}))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable (it ships with CUDA builds of torch)")
@pytest.mark.parametrize("variant", gt.VARIANTS)
def test_triton_interpreter(variant: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_gpu_transpose as t; t._child({variant!r})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["cases"] >= len(case_ids()) and res["failures"] == [], res["failures"][:10]


# -- (c) CUDA ------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED,
                               reason="needs a CUDA device and triton, without TRITON_INTERPRET=1")


@needs_gpu
@pytest.mark.parametrize("variant", gt.VARIANTS)
@pytest.mark.parametrize(("layouts", "dtype", "g"), case_ids())
def test_cuda(variant: str, layouts: tuple[str, str], dtype: torch.dtype, g: tuple[int, ...]) -> None:
    assert gt.triton_available()
    check("cuda", layouts, dtype, g, variant)


@needs_gpu
@pytest.mark.parametrize("variant", gt.VARIANTS)
@pytest.mark.parametrize("layouts", LAYOUTS)
def test_cuda_batched_launches(monkeypatch: pytest.MonkeyPatch, variant: str, layouts: tuple[str, str]) -> None:
    monkeypatch.setattr(gt, "_GRID_MAX", 5)
    check("cuda", layouts, torch.int16, (11, 3, 300, 400, 10, 20, 250), variant)


@needs_gpu
@pytest.mark.parametrize(("src_layout", "to"), [("SD", "DS"), ("DS", "SD"), ("SD", "SD")])
def test_cuda_engine_matches_cpu(tmp_path: Path, src_layout: str, to: str) -> None:
    """convert --device cuda (gathers for a TP split, scatters for the merge) writes the CPU path's bytes."""
    dim = 256 + 2 * 2 * 16
    shape = (5, 3, dim) if src_layout == "SD" else (5, dim, 3)
    src = save(tmp_path / "a.safetensors", {"model.layers.0.mixer.conv_state": rand(shape, torch.bfloat16, 1),
                                            "model.layers.0.mixer.ssm_state": rand((5, 8, 32, 16), torch.float32, 2)})
    for dev in ("cpu", "cuda"):
        convert(src, tmp_path / dev, ConvertOptions(to=to, geometry=geo(NEMOH), tp_split=2, device=dev))
        convert(tmp_path / dev, tmp_path / f"{dev}.safetensors", ConvertOptions(to=src_layout, tp_merge=True, device=dev))
    for r in range(2):
        name = f"a.rank{r}-of-2.safetensors"
        assert data_sha(tmp_path / "cpu" / name) == data_sha(tmp_path / "cuda" / name)
    assert data_sha(tmp_path / "cuda.safetensors") == data_sha(src)
