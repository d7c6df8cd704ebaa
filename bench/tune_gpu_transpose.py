"""Sweep the conv-state conversion kernels' launch parameters on a GPU; each figure a ratio to a device copy.

    python bench/tune_gpu_transpose.py [--bytes 1073741824] [--repeat 20] [--out DIR]

Super's conv state (L = 3, C = 10,240, int16 elements): SD -> DS, DS -> SD and the TP-4 slice of x (rank 1's
quarter, SD -> DS shard), for each kernel variant, block and num_warps; every configuration's output is
checked against torch before it is timed.  The device copy (``copy_`` of the same bytes) is timed
interleaved with the configurations, so the ratio is within one run.  Prints one line per configuration and,
last, the best per operation; writes tune_gpu_transpose.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _cuda_timing import best_time  # noqa: E402 (bench/ is the script's own directory)


def best_ms(fn: Any, repeat: int) -> float:
    return best_time(fn, repeat, warmup=1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--blocks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import torch

    from hybridpd.convert.gpu_transpose import DS, SD, VARIANTS, channel_copy
    from hybridpd.core.families import model_spec
    from hybridpd.core.models import resolve

    dims = model_spec(resolve("super")).mamba
    assert dims is not None
    L = dims.conv_kernel - 1
    C = dims.intermediate_size + 2 * dims.n_groups * dims.state_size
    q = dims.intermediate_size // 4  # --tp-split 4: rank 1's quarter of x
    rows = max(1, a.bytes // (L * C * 2))
    sd = torch.randint(-32768, 32767, (rows, L, C), dtype=torch.int16, device="cuda")
    ds = torch.empty(rows, C, L, dtype=torch.int16, device="cuda")
    back = torch.empty_like(sd)
    shard = torch.empty(rows, q, L, dtype=torch.int16, device="cuda")
    want_ds = sd.transpose(1, 2).contiguous()
    want_shard = sd[:, :, q:2 * q].transpose(1, 2).contiguous()
    ops = {
        "sd_to_ds": (lambda **k: channel_copy(ds, DS, 0, sd, SD, 0, C, **k), lambda: torch.equal(ds, want_ds), sd.numel() * 2),
        "ds_to_sd": (lambda **k: channel_copy(back, SD, 0, want_ds, DS, 0, C, **k), lambda: torch.equal(back, sd),
                     sd.numel() * 2),
        "slice_tp4": (lambda **k: channel_copy(shard, DS, 0, sd, SD, q, q, **k), lambda: torch.equal(shard, want_shard),
                      shard.numel() * 2),
    }
    copy_ms = {}
    results = []
    for name, (fn, ok, nbytes) in ops.items():
        src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda")
        dst = torch.empty_like(src)
        copy = partial(dst.copy_, src)
        copy_ms[name] = best_ms(copy, a.repeat)
        for v in VARIANTS:
            for blk in [int(b) for b in a.blocks.split(",")]:
                for w in [int(b) for b in a.warps.split(",")]:
                    try:
                        ms = best_ms(lambda: fn(variant=v, block=blk, num_warps=w), a.repeat)  # noqa: B023
                    except Exception as e:  # noqa: BLE001 - a configuration triton cannot build is reported, not fatal
                        print(f"{name} {v} block {blk} warps {w}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                        continue
                    good = ok()
                    ref = best_ms(copy, max(3, a.repeat // 4))  # the copy again, interleaved
                    ratio = ref / ms
                    results.append({"op": name, "variant": v, "block": blk, "num_warps": w, "ms": ms, "copy_ms": ref,
                                    "ratio": ratio, "correct": good})
                    print(f"{name} {v} block {blk} warps {w}: {ms:.3f} ms, copy {ref:.3f} ms, {ratio:.3f}x, "
                          f"{nbytes / ms / 1e6:.0f} GB/s{'' if good else ' WRONG'}", flush=True)
    print("best per operation (ratio to a device copy of the same bytes, same run):")
    for name in ops:
        rs = [r for r in results if r["op"] == name and r["correct"]]
        b = max(rs, key=lambda r: r["ratio"])
        d = [r for r in rs if r["variant"] == "flat" and r["block"] == 2048 and r["num_warps"] == 4]
        dflt = f"; today's default flat/2048/4: {d[0]['ratio']:.3f}x" if d else ""
        print(f"  {name}: {b['variant']} block {b['block']} warps {b['num_warps']}: {b['ratio']:.3f}x{dflt}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "tune_gpu_transpose.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows, "L": L, "C": C, "copy_ms": copy_ms, "results": results},
        indent=1))


if __name__ == "__main__":
    main()
