"""Benchmark `hybridpd convert` on a large file against a plain file copy and an in-memory torch copy.

Writes a >= 2 GB safetensors file of Nano-shaped SD conv states (the worst case for convert: every
byte is transposed), checks that SD->DS->SD gives the same data back, then measures in fresh child
processes, the order rotating each repeat, with a sync and a pause before each run:

- ``copy``: shutil.copyfile (kernel copy_file_range) + fsync, the floor for any file-to-file tool;
- ``convert SD->DS``: the real CLI (``hybridpd convert ... --to DS --model nano``), fsync included,
  with each ``--checksum`` (xxh3, the default; crc32; sha256; none);
- ``torch memcpy``: ``dst.copy_(src)`` of the same bytes already in RAM (memory bandwidth);
- with ``--device cuda``: the CLI with ``--device cuda``, and the GPU section below.

GPU section (``--device cuda``, or alone and in well under a minute with ``--gpu-only``): on one device, the
same in-process data, CUDA events, warm-up, best of ``--gpu-reps``: a plain device-to-device copy of the
same bytes (the ceiling), then SD->DS and DS->SD of a bf16 conv state (as int16, ``--gpu-len`` x
``--gpu-dim``, ``--gpu-mib`` MiB) by the old torch strided copy and by ``hybridpd.convert.gpu_transpose.channel_copy``
variants "flat" and "tile" (each checked against the torch copy first).  GB/s counts the tensor's bytes
once; "of d2d" = copy time / this time.  The last line of stdout is a one-line JSON summary.

Wall time includes interpreter start and ``import torch``; "core" is what the command reports for
the conversion itself (torch already imported).  Peak RSS is each child's VmHWM (``import torch`` alone
is ~220 MiB for the CPU build, ~500 MiB for the CUDA build).  Files are deleted at the end.

    python bench/bench_convert.py                    # 2 GiB in $TMPDIR
    python bench/bench_convert.py --size-gb 4 --dir /data --repeat 5 --json
    python bench/bench_convert.py --device cuda      # on a GPU machine
    python bench/bench_convert.py --gpu-only         # just the GPU kernels (no files, no CLI)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL = "nano"  # conv dim 6144 at TP 1, state_len 3, bf16: 36,864 B per layer per block


def _env(shim: Path) -> dict[str, str]:
    env = dict(os.environ)
    try:
        import hybridpd_cli  # noqa: F401
    except ImportError:  # repo not installed (e.g. a bare GPU machine): expose cli/ as hybridpd_cli
        shim.mkdir(exist_ok=True)
        link = shim / "hybridpd_cli"
        if not link.exists():
            link.symlink_to(REPO / "cli")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(shim), env.get("PYTHONPATH", "")])
    return env


def make_input(path: Path, size: int) -> tuple[int, int, int]:
    """Stream a Nano-shaped SD conv state file of about ``size`` bytes; returns (file bytes, blocks, layers)."""
    import torch

    sys.path.insert(0, str(REPO))
    from hybridpd.convert.files import AtomicFile, Writer
    from hybridpd.convert.plan import Geometry
    from hybridpd.core.families import model_spec
    from hybridpd.core.models import resolve

    spec = model_spec(resolve(MODEL))
    assert spec.mamba is not None
    geo = Geometry(dims=spec.mamba, model=spec.model_id)
    dim, L = geo.rank_state(1).conv.dim, geo.state_len
    layers = [c.index for c in spec.mamba_layers]
    row = L * dim * 2
    blocks = -(-size // (len(layers) * row))
    entries = [(f"model.layers.{i}.mixer.conv_state", "BF16", (blocks, L, dim), blocks * row) for i in layers]
    pool = torch.randint(-32768, 32767, (64 << 19,), dtype=torch.int16).numpy().tobytes()  # 64 MiB
    w = Writer(AtomicFile(path, force=True), entries, {"source": "bench_convert"}, checksum="none")
    pos = 0
    for name, _, _, nbytes in entries:
        w.begin(name)
        left = nbytes
        while left:
            k = min(left, len(pool) - pos % len(pool))
            w.write(memoryview(pool)[pos % len(pool):][:k])
            pos, left = pos + k, left - k
    w.finish({})
    return path.stat().st_size, blocks, len(layers)


# Every child prints its own peak RSS (VmHWM) at exit: ru_maxrss of a child would include the parent's
# high-water mark, which Linux carries across fork and exec.
HWM = """
import atexit, sys
def _hwm():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                sys.stderr.write("BENCH_PEAK_RSS %d\\n" % (int(line.split()[1]) * 1024))
    except OSError:
        pass
atexit.register(_hwm)
"""
CLI = HWM + "from hybridpd_cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def settle() -> None:
    """Flush dirty pages and give the filesystem a moment (ext4 with `discard` trims freed blocks late),
    so one run's deleted output does not slow the next run's writes."""
    os.sync()
    time.sleep(1.0)


def child(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Run argv; (wall seconds, peak RSS bytes, stdout)."""
    t = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, env=env)
    wall = time.perf_counter() - t
    err = p.stderr.decode()
    if p.returncode:
        raise SystemExit(f"{argv[:6]} failed ({p.returncode}): {err[-2000:]}")
    peak = [int(line.split()[1]) for line in err.splitlines() if line.startswith("BENCH_PEAK_RSS")]
    return wall, (peak[-1] if peak else 0), p.stdout.decode()


COPY = HWM + """
import os, shutil, sys, time, json
t = time.perf_counter(); shutil.copyfile(sys.argv[1], sys.argv[2])
fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd); os.close(fd)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""
MEMCPY = HWM + """
import json, sys, time, torch
n = int(sys.argv[1]); src = torch.empty(n, dtype=torch.uint8); dst = torch.empty_like(src)
with open(sys.argv[2], "rb", buffering=0) as f: f.readinto(memoryview(src.numpy()))
dst.copy_(src); best = 1e9
for _ in range(3):
    t = time.perf_counter(); dst.copy_(src); best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best}))
"""


def gpu_bench(device: str, length: int, dim: int, nbytes: int, reps: int) -> dict[str, Any]:
    """Time d2d copy, torch strided copy and channel_copy's variants on one device (see the module doc)."""
    import torch

    sys.path.insert(0, str(REPO))
    from _cuda_timing import best_time  # beside this script

    from hybridpd.convert.gpu_transpose import VARIANTS, _torch_copy, channel_copy, triton_available

    if torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))  # the timing events record on the current device

    rows = max(1, nbytes // (length * dim * 2))
    sd = torch.randint(-32768, 32767, (rows, length, dim), dtype=torch.int16, device=device)
    ds = sd.transpose(1, 2).contiguous()
    out_sd, out_ds, dst = torch.empty_like(sd), torch.empty_like(ds), torch.empty_like(sd)

    def timed(fn: Any) -> float:
        return best_time(fn, reps)

    res: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "bytes": sd.numel() * 2, "rows": rows,
                           "L": length, "C": dim, "triton": triton_available(), "d2d_copy_s": timed(lambda: dst.copy_(sd))}

    def direction(out: Any, lay_o: str, inp: Any, lay_i: str, want: Any) -> dict[str, float]:
        r = {"torch_s": timed(lambda: _torch_copy(out, lay_o, 0, inp, lay_i, 0, dim))}
        for v in VARIANTS if res["triton"] else ():
            out.zero_()
            channel_copy(out, lay_o, 0, inp, lay_i, 0, dim, variant=v)
            if not torch.equal(out, want):
                raise SystemExit(f"channel_copy variant {v!r} {lay_i}->{lay_o} gives wrong data")
            r[f"{v}_s"] = timed(lambda v=v: channel_copy(out, lay_o, 0, inp, lay_i, 0, dim, variant=v))
        return r

    res["SD->DS"] = direction(out_ds, "DS", sd, "SD", ds)
    res["DS->SD"] = direction(out_sd, "SD", ds, "DS", sd)
    return res


def gpu_summary(gpu: dict[str, Any]) -> dict[str, Any]:
    """GB/s and fraction of the d2d copy for every timing in ``gpu`` (flat, JSON-ready)."""
    n, d2d = gpu["bytes"], gpu["d2d_copy_s"]
    out = {k: gpu[k] for k in ("device", "bytes", "rows", "L", "C", "triton")}
    out["d2d_GBps"] = round(n / d2d / 1e9, 1)
    for name in ("SD->DS", "DS->SD"):
        for what, t in gpu[name].items():
            key = f"{name}.{what.removesuffix('_s')}"
            out[f"{key}.GBps"], out[f"{key}.of_d2d"] = round(n / t / 1e9, 1), round(d2d / t, 3)
    return out


def print_gpu(gpu: dict[str, Any]) -> None:
    s = gpu_summary(gpu)
    print(f"GPU {s['device']}: {s['bytes'] / 2**20:.0f} MiB int16 conv state ({s['rows']} x L={s['L']} x C={s['C']}); "
          f"d2d copy {s['d2d_GBps']} GB/s (GB/s = tensor bytes / time; of d2d = copy time / this time)")
    for name in ("SD->DS", "DS->SD"):
        for what in gpu[name]:
            key = f"{name}.{what.removesuffix('_s')}"
            print(f"  {key:14} {s[key + '.GBps']:8.1f} GB/s  {s[key + '.of_d2d']:.3f} of d2d")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="input size in GiB (default 2)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (needs ~3x the size free)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda to add the GPU measurements")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU section: no files, no CLI runs")
    ap.add_argument("--gpu-len", type=int, default=3, help="GPU section: state_len L (default 3)")
    ap.add_argument("--gpu-dim", type=int, default=6144, help="GPU section: conv channels C (default 6144, Nano TP 1)")
    ap.add_argument("--gpu-mib", type=int, default=1024, help="GPU section: conv state size in MiB (default 1024)")
    ap.add_argument("--gpu-reps", type=int, default=10, help="GPU section: timed repeats, best kept (default 10)")
    ap.add_argument("--make-input", nargs=2, metavar=("PATH", "BYTES"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make_input:
        print(json.dumps(make_input(Path(a.make_input[0]), int(a.make_input[1]))))
        return
    if a.gpu_only:
        gpu = gpu_bench(a.device if a.device.startswith("cuda") else "cuda", a.gpu_len, a.gpu_dim, a.gpu_mib << 20,
                        a.gpu_reps)
        print_gpu(gpu)
        print(json.dumps(gpu_summary(gpu)))
        return
    size = int(a.size_gb * (1 << 30))
    free = shutil.disk_usage(a.dir).free
    if free < 3.2 * size:
        raise SystemExit(f"{a.dir} has {free / 2**30:.1f} GiB free; need {3.2 * size / 2**30:.1f} (use --dir)")
    work = Path(tempfile.mkdtemp(prefix="hybridpd-bench-", dir=a.dir))
    env = _env(work / "shim")
    py = sys.executable
    try:
        src, dst, back = work / "state.sd.safetensors", work / "state.ds.safetensors", work / "back.safetensors"
        t = time.perf_counter()
        _, _, made = child([py, __file__, "--make-input", str(src), str(size)], env)  # keeps this process lean
        nbytes, blocks, layers = json.loads(made)
        print(f"input: {src} {nbytes / 2**30:.2f} GiB ({blocks} blocks x {layers} layers, bf16 SD) written in "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
        with open(src, "rb") as f:  # warm the page cache: every measurement reads a cached input
            while f.read(64 << 20):
                pass
        cli = [py, "-c", CLI, "convert"]
        conv = [*cli, str(src), str(dst), "--to", "DS", "--model", MODEL, "--json", "--no-progress"]
        ops: list[tuple[str, list[str]]] = [
            ("plain file copy (copy_file_range + fsync)", [py, "-c", COPY, str(src), str(dst)]),
            ("convert SD->DS (default: xxh3)", conv),
            ("convert SD->DS --checksum crc32", [*conv, "--checksum", "crc32"]),
            ("convert SD->DS --checksum sha256", [*conv, "--checksum", "sha256"]),
            ("convert SD->DS --checksum none", [*conv, "--checksum", "none"])]
        if a.device.startswith("cuda"):
            ops.append((f"convert SD->DS --device {a.device}", [*conv, "--device", a.device]))
        ops.append(("torch in-memory copy (same bytes)", [py, "-c", MEMCPY, str(nbytes), str(src)]))
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in ops}
        summary: dict[str, Any] = {}
        _, _, out = child(conv, env)  # correctness first: SD->DS->SD gives the source's data back
        summary = json.loads(out)
        _, _, out2 = child([*cli, str(dst), str(back), "--to", "SD", "--json", "--no-progress"], env)
        same = json.loads(out2)["checksums"][str(back)] == summary["checksums"][str(src)]
        print(f"round trip SD->DS->SD bit-identical: {same}", file=sys.stderr)
        if not same:
            raise SystemExit("round trip mismatch")
        for p in (dst, back):
            p.unlink()
        for i in range(a.repeat):  # the order rotates, so no operation always follows the same one
            for name, argv in ops[i % len(ops):] + ops[:i % len(ops)]:
                settle()
                wall, rss, out = child(argv, env)
                runs[name].append((wall, json.loads(out)["seconds"], rss))
                dst.unlink(missing_ok=True)
        gpu = None
        if a.device.startswith("cuda"):
            _, _, out = child([py, __file__, "--gpu-only", "--device", a.device, "--gpu-len", str(a.gpu_len),
                               "--gpu-dim", str(a.gpu_dim), "--gpu-mib", str(a.gpu_mib), "--gpu-reps", str(a.gpu_reps)], env)
            gpu = json.loads(out.strip().splitlines()[-1])
        report(runs, nbytes, gpu, summary, a.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(runs: dict[str, list[tuple[float, float, int]]], nbytes: int, gpu: dict[str, Any] | None,
           summary: dict[str, Any], as_json: bool) -> None:
    rows = []
    copy_core = statistics.median(r[1] for r in runs["plain file copy (copy_file_range + fsync)"])
    for name, rs in runs.items():
        core = statistics.median(r[1] for r in rs)
        rows.append({"what": name, "runs": len(rs), "core_s_median": round(core, 3),
                     "core_s_best": round(min(r[1] for r in rs), 3),
                     "wall_s_median": round(statistics.median(r[0] for r in rs), 3),
                     "GBps_core": round(nbytes / core / 1e9, 3), "vs_copy": round(copy_core / core, 2),
                     "peak_rss_MiB": round(max(r[2] for r in rs) / 2**20, 1)})
    if as_json:
        print(json.dumps({"file_bytes": nbytes, "results": rows, "gpu": gpu,
                          "convert_summary": {k: summary.get(k) for k in ("tensors_converted", "bytes_read",
                                                                          "bytes_written", "bytes_per_second")}},
                         indent=2))
        return
    print(f"file: {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB); GB/s = file bytes / core seconds; "
          "vs_copy = copy time / this time")
    print(f"{'what':46} {'core s':>8} {'best s':>8} {'wall s':>8} {'GB/s':>7} {'vs copy':>8} {'peak RSS':>10}")
    for r in rows:
        print(f"{r['what']:46} {r['core_s_median']:8.3f} {r['core_s_best']:8.3f} {r['wall_s_median']:8.3f} "
              f"{r['GBps_core']:7.2f} {r['vs_copy']:8.2f} {r['peak_rss_MiB']:8.1f} MiB")
    if gpu:
        print(f"GPU {gpu['device']}: d2d copy {gpu['d2d_GBps']} GB/s; " + ", ".join(
            f"{k.removesuffix('.of_d2d')} {v}x" for k, v in gpu.items() if k.endswith(".of_d2d")) + " of the copy")


if __name__ == "__main__":
    main()
