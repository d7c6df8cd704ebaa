"""Measure what NIXL's per-transfer telemetry ``descCount`` reports for vLLM 0.33-style Nx5 strided descriptor
lists, against the same layout registered as flat (addr, len, dev) rows (vLLM <= 0.32).

Loopback READ between two agents in one process, CPU (DRAM) memory, UCX.  Needs nixl (>= 1.5 for Nx5 lists).
    UCX_NET_DEVICES=lo python scripts/nixl_strided_desccount.py [--json]
Layout per side: T regions of N blocks; each block is one page of PAGE bytes.  An attention region is read as whole
pages (FA row: len = stride = PAGE); a Mamba region as 4 sub-rows per block (x, B, C, SSM; len < stride = PAGE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

T, N, PAGE = 3, 16, 4096
MAMBA_SPANS = [(0, 512), (512, 256), (768, 256), (1024, 2048)]  # (offset, len) inside a page: x, B, C, SSM


def _agent(name: str):  # type: ignore[no-untyped-def]
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, capture_telemetry=True))


def rows(base: int, strided: bool) -> np.ndarray:
    """FA rows for regions 0..T-2, Mamba rows (4 per block) for region T-1, in vLLM's order (FA first)."""
    out: list[tuple[int, int, int, int, int]] = []
    for r in range(T - 1):
        out.append((base + r * N * PAGE, PAGE, 0, PAGE, N))
    mb = base + (T - 1) * N * PAGE
    for off, ln in MAMBA_SPANS:
        out.append((mb + off, ln, 0, PAGE, N))
    a = np.array(out, dtype=np.uint64)
    if strided:
        return a
    flat = [(int(ad) + k * int(st), int(ln), int(dv)) for ad, ln, dv, st, cnt in a for k in range(int(cnt))]
    return np.array(flat, dtype=np.uint64)


def ids(fa_blocks: list[int], mamba_block: int) -> np.ndarray:
    fa = [r * N + b for r in range(T - 1) for b in fa_blocks]
    m = [(T - 1) * N + m * N + mamba_block for m in range(len(MAMBA_SPANS))]
    return np.array(fa + m, dtype=np.int32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pre, dec = _agent("prefill"), _agent("decode")
    size = T * N * PAGE
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros_like(src)
    pre.register_memory([(src.ctypes.data, size, 0, "")], "DRAM")
    dec.register_memory([(dst.ctypes.data, size, 0, "")], "DRAM")
    rn = dec.add_remote_agent(pre.get_agent_metadata())
    cases = {
        "fa consecutive [1,2,3] + mamba 5": ([1, 2, 3], 5, [1, 2, 3], 5),
        "fa single [4] + mamba 4": ([4], 4, [4], 4),
        "fa non-consecutive local [1,3,5]": ([1, 3, 5], 7, [1, 2, 3], 7),
        "fa consecutive P, reversed D": ([1, 2, 3], 6, [3, 2, 1], 6),
        "fa consecutive [14,15] (region end)": ([14, 15], 9, [14, 15], 9),
    }
    results = []
    for layout_name, strided in (("flat Nx3 (<=0.32)", False), ("strided Nx5 (0.33)", True)):
        lr, rr = rows(dst.ctypes.data, strided), rows(src.ctypes.data, strided)
        lh = dec.prep_xfer_dlist("NIXL_INIT_AGENT", lr, "DRAM")
        rh = dec.prep_xfer_dlist(rn, rr, "DRAM")
        for case, (pfa, pm, dfa, dm) in cases.items():
            dst[:] = 0
            li, ri = ids(dfa, dm), ids(pfa, pm)
            h = dec.make_prepped_xfer("READ", lh, li, rh, ri, b"x")
            st = dec.transfer(h)
            while st == "PROC":
                pre.get_new_notifs()
                st = dec.check_xfer_state(h)
            tel = dec.get_xfer_telemetry(h)
            results.append({"layout": layout_name, "rows": int(lr.shape[0]), "case": case, "ids": int(li.size),
                            "state": st, "descCount": int(tel.descCount), "totalBytes": int(tel.totalBytes)})
            dec.release_xfer_handle(h)
        dec.release_dlist_handle(lh)
        dec.release_dlist_handle(rh)
    import importlib.metadata as md
    ver = next((md.version(d) for d in ("nixl-cu13", "nixl", "nixl-cu12") if _has(md, d)), "?")
    if args.json:
        json.dump({"nixl": ver, "T": T, "N": N, "page": PAGE, "results": results}, sys.stdout, indent=1)
        print()
    else:
        print(f"nixl {ver}; T={T} regions ({T - 1} FA, 1 Mamba x4 sub-rows), N={N} blocks, page {PAGE} B")
        for r in results:
            print(f"{r['layout']:20} rows={r['rows']:4} {r['case']:38} ids={r['ids']:3} {r['state']} "
                  f"descCount={r['descCount']} bytes={r['totalBytes']}")
    return 0


def _has(md, dist: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    raise SystemExit(main())
