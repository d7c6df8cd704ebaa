"""`hybridpd serve`: launch P/D vLLM servers (NixlConnector) and the routing proxy, or print/emit the plan."""

from __future__ import annotations

import re
import shlex
import sys
from typing import TYPE_CHECKING, Any

import click

from ._options import BoundedInt, FiniteFloatRange, ModelArg, engine_options, settings_from
from ._output import Report, Table, Verdict, emit_json, emit_report, hint, output_options, resolve_format

if TYPE_CHECKING:
    from hybridpd.launch.commands import LaunchOptions, LaunchPlan


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env_pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for v in value:
        if "=" not in v:
            raise click.BadParameter(f"{v!r}: use KEY=VALUE")
        k, _, val = v.partition("=")
        if not _ENV_NAME.fullmatch(k):
            raise click.BadParameter(f"{k[:40]!r} is not an environment variable name: use letters, digits and _, "
                                     "not starting with a digit (e.g. VLLM_LOGGING_LEVEL=DEBUG)")
        out.append((k, val))
    return tuple(out)


def _command(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A command line given as one string (split like the shell would): it must split, into something."""
    if value is None:
        return None
    try:
        parts = shlex.split(value)
    except ValueError as e:  # "No closing quotation", "No escaped character"
        raise click.BadParameter(f"cannot split {value[:60]!r}: {e} (quote it as in sh, e.g. 'python vllm_cli.py')") from None
    if not parts:
        raise click.BadParameter("is empty: give a command, e.g. 'python vllm_cli.py', or leave the option out")
    return value


@click.command(context_settings={"ignore_unknown_options": False})
@click.argument("model", type=ModelArg())
@click.option("--role", type=click.Choice(["prefill", "decode", "proxy", "all"]), default="all", show_default=True,
              help="What to run here: one side, the proxy, or everything supervised.")
@click.option("--num-prefill", type=BoundedInt(1, 64), default=1, show_default=True, help="P instances.")
@click.option("--num-decode", type=BoundedInt(1, 64), default=1, show_default=True, help="D instances.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP bind host of every process.")
@click.option("--prefill-port", type=click.IntRange(1, 65535), default=8100, show_default=True,
              help="HTTP port of prefill-0 (prefill-i: +i).")
@click.option("--decode-port", type=click.IntRange(1, 65535), default=8200, show_default=True,
              help="HTTP port of decode-0 (decode-i: +i).")
@click.option("--proxy-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--side-channel-host", default="127.0.0.1", show_default=True,
              help="VLLM_NIXL_SIDE_CHANNEL_HOST (an address D can reach).")
@click.option("--side-channel-port", type=click.IntRange(1, 65535), default=5600, show_default=True,
              help="VLLM_NIXL_SIDE_CHANNEL_PORT base; instance k (P first, then D) gets base + k.")
@click.option("--gpus", "--cpus", "devices", default=None,
              help="Devices to split across instances in order, e.g. 0-3: GPUs (CUDA_VISIBLE_DEVICES) on cuda, "
                   "cores (VLLM_CPU_OMP_THREADS_BIND) on cpu. Default: 0..N-1 / all cores.")
@click.option("--cores-per-rank", type=BoundedInt(1, 4096), default=1, show_default=True,
              help="CPU cores per TP rank (cpu).")
@click.option("--cpu-kvcache-space", type=BoundedInt(1, 1 << 20), default=1, show_default=True,
              help="VLLM_CPU_KVCACHE_SPACE in GiB (cpu).")
@click.option("--ucx-net-devices", default=None, help="UCX_NET_DEVICES (default: lo for a loopback side channel).")
@click.option("--env", "extra_env", multiple=True, callback=_env_pairs, help="KEY=VALUE for every vLLM server.")
@click.option("--prefill-arg", "prefill_args", multiple=True, help="Extra vllm serve argument for P only.")
@click.option("--decode-arg", "decode_args", multiple=True, help="Extra vllm serve argument for D only.")
@click.option("--vllm-python", type=click.Path(dir_okay=False), default=None,
              help="Python of the venv with vLLM (default: this one). Its distribution picks the entry point.")
@click.option("--vllm-command", default=None, callback=_command,
              help="Command used like `vllm` (CMD serve MODEL ...), e.g. 'python vllm_cli.py'.")
@click.option("--proxy-command", default=None, callback=_command, help="Proxy command (default: python -m hybridpd_cli proxy).")
@click.option("--router", type=click.Choice(["hybridpd", "vllm-router"]), default="hybridpd", show_default=True,
              help="What routes between P and D: hybridpd's proxy, or vllm-router (pip install vllm-router) with "
                   "the same P and D URLs.")
@click.option("--vllm-router", "vllm_router", default=None,
              help="vllm-router executable for --router vllm-router (default: $HYBRIDPD_VLLM_ROUTER, then PATH).")
@click.option("--policy", type=click.Choice(["round_robin", "least_outstanding"]), default="round_robin",
              show_default=True, help="Proxy routing policy.")
@click.option("--auto-block-size", is_flag=True, help="Apply the plan's recommended --block-size to P and D.")
@click.option("--force", is_flag=True, help="Launch despite error findings.")
@click.option("--dry-run", is_flag=True, help="Print the launch plan (shell lines; --json: data); start nothing.")
@click.option("--check", "check", is_flag=True,
              help="Validate the generated arguments with vLLM's own parser (needs vLLM in --vllm-python).")
@click.option("--emit", type=click.Choice(["k8s"]), default=None, help="Write Kubernetes manifests instead.")
@click.option("-o", "--output", "output", default="-", show_default=True, help="File for --emit (- = stdout).")
@click.option("--target", "k8s_target", type=click.Choice(["plain", "llm-d", "lws"]), default=None,
              help="--emit k8s: plain Deployments + hybridpd proxy, llm-d (InferencePool, EPP, decode routing "
                   "sidecar), or lws (the same routing over an LWS DisaggregatedSet). Default: plain.")
@click.option("--image", default=None,
              help="vLLM image (--emit k8s). Default: vllm/vllm-openai:vX.Y.Z of the release the plan targets.")
@click.option("--namespace", default=None, help="Namespace (--emit k8s).")
@click.option("--llm-d", "llm_d", is_flag=True, help="Same as --target llm-d (kept for old scripts).")
@click.option("--k8s-name", default="hybridpd", show_default=True, help="Name stem of the emitted objects.")
@click.option("--k8s-model", default=None,
              help="The model as pods see it (Hugging Face id, or a path inside the image or a volume). "
                   "Default: the plan's Hugging Face id.")
@click.option("--proxy-image", default="hybridpd:0.1.0", show_default=True,
              help="Image with hybridpd for the plain target's proxy (built from the repository's Dockerfile).")
@click.option("--sidecar-image", default=None, help="llm-d routing sidecar image (default: pinned release).")
@click.option("--epp-image", default=None, help="llm-d endpoint picker image (default: pinned release).")
@click.option("--gateway", default="inference-gateway", show_default=True,
              help="Gateway the llm-d/lws HTTPRoute attaches to (--emit k8s).")
@click.option("--grace", type=FiniteFloatRange(min=0), default=30.0, show_default=True,
              help="Stop budget: the proxy drains in-flight requests for GRACE-10 s (then ends them with an "
                   "error event), then D, then P stop; a stage still running after GRACE s is SIGKILLed.")
@click.option("--health-timeout", type=FiniteFloatRange(min=1), default=900.0, show_default=True,
              help="Seconds to wait for /health.")
@click.option("--restart", "restart", type=click.Choice(["no", "on-failure"]), default="no", show_default=True,
              help="on-failure: restart a process that exits or stops answering /health (backoff, limit); "
                   "no: stop everything (fail fast).")
@click.option("--restart-limit", type=click.IntRange(0, 1000), default=5, show_default=True,
              help="Restarts per process; the count resets after 10 min of health.")
@click.option("--restart-backoff", type=FiniteFloatRange(0, 3600), default=2.0, show_default=True,
              help="Seconds before the first restart; doubled each time, at most 60 s.")
@click.option("--liveness-timeout", type=FiniteFloatRange(1, 86400), default=30.0, show_default=True,
              help="A healthy process that does not answer /health for this long is treated as dead (hung).")
@click.option("--health-interval", type=FiniteFloatRange(0.1, 3600), default=5.0, show_default=True,
              help="Seconds between /health probes once healthy.")
@click.option("--deployment-file", default=None,
              help="Where to record what was launched (JSON, for verify/doctor --deployment). "
                   "Default: $XDG_STATE_HOME/hybridpd/deployment-ROLE-PROXYPORT.json.")
@click.option("--prefill-timeout", type=FiniteFloatRange(0.1, 86400), default=None,
              help="Proxy: whole prefill leg, then 504 (proxy default 180 s).")
@click.option("--decode-first-byte-timeout", type=FiniteFloatRange(0.1, 86400), default=None,
              help="Proxy: streams, until D's first byte (proxy default 180 s).")
@click.option("--decode-idle-timeout", type=FiniteFloatRange(0.1, 86400), default=None,
              help="Proxy: streams, longest gap between chunks (proxy default 120 s).")
@click.option("--decode-timeout", type=FiniteFloatRange(0.1, 86400), default=None,
              help="Proxy: whole decode leg (proxy default 1800 s).")
@click.option("--proxy-arg", "proxy_args", multiple=True,
              help="Extra argument for the hybridpd proxy (hybridpd proxy --help), repeatable.")
@click.option("--nixl-progress-delay-us", type=click.IntRange(0, 1_000_000), default=None,
              help="Poll timeout of NIXL's progress thread in P and D (NIXL's Python wrapper sets 0: one idle core "
                   "spins per agent). Default: 1000 on cpu, 0 on cuda; 0 = leave NIXL alone.")
@click.option("--kv-lease", type=FiniteFloatRange(1, 86400), default=None,
              help="kv_lease_duration (s) in kv_connector_extra_config: how long P keeps KV blocks for D "
                   "(vLLM default 30 s).")
@engine_options
@output_options
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(model: str, vllm_args: tuple[str, ...], as_json: bool, fmt: str | None, **kw: Any) -> None:
    """Launch P/D vLLM servers with the NixlConnector for MODEL, and the routing proxy.

    Arguments after `--` go to every `vllm serve` unchanged. The plan's findings run first: an error
    stops the launch and prints its fix.

    \b
    Examples:
      hybridpd serve nano-fp8 --ptp 1 --dtp 1 --gpus 0-1 --dry-run
      hybridpd serve ./tiny-llama --platform cpu --vllm-python /venvs/vllm/bin/python \\
          --dry-run --json -- --load-format dummy --seed 0
      hybridpd serve ./tiny-llama --platform cpu --vllm-python /venvs/vllm/bin/python --check
      hybridpd serve nano --ptp 2 --dtp 2 --emit k8s --target llm-d -o pd.yaml
    """
    from hybridpd.launch import serve as modes
    from hybridpd.launch.commands import build_launch_plan
    from hybridpd.launch.entry import platform_for_entry, resolve_entry

    p, d = settings_from(kw)
    if kw["emit"] == "k8s" and kw["image"]:  # an image tag of another release is planned for that release
        from hybridpd.launch.k8s.base import release_for_image

        kw["vllm_version"] = release_for_image(kw["image"], kw["vllm_version"])
    entry, warning = resolve_entry(kw["vllm_command"], kw["vllm_python"])
    if warning and not (kw["dry_run"] or kw["emit"]):
        hint(f"warning: {warning}")
    platform, line = platform_for_entry(kw["platform"], entry, given=_given("platform"))
    if line:
        hint(line)
    lp = build_launch_plan(model, prefill=p, decode=d, options=_options(kw, vllm_args), entry=entry,
                           vllm_version=kw["vllm_version"], platform=platform, allow_network=kw["allow_network"])
    for line in modes.plan_hints(lp):
        hint(line)
    if kw["emit"] == "k8s":
        return _emit_k8s(lp, kw)
    if kw["check"]:
        checked = modes.check_args(lp, kw["vllm_python"])
        if as_json:
            emit_json(checked.as_dict(lp if kw["dry_run"] else None))
        else:
            for line in checked.lines():
                click.echo(line)
        if not checked.ok:
            raise SystemExit(1)
        if not kw["dry_run"]:
            return
    if kw["dry_run"]:
        if not (as_json and kw["check"]):  # --check --json already printed the plan inside its JSON
            _dry_run(lp, as_json, fmt)
        return
    if kw["role"] in ("proxy", "all") and kw["router"] == "hybridpd" and not kw["proxy_command"]:
        from .proxy import api_keys_from_env  # the proxy inherits the environment: refuse a blank key before anything starts

        api_keys_from_env("--no-auth" in kw["proxy_args"])
    from hybridpd.launch.deployment import default_path

    from ._output import HealthProgressDisplay

    code = modes.launch(
        lp, model_arg=model, record_path=kw["deployment_file"] or default_path(kw["proxy_port"], kw["role"]),
        on_ready=lambda path: hint(f"deployment recorded in {path} (hybridpd verify --deployment {shlex.quote(path)})"),
        progress=HealthProgressDisplay() if sys.stderr.isatty() else None, grace_s=kw["grace"],
        health_timeout_s=kw["health_timeout"], restart=kw["restart"], restart_limit=kw["restart_limit"],
        backoff_s=kw["restart_backoff"], liveness_timeout_s=kw["liveness_timeout"],
        health_interval_s=kw["health_interval"])
    if code:
        raise SystemExit(code)


def _given(name: str) -> bool:
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def _options(kw: dict[str, Any], vllm_args: tuple[str, ...]) -> LaunchOptions:
    """The parsed flags as the library's LaunchOptions (the proxy's timeouts and stop budget become its argv)."""
    from hybridpd.launch.commands import LaunchOptions, parse_devices
    from hybridpd.launch.serve import PROXY_TIMEOUTS, proxy_args

    ours = not kw["proxy_command"] and kw["router"] == "hybridpd"
    return LaunchOptions(
        role=kw["role"], num_prefill=kw["num_prefill"], num_decode=kw["num_decode"], host=kw["host"],
        prefill_port=kw["prefill_port"], decode_port=kw["decode_port"], proxy_port=kw["proxy_port"],
        side_channel_host=kw["side_channel_host"], side_channel_port=kw["side_channel_port"],
        devices=parse_devices(kw["devices"], field_name="--gpus/--cpus"), cores_per_rank=kw["cores_per_rank"],
        cpu_kvcache_space=kw["cpu_kvcache_space"], ucx_net_devices=kw["ucx_net_devices"],
        extra_args=tuple(vllm_args), prefill_args=tuple(kw["prefill_args"]), decode_args=tuple(kw["decode_args"]),
        extra_env=kw["extra_env"], proxy_policy=kw["policy"],
        proxy_command=tuple(shlex.split(kw["proxy_command"])) if kw["proxy_command"] else None,
        router=kw["router"], router_executable=kw["vllm_router"],
        proxy_args=proxy_args(kw["proxy_args"], {k: kw[k] for k in PROXY_TIMEOUTS},
                              grace=float(kw["grace"]) if ours else None),
        kv_extra_config=(("kv_lease_duration", kw["kv_lease"]),) if kw["kv_lease"] is not None else (),
        nixl_progress_delay_us=0 if kw["emit"] else kw["nixl_progress_delay_us"],
        auto_block_size=kw["auto_block_size"], allow_errors=kw["force"])


def _dry_run(lp: LaunchPlan, as_json: bool, fmt: str | None) -> None:
    """The plan: shell lines by default (a script that starts it), JSON with --json, tables with --fmt."""
    from hybridpd.launch import serve as modes

    out = resolve_format(as_json, fmt) if as_json or fmt else None
    if out is None:
        click.echo("\n".join(lp.shell_lines()))
    elif out == "json":
        emit_json(lp.to_dict())
    else:
        level, text = modes.verdict(lp)
        tables = [Table(title="processes", headers=modes.PROCESS_HEADERS, rows=modes.process_rows(lp), heading_columns=2)]
        if lp.findings:
            tables.append(Table(title="findings", headers=modes.FINDING_HEADERS, rows=modes.finding_rows(lp),
                                heading_columns=2))
        emit_report(Report(verdict=Verdict(level, text), tables=tables, notes=[f"note: {n}" for n in lp.notes]), out)


def _emit_k8s(lp: LaunchPlan, kw: dict[str, Any]) -> None:
    from hybridpd.launch.k8s.manifests import K8sOptions, build_manifests, to_yaml, write_output
    from hybridpd.launch.serve import k8s_target

    m = build_manifests(lp, K8sOptions(
        target=k8s_target(kw["k8s_target"], kw["llm_d"]), name=kw["k8s_name"], namespace=kw["namespace"],
        image=kw["image"], proxy_image=kw["proxy_image"], sidecar_image=kw["sidecar_image"],
        epp_image=kw["epp_image"], model=kw["k8s_model"], vllm_version=kw["vllm_version"],
        allow_errors=kw["force"], gateway=kw["gateway"]))
    for n in m.notes:
        hint(f"note: {n}")
    if kw["output"] == "-":
        click.echo(to_yaml(m.docs), nl=False)
        return
    written = write_output(m, kw["output"])
    hint(f"wrote {len(m.docs)} objects ({m.target}, compat {m.compat_key}, {m.image}) to {kw['output']}"
         + (f" ({len(written)} files)" if len(written) > 1 else ""))
