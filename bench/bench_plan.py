"""Cold start of ``hybridpd plan``: N fresh processes per output, beside a ``python -c pass`` baseline.

Each run is a new interpreter (imports and all), stdout piped, as a script or a shell prompt would see
it.  Outputs: ``--json``, plain text (the piped default: tabulate ``simple``) and ``--fmt rich``.  The
runs interleave (baseline, json, plain, rich, baseline, ...) so a burst of load hits all of them.
Prints median / min / max wall seconds and the median's ratio to the baseline, one SUMMARY line per
output, then checks that every release profile in ``hybridpd.core.profiles`` still plans (cold,
``--vllm-version X --json``) and that ``plan`` imports neither torch nor vllm.  Goal (issue #21): every
median under 0.15 s on an idle 2-core machine.

    python bench/bench_plan.py [--runs 30] [--model nano-fp8] [--args "--ptp 2 --dtp 2"] [--goal 0.15]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAIN = "import sys; from hybridpd_cli.main import main; sys.exit(main(sys.argv[1:]))"
# `plan` must stay free of heavy imports: the child reports what it loaded, at exit
CHECK = ("import atexit, sys\n"
         "atexit.register(lambda: sys.stderr.write('BENCH_HEAVY %s\\n' % ','.join(m for m in ('torch', 'vllm', 'numpy') "
         "if m in sys.modules)))\n" + MAIN.replace("; ", "\n"))


def _cmd() -> list[str]:
    """The installed ``hybridpd`` script when it sits beside this interpreter (what users run), else -c."""
    script = Path(sys.executable).with_name("hybridpd")
    return [str(script)] if script.exists() else [sys.executable, "-c", MAIN]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess[bytes]]:
    """(wall seconds, CPU seconds of the child, the result)."""
    c, t = _cpu(), time.perf_counter()
    p = subprocess.run(argv, capture_output=True, env=env)
    wall, cpu = time.perf_counter() - t, _cpu() - c
    if p.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-2000:]}")
    return wall, cpu, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="cold runs per output (default 30)")
    ap.add_argument("--model", default="nano-fp8")
    ap.add_argument("--args", default="--ptp 2 --dtp 2", help="plan options (default: '--ptp 2 --dtp 2')")
    ap.add_argument("--goal", type=float, default=0.15, help="median wall seconds to stay under (default 0.15)")
    ap.add_argument("--compare", metavar="DIR", help="also time a second tree (DIR holds hybridpd/ and hybridpd_cli/, "
                                                     "e.g. an older copy), interleaved in the same run")
    a = ap.parse_args()
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("HYBRIDPD_DEBUG", None)
    plan = [*_cmd(), "plan", a.model, *shlex.split(a.args)]
    ops = {"python -c pass (baseline)": [sys.executable, "-c", "pass"],
           "plan --json": [*plan, "--json"],
           "plan (piped plain text)": plan,
           "plan --fmt rich": [*plan, "--fmt", "rich"]}
    if a.compare:
        old = [sys.executable, "-c", f"import sys; sys.path.insert(0, {a.compare!r}); {MAIN}", "plan", a.model,
               *shlex.split(a.args)]
        ops |= {"[compare] plan --json": [*old, "--json"], "[compare] plan (piped plain)": old,
                "[compare] plan --fmt rich": [*old, "--fmt", "rich"]}
    for argv in ops.values():  # warm the page cache and the .pyc files; not timed
        _run(argv, env)
    walls: dict[str, list[float]] = {name: [] for name in ops}
    cpus: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(a.runs):
        for name, argv in ops.items():
            wall, cpu, _ = _run(argv, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    base = statistics.median(walls["python -c pass (baseline)"])
    print(f"{a.runs} cold runs each, stdout piped: {shlex.join(plan[len(_cmd()):])}; cpu = the child's user+sys "
          "(steadier than wall on a busy machine)")
    print(f"{'what':28} {'median s':>9} {'min s':>8} {'max s':>8} {'x baseline':>11} {'cpu med s':>10} {'cpu min s':>10}")
    for name, ws in walls.items():
        print(f"{name:28} {statistics.median(ws):9.3f} {min(ws):8.3f} {max(ws):8.3f} {statistics.median(ws) / base:11.2f} "
              f"{statistics.median(cpus[name]):10.3f} {min(cpus[name]):10.3f}")

    from hybridpd.core.profiles import PROFILES

    missing = []
    for prof in PROFILES:
        *_, p = _run([sys.executable, "-c", CHECK, "plan", a.model, *shlex.split(a.args), "--vllm-version", prof.name,
                     "--json"], env)
        heavy = [ln.split(" ", 1)[1] for ln in p.stderr.decode().splitlines() if ln.startswith("BENCH_HEAVY")]
        if json.loads(p.stdout)["vllm_profile"] != prof.name:
            missing.append(prof.name)
        if heavy and heavy[-1].strip():
            raise SystemExit(f"plan --vllm-version {prof.name} imported {heavy[-1].strip()}")
    if missing:
        raise SystemExit(f"profiles that do not plan as themselves: {', '.join(missing)}")
    failed = False
    for name, ws in walls.items():
        med = statistics.median(ws)
        verdict = "" if name.startswith(("python", "[compare]")) else (" ok" if med < a.goal else " OVER GOAL")
        failed |= verdict == " OVER GOAL"
        print(f"SUMMARY plan cold start {name}: median {med:.3f} s (min {min(ws):.3f}, max {max(ws):.3f}), "
              f"x{med / base:.2f} the baseline, +{med - base:.3f} s over it, cpu median {statistics.median(cpus[name]):.3f} s"
              f"{verdict}")
    print(f"SUMMARY plan profiles: all {len(PROFILES)} release profiles plan cold "
          f"({PROFILES[0].name} ... {PROFILES[-1].name}), no torch/vllm/numpy import")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
