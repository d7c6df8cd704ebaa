"""Channel-run copies between the two conv-state layouts, on the GPU through a Triton kernel.

A conv state is ``(rows, L, C)`` in SD layout ("state_len, dim") or ``(rows, C, L)`` in DS layout, with L
small (2..7) and C large.  ``channel_copy`` copies channels ``[in_c0, in_c0 + n)`` of one such tensor into
channels ``[out_c0, out_c0 + n)`` of another, either layout to either layout, for every row and position.
torch's strided ``copy_`` of the transposed view moves this at ~0.4x of a plain device copy; the kernels
here store contiguously and gather the loads (L1 absorbs the stride).  Two kernels, picked by ``variant``:

- ``"flat"``: each program owns BLOCK consecutive output elements of one row; it works out each element's
  (channel, position) from its output index and loads it from the input (DS output: index = c * L + l;
  SD output: the program sits at one position l and takes BLOCK consecutive channels).
- ``"tile"``: each program loads a ``[LP, BLOCK_C]`` tile (L padded to a power of two, masked) in the
  input's order, ``tl.trans``-poses it when the layouts differ, and stores it in the output's order.
- ``"pair"``: for 2-byte elements with L = 3 (conv_kernel 4: every bundled hybrid family) between the two
  layouts, with even channel offsets, counts and widths, it moves 32-bit words: a pair of channels is three
  words in DS (a0 a1 | a2 b0 | b1 b2) and one word per position in SD (a_l b_l), so each program loads whole
  words on one side, shuffles halves in registers and stores whole words on the other.  Anything else takes
  the ``"flat"`` kernel.

Tensors are same-width integers (any dtype works: the kernels move elements, never do arithmetic on them).
On CPU tensors, or when triton is not importable, the torch strided copy does the same work.  Nothing heavy
is imported at module import: torch and triton are imported on first use.  With ``TRITON_INTERPRET=1`` set
before triton is first imported, the kernels run in Triton's interpreter on CPU tensors (``force=True``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from hybridpd.core.layout import cdiv

SD, DS = "SD", "DS"
VARIANTS = ("flat", "tile", "pair")
DEFAULT_VARIANT = "pair"
_BLOCK = 2048  # output elements per program (flat) / tile elements (tile, before padding waste)
# pair: (DS output, SD output) -> words / channel pairs per program, and warps; the best of a sweep on an H200
# (bench/tune_gpu_transpose.py, Super's conv state, 1 GiB): SD -> DS 0.88x, DS -> SD 0.94-0.95x of a device copy
_PAIR_BLOCK = {False: 1024, True: 512}
_PAIR_WARPS = {False: 2, True: 4}
_NUM_WARPS = 4
_GRID_MAX = 2**31 - 1  # CUDA grid x limit; rows are launched in batches that keep rows * blocks under it

tl: Any = None  # triton.language, bound by _kernels(); the kernel bodies below resolve it as a global
triton: Any = None


def triton_available() -> bool:
    """True when triton imports (it ships with CUDA builds of torch)."""
    return _kernels() is not None


def _shape(t: Any, layout: str) -> tuple[int, int, int]:
    """(rows, L, C) of a 3-D tensor in ``layout``."""
    if layout not in (SD, DS):
        raise ValueError(f"layout must be {SD!r} or {DS!r}, not {layout!r}")
    if t.dim() != 3:
        raise ValueError(f"expected a 3-D tensor, got shape {tuple(t.shape)}")
    rows, a, b = t.shape
    return (rows, a, b) if layout == SD else (rows, b, a)


def channel_copy(out: Any, out_layout: str, out_c0: int, inp: Any, in_layout: str, in_c0: int, n: int,
                 *, variant: str = DEFAULT_VARIANT, force: bool = False, block: int | None = None,
                 num_warps: int | None = None) -> None:
    """``out[channels out_c0 : out_c0 + n] = inp[channels in_c0 : in_c0 + n]`` for every row and position.

    ``out`` and ``inp`` are contiguous 3-D tensors of one dtype, ``(rows, L, C)`` for SD or ``(rows, C, L)``
    for DS, with the same rows and L.  CUDA tensors go through the Triton kernel ``variant``; CPU tensors
    (unless ``force``, which runs the kernel anyway, e.g. in Triton's interpreter) or a missing triton
    take the torch strided copy.  ``block`` (a power of two) and ``num_warps`` override the launch
    parameters (bench/tune_gpu_transpose.py sweeps them)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    rows, L, c_out = _shape(out, out_layout)
    rows_in, L_in, c_in = _shape(inp, in_layout)
    if (rows, L) != (rows_in, L_in) or out.dtype != inp.dtype or out.device != inp.device:
        raise ValueError(f"mismatched tensors: out {tuple(out.shape)} {out.dtype} {out.device}, "
                         f"inp {tuple(inp.shape)} {inp.dtype} {inp.device}")
    if n < 0 or out_c0 < 0 or in_c0 < 0 or out_c0 + n > c_out or in_c0 + n > c_in:
        raise ValueError(f"channel range out [{out_c0}, {out_c0 + n}) of {c_out} / in [{in_c0}, {in_c0 + n}) of {c_in}")
    if n == 0 or rows == 0 or L == 0:
        return
    kernels = _kernels() if (out.is_cuda or force) else None
    if kernels is None or not (out.is_contiguous() and inp.is_contiguous()):
        _torch_copy(out, out_layout, out_c0, inp, in_layout, in_c0, n)
        return
    if out_layout == DS and in_layout == DS and L > 1:  # a run of DS channels is one contiguous run per row
        out, inp = out.view(rows, c_out * L, 1), inp.view(rows, c_in * L, 1)
        out_c0, in_c0, n, c_out, c_in, L = out_c0 * L, in_c0 * L, n * L, c_out * L, c_in * L, 1
    if variant == "pair" and _pairs(out, out_layout, out_c0, c_out, inp, in_layout, in_c0, c_in, n, L):
        out_sd = out_layout == SD
        _launch_pair(kernels[2], out, out_sd, out_c0, c_out, inp, in_c0, c_in, n, rows,
                     block or _PAIR_BLOCK[out_sd], num_warps or _PAIR_WARPS[out_sd])
        return
    _launch(kernels, "flat" if variant == "pair" else variant, out, out_layout == SD, out_c0, c_out, inp,
            in_layout == SD, in_c0, c_in, n, rows, L, block or _BLOCK, num_warps or _NUM_WARPS)


def _pairs(out: Any, out_layout: str, out_c0: int, c_out: int, inp: Any, in_layout: str, in_c0: int, c_in: int,
           n: int, L: int) -> bool:
    """Whether the word kernel applies: 2-byte elements, L = 3, SD <-> DS, whole channel pairs, 4-byte bases."""
    return (out.element_size() == 2 and L == 3 and out_layout != in_layout
            and not (out_c0 | in_c0 | n | c_out | c_in) & 1
            and out.data_ptr() % 4 == 0 and inp.data_ptr() % 4 == 0)


def _launch_pair(kernel: Any, out: Any, out_sd: bool, out_c0: int, c_out: int, inp: Any, in_c0: int, c_in: int,
                 n: int, rows: int, max_block: int, num_warps: int) -> None:
    import torch

    rows_o, rows_i = out.view(rows, -1).view(torch.int32), inp.view(rows, -1).view(torch.int32)
    pairs = n // 2
    block = min(max_block, max(128, _pow2(pairs if out_sd else 3 * pairs)))
    nb = cdiv(pairs if out_sd else 3 * pairs, block)  # SD output: pairs per program; DS output: words
    per = max(1, _GRID_MAX // nb)
    for r0 in range(0, rows, per):
        k = min(per, rows - r0)
        kernel[(k * nb,)](rows_o[r0:r0 + k], rows_i[r0:r0 + k], pairs, c_out * 3 // 2, c_in * 3 // 2, c_out // 2,
                          c_in // 2, out_c0 // 2, in_c0 // 2, nb, OUT_SD=out_sd, BLOCK=block, num_warps=num_warps)


def _torch_copy(out: Any, out_layout: str, out_c0: int, inp: Any, in_layout: str, in_c0: int, n: int) -> None:
    """The reference: copy_ between (rows, C, L) views (a transpose of SD memory where needed)."""
    o = out.transpose(1, 2) if out_layout == SD else out
    i = inp.transpose(1, 2) if in_layout == SD else inp
    o[:, out_c0:out_c0 + n].copy_(i[:, in_c0:in_c0 + n])


def _pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _launch(kernels: tuple[Any, Any, Any], variant: str, out: Any, out_sd: bool, out_c0: int, c_out: int,
            inp: Any, in_sd: bool, in_c0: int, c_in: int, n: int, rows: int, L: int, max_block: int,
            num_warps: int) -> None:
    flat, tile, _ = kernels
    if variant == "flat":
        block = min(max_block, max(128, _pow2(n if out_sd else n * L)))
        nbc = cdiv(n, block)  # SD output: channel blocks per position
        nb = L * nbc if out_sd else cdiv(n * L, block)
        kernel, meta = flat, {"L": L, "BLOCK": block, "num_warps": num_warps}
    else:
        lp = _pow2(L)
        block = min(max(16, max_block // lp), max(16, _pow2(n)))
        nbc = nb = cdiv(n, block)
        kernel, meta = tile, {"L": L, "LP": lp, "BLOCK_C": block, "num_warps": num_warps}
    per = max(1, _GRID_MAX // nb)  # rows per launch
    for r0 in range(0, rows, per):
        k = min(per, rows - r0)
        kernel[(k * nb,)](out[r0:r0 + k], inp[r0:r0 + k], n, c_out * L, c_in * L, c_out, c_in, out_c0, in_c0,
                          nb, nbc, OUT_SD=out_sd, IN_SD=in_sd, **meta)


# -- kernels (plain functions here; _kernels() binds triton and wraps them in triton.jit) ---------------
def _flat_kernel(out_ptr, inp_ptr, n, out_row, in_row, out_c, in_c, out_c0, in_c0, nb, nbc,  # type: ignore[no-untyped-def]
                 L: tl.constexpr, OUT_SD: tl.constexpr, IN_SD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // nb).to(tl.int64)  # row offsets can pass 2**31 elements; offsets inside a row cannot
    b = pid % nb
    if OUT_SD:  # block b: position b // nbc, channels (b % nbc) * BLOCK + [0, BLOCK)
        pos = b // nbc
        c = (b % nbc) * BLOCK + tl.arange(0, BLOCK)
        mask = c < n
        o = pos * out_c + out_c0 + c
    else:  # block b: output elements j = c * L + pos of the run
        j = b * BLOCK + tl.arange(0, BLOCK)
        mask = j < n * L
        c = j // L
        pos = j % L
        o = out_c0 * L + j
    if IN_SD:
        i = pos * in_c + in_c0 + c
    else:
        i = (in_c0 + c) * L + pos
    v = tl.load(inp_ptr + r * in_row + i, mask=mask)
    tl.store(out_ptr + r * out_row + o, v, mask=mask)


def _tile_kernel(out_ptr, inp_ptr, n, out_row, in_row, out_c, in_c, out_c0, in_c0, nb, nbc,  # type: ignore[no-untyped-def]
                 L: tl.constexpr, LP: tl.constexpr, OUT_SD: tl.constexpr, IN_SD: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    r = (pid // nb).to(tl.int64)
    c = (pid % nb) * BLOCK_C + tl.arange(0, BLOCK_C)
    pos = tl.arange(0, LP)
    src = inp_ptr + r * in_row
    if IN_SD:  # [LP, BLOCK_C] tile, channels fastest
        v = tl.load(src + pos[:, None] * in_c + (in_c0 + c)[None, :], mask=(pos[:, None] < L) & (c[None, :] < n))
        if not OUT_SD:
            v = tl.trans(v)
    else:  # [BLOCK_C, LP] tile, positions fastest
        v = tl.load(src + (in_c0 + c)[:, None] * L + pos[None, :], mask=(c[:, None] < n) & (pos[None, :] < L))
        if OUT_SD:
            v = tl.trans(v)
    dst = out_ptr + r * out_row
    if OUT_SD:
        tl.store(dst + pos[:, None] * out_c + (out_c0 + c)[None, :], v, mask=(pos[:, None] < L) & (c[None, :] < n))
    else:
        tl.store(dst + (out_c0 + c)[:, None] * L + pos[None, :], v, mask=(c[:, None] < n) & (pos[None, :] < L))


def _pair_kernel(out_ptr, inp_ptr, pairs, out_row, in_row, out_w, in_w, out_p0, in_p0, nb,  # type: ignore[no-untyped-def]
                 OUT_SD: tl.constexpr, BLOCK: tl.constexpr):
    """Rows and offsets in 32-bit words; ``*_w`` = words per SD position row, ``*_p0`` = first channel pair."""
    pid = tl.program_id(0)
    r = (pid // nb).to(tl.int64)
    k = (pid % nb) * BLOCK + tl.arange(0, BLOCK)  # channel pair k of the run: channels 2k (a) and 2k + 1 (b)
    mask = k < pairs
    src = inp_ptr + r * in_row
    dst = out_ptr + r * out_row
    lo = 0xFFFF
    hi = -65536  # 0xFFFF0000 as an int32
    if OUT_SD:  # DS words w0 = a0|a1, w1 = a2|b0, w2 = b1|b2 -> SD rows (a_l | b_l)
        w = src + (in_p0 + k) * 3
        w0 = tl.load(w, mask=mask)
        w1 = tl.load(w + 1, mask=mask)
        w2 = tl.load(w + 2, mask=mask)
        o = dst + out_p0 + k
        tl.store(o, (w0 & lo) | (w1 & hi), mask=mask)
        tl.store(o + out_w, ((w0 >> 16) & lo) | (w2 << 16), mask=mask)
        tl.store(o + 2 * out_w, (w1 & lo) | (w2 & hi), mask=mask)
    else:  # SD rows r_l = a_l | b_l -> DS words; this program stores BLOCK consecutive output words j
        j = (pid % nb) * BLOCK + tl.arange(0, BLOCK)
        mask = j < pairs * 3
        k = j // 3
        m = j % 3  # word m of pair k: a0|a1 (rows 0, 1), a2|b0 (rows 2, 0), b1|b2 (rows 1, 2)
        s = src + in_p0 + k
        A = tl.load(s + tl.where(m == 0, 0, tl.where(m == 1, 2, 1)) * in_w, mask=mask)
        B = tl.load(s + tl.where(m == 0, 1, tl.where(m == 1, 0, 2)) * in_w, mask=mask)
        first = tl.where(m == 2, (A >> 16) & lo, A & lo)
        second = tl.where(m == 0, B << 16, B & hi)
        tl.store(dst + out_p0 * 3 + j, first | second, mask=mask)


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any, Any] | None:
    global tl, triton
    try:
        import triton as _triton
        import triton.language as _tl
    except Exception:  # noqa: BLE001 - not installed, or a broken install: use the torch copy
        return None
    triton, tl = _triton, _tl
    return triton.jit(_flat_kernel), triton.jit(_tile_kernel), triton.jit(_pair_kernel)
