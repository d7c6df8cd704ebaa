"""Fuzz `hybridpd plan` / `serve -o` with hostile inputs (#15), every case in its own forked child with a
wall-clock limit and an address-space limit, and count the outcomes.

Categories (tests/fuzz_cases.py builds them): configs (every bundled config with each key the family reads set
to wrong types, out-of-range, huge, 5,001-digit, NaN/Infinity, deeply nested or degenerate values, deleted;
whole-file damage: truncated, invalid UTF-8, top-level array; special files: FIFO, /dev/zero, directory,
64 MiB file), flag sets (sizes without unit, inf/nan, huge TP/ISL, calibration files with a 1e-320 bandwidth,
FIFOs), and output paths for --plot / serve -o (symlinks, devices, directories, FIFOs, missing parents).

Outcomes: ok (ran, JSON strict), refused (exit 2, one `Error:` line naming a key of that family), traceback,
hang (over --limit-s), memory (MemoryError or killed at the limit), bad-json (NaN/Infinity in --json),
accepted-bad (an invalid value exited 0/1), wrong-field (the error names no key of that family, or another
family's key), not-one-line, files (a file case's side effects were wrong, or the input was modified).

    python bench/fuzz_inputs.py                              # ~7,000 configs + 600 flag sets + file cases
    python bench/fuzz_inputs.py --tree /tmp/old-checkout     # the same cases against another checkout
    python bench/fuzz_inputs.py --configs 500 --flags 100 --show 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def run_forked(fc, case, base: Path, limit_s: float, mem_extra: int) -> tuple[str, str, float]:  # type: ignore[no-untyped-def]
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        argv = fc.materialize(case, work)
        cfg = work / "m" / "config.json"
        before = cfg.read_bytes() if cfg.is_file() and not cfg.is_symlink() else None
        r, w = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # child
            os.close(r)
            try:
                lim = _vm_bytes() + mem_extra
                resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
                os.chdir(work)
                code, out, err, exc = fc.run_inprocess(argv)
                payload = json.dumps({"code": code, "out": out[-200_000:], "err": err[-20_000:], "exc": exc})
            except BaseException as e:  # noqa: BLE001
                payload = json.dumps({"code": None, "out": "", "err": "", "exc": f"harness: {type(e).__name__}: {e}"})
            data = payload.encode()
            while data:
                n = os.write(w, data)
                data = data[n:]
            os._exit(0)
        os.close(w)
        chunks: list[bytes] = []
        deadline = t0 + limit_s
        timed_out = False
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(r)
        secs = time.perf_counter() - t0
        if timed_out:
            return "hang", f"over {limit_s} s", secs
        if not chunks:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            return "memory", f"child died (signal {sig})", secs
        res = json.loads(b"".join(chunks))
        if res["exc"] and res["exc"].startswith("harness:"):
            return "harness", res["exc"], secs
        outcome = fc.classify(case, res["code"], res["out"], res["err"], exc=res["exc"], seconds=secs,
                              limit_s=limit_s)
        detail = (res["exc"] or res["err"]).strip().splitlines()[-1:] if (res["exc"] or res["err"]) else [""]
        if outcome in ("ok", "refused"):
            if before is not None and cfg.read_bytes() != before:
                return "files", "input config.json was modified", secs
            if case.kind == "file":
                bad = fc.check_files(case, work, res["code"])
                if bad:
                    return "files", bad, secs
        return outcome, detail[0][:300], secs
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=None, help="Run against this checkout (its hybridpd and cli/), e.g. an old commit.")
    ap.add_argument("--configs", type=int, default=7000, help="Config cases (sampled, seeded).")
    ap.add_argument("--flags", type=int, default=600, help="Flag-set cases.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, default=10.0, help="Wall-clock limit per case.")
    ap.add_argument("--mem-mib", type=int, default=1024, help="Address space a case may add to the parent's.")
    ap.add_argument("--show", type=int, default=5, help="Examples to print per bad outcome.")
    ap.add_argument("--json", dest="json_out", default=None, help="Write counts and examples to this file.")
    ap.add_argument("--only", choices=["configs", "flags", "files"], default=None, help="Run one group.")
    a = ap.parse_args()
    if a.tree:
        tree = Path(a.tree).resolve()
        link = tree / "hybridpd_cli"
        if not link.exists():
            link.symlink_to("cli")
        sys.path.insert(0, str(tree))
    sys.path.insert(0, str(HERE.parent / "tests"))
    import fuzz_cases as fc  # noqa: E402
    import hybridpd_cli.main  # noqa: F401  - imported once in the parent, shared by every fork
    import hybridpd_cli.plan  # noqa: F401

    import hybridpd

    print(f"hybridpd from {Path(hybridpd.__file__).parent}", file=sys.stderr)
    for warm in (["plan", "nano", "--json"], ["plan", "nano", "--json", "--calibration", "/nonexistent"],
                 ["serve", "nano", "--emit", "k8s", "-o", "-"]):  # import everything once, before the forks
        fc.run_inprocess(warm)
    all_cfg = fc.config_cases(seed=a.seed)
    import random

    rng = random.Random(a.seed)
    cfg_cases = all_cfg if len(all_cfg) <= a.configs else rng.sample(all_cfg, a.configs)
    groups = {"configs": cfg_cases, "flags": fc.flag_cases(a.flags, seed=a.seed), "files": fc.file_cases()}
    if a.only:
        groups = {a.only: groups[a.only]}
    base = Path(tempfile.mkdtemp(prefix="hpd-fuzz-"))
    report: dict[str, object] = {}
    try:
        for name, cases in groups.items():
            counts: Counter[str] = Counter()
            examples: dict[str, list[str]] = {}
            t0 = time.perf_counter()
            slow = 0.0
            for case in cases:
                outcome, detail, secs = run_forked(fc, case, base, a.limit_s, a.mem_mib << 20)
                slow = max(slow, secs)
                if outcome == "ok" and case.must_fail:
                    outcome = "accepted-bad"
                counts[outcome] += 1
                if outcome not in ("ok", "refused"):
                    examples.setdefault(outcome, []).append(f"{case.id[:140]} -> {detail}")
            wall = time.perf_counter() - t0
            print(f"{name}: {len(cases)} cases in {wall:.1f} s (slowest {slow:.2f} s): {fc.summarize(counts)}")
            for outcome, ex in sorted(examples.items()):
                for e in ex[:a.show]:
                    print(f"  {outcome}: {e}")
            report[name] = {"cases": len(cases), "seconds": round(wall, 1), "slowest_s": round(slow, 2),
                            "counts": dict(counts), "examples": {k: v[:50] for k, v in examples.items()}}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
