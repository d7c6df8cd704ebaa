"""Descriptor tables: hand-computed (addr, len) pins, and the vectorised tables against plain loops.

The loops below follow the id layout in ``hybridpd/core/descriptors.py``'s docstring one descriptor at a
time; the pinned numbers come from the Nano page arithmetic written out in each test, not from the code.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridpd.core.descriptors import local_table, remote_table, strided_rows
from hybridpd.core.layout import SideLayout
from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.core.transfer import SourceRead

G = 1 << 32  # tensor i's base address is (i + 1) * G


def _plan(model: str, version: str, ptp: int = 1, dtp: int = 1):  # type: ignore[no-untyped-def]
    return build_plan(model, prefill=EngineSettings(tp=ptp), decode=EngineSettings(tp=dtp), vllm_version=version)


def _bases(side: SideLayout) -> list[int]:
    return [(i + 1) * G for i in range(side.num_shared_tensors)]


def _pairs(addr: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(addr.tolist(), length.tolist(), strict=True))


def _loop(bases: list[int], *, n_phys: int, n_log: int, kernel_page: int, fa_offsets: list[int], fa_len: int,
          slots: int, page: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for base in bases:  # FA: id = r * n_phys + b, region r = tensor-major, then K/V
        for off in fa_offsets:
            for b in range(n_phys):
                out.append((base + off + b * kernel_page, fa_len))
    for base in bases[:slots]:  # Mamba: id = num_fa + m * n_log + b, m = slot-major, then sub-projection
        for off, ln in spans:
            for b in range(n_log):
                out.append((base + off + b * page, ln))
    return out


def test_nano_fp8_020_pins() -> None:
    # Nano fp8 KV, TP 1, vLLM 0.20: block 4176 tokens, kernel 16, so 261 kernel blocks per logical block.
    # Attention page 4176 tok x 2 KV heads x 128 dims x (K+V) x 1 B = 2,138,112 B; kernel page 2,138,112 / 261
    # = 8,192 B, K and V separate (4,096 B each, V at +4,096).  Mamba page padded to 2,138,112 B; per slot
    # x = 4096 ch x 3 x 2 B = 24,576 B at 0, B and C 6,144 B at 24,576 and 30,720, SSM 2,097,152 B at 36,864.
    side = _plan("nano-fp8", "0.20").prefill
    assert side.num_shared_tensors == 6 and side.num_ssm_slots == 6
    t = local_table(side, _bases(side), 2)
    n_phys = 2 * 261
    assert (t.n_phys, t.n_log) == (n_phys, 2)
    assert t.num_fa_descs == 6 * 2 * n_phys == 6264
    assert len(t) == 6264 + 6 * 4 * 2
    got = _pairs(t.addr, t.length)
    assert got[0] == (G, 4096)
    assert got[1] == (G + 8192, 4096)  # tensor 0, K, kernel block 1
    assert got[n_phys] == (G + 4096, 4096)  # tensor 0, V, kernel block 0
    assert got[2 * n_phys + 5] == (2 * G + 5 * 8192, 4096)  # tensor 1, K, kernel block 5
    m = 6264
    assert got[m] == (G, 24576)  # slot 0, x, block 0
    assert got[m + 1] == (G + 2138112, 24576)  # slot 0, x, block 1
    assert got[m + 2] == (G + 24576, 6144)  # slot 0, B, block 0
    assert got[m + 5] == (G + 30720 + 2138112, 6144)  # slot 0, C, block 1
    assert got[m + 7] == (G + 36864 + 2138112, 2097152)  # slot 0, SSM, block 1
    assert got[m + 8] == (2 * G, 24576)  # slot 1, x, block 0
    assert got[-1] == (6 * G + 36864 + 2138112, 2097152)


def test_nano_fp8_032_pins() -> None:
    # 0.32: kernel block = block (ratio 1), K+V packed in one 2,138,112-byte descriptor per block.
    side = _plan("nano-fp8", "0.32").prefill
    t = local_table(side, _bases(side), 3)
    assert (t.num_fa_descs, len(t)) == (6 * 3, 6 * 3 + 6 * 4 * 3)
    got = _pairs(t.addr, t.length)
    assert got[:4] == [(G, 2138112), (G + 2138112, 2138112), (G + 2 * 2138112, 2138112), (2 * G, 2138112)]
    assert got[18 + 3] == (G + 24576, 6144)  # slot 0, B, block 0


def test_nano_tp2_spans_pin() -> None:
    # TP 2 halves every conv and SSM section: x 12,288 B, B/C 3,072 B, SSM 1,048,576 B at 18,432.
    side = _plan("nano-fp8", "0.20", ptp=2, dtp=2).prefill
    page = side.page_size_bytes
    t = local_table(side, _bases(side), 1)
    got = _pairs(t.addr, t.length)[t.num_fa_descs:]
    assert got[:4] == [(G, 12288), (G + 12288, 3072), (G + 15360, 3072), (G + 18432, 1048576)]
    assert page >= 18432 + 1048576


CASES = [("nano-fp8", v) for v in ("0.20", "0.24", "0.25", "0.32", "0.33")] + [
    ("super", "0.22"), ("jamba", "0.32"), ("qwen3-next", "0.32"), ("jamba", "0.25")]


@pytest.mark.parametrize("model,version", CASES)
def test_local_table_equals_the_loop(model: str, version: str) -> None:
    side = _plan(model, version, ptp=2, dtp=2).prefill
    n_log, kvd, kp = 3, side.profile.kv_descs_per_block, side.kernel_page_bytes
    spans = list(side.mamba.desc_spans()) if side.mamba is not None and side.mamba_groups else []
    want = _loop(_bases(side), n_phys=n_log * side.physical_per_logical, n_log=n_log, kernel_page=kp,
                 fa_offsets=[h * kp // kvd for h in range(kvd)] if side.attention_groups else [], fa_len=kp // kvd,
                 slots=side.num_ssm_slots, page=side.page_size_bytes, spans=spans)
    t = local_table(side, _bases(side), n_log)
    assert t.addr.dtype == np.uint64 and t.length.dtype == np.uint64
    assert _pairs(t.addr, t.length) == want
    if side.profile.strided_descriptors:
        assert _pairs(*strided_rows(side, _bases(side), n_log).expanded()) == want


def _remote_loop(p: SideLayout, src: SourceRead, bases: list[int], n_log: int) -> list[tuple[int, int]]:
    kvd, kp = p.profile.kv_descs_per_block, p.kernel_page_bytes
    if not p.attention_groups:
        offs, ln = [], 0
    elif src.fa is None:
        offs, ln = [0, kp // 2][:kvd], 0
    else:
        v = src.fa_v_offset if src.fa_v_offset is not None else src.fa[0] + kp // 2
        offs, ln = [src.fa[0], v][:kvd], src.fa[1]
    return _loop(bases, n_phys=n_log * p.physical_per_logical, n_log=n_log, kernel_page=kp, fa_offsets=offs,
                 fa_len=ln, slots=p.num_ssm_slots, page=p.page_size_bytes, spans=list(src.mamba_spans))


@pytest.mark.parametrize("version,ptp,dtp", [("0.20", 2, 1), ("0.20", 1, 2), ("0.32", 2, 4), ("0.32", 4, 2)])
def test_remote_table_equals_the_loop(version: str, ptp: int, dtp: int) -> None:
    plan = _plan("nano-fp8", version, ptp=ptp, dtp=dtp)
    p = plan.prefill
    bases = _bases(p)
    seen = 0
    for route in plan.routes:
        for src in route.sources:
            t = remote_table(p, src, bases, 2)
            assert _pairs(t.addr, t.length) == _remote_loop(p, src, bases, 2)
            seen += 1
    assert seen >= max(ptp, dtp)
