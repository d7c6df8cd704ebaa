"""`hybridpd verify`: diff expected against transferred bytes — a NIXL rehearsal, or a live deployment."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from ._options import (
    MAX_BYTES,
    MAX_TOKENS,
    MAX_TP,
    BoundedInt,
    FiniteFloatRange,
    ModelArg,
    engine_options,
    settings_from,
    target_from,
)
from ._output import Report, Table, emit_json, emit_report, hint, output_options, resolve_format

if TYPE_CHECKING:
    from hybridpd.verify.live import LiveResult, PassiveResult
    from hybridpd.verify.verdict import RehearsalResult


@click.command()
@click.argument("model", type=ModelArg(), required=False, default=None)
@engine_options
@click.option("--deployment", "deployment_file", default=None, metavar="FILE",
              help="Live mode against what `hybridpd serve` recorded: its model, release, platform, engine settings "
                   "and URLs (engine options given here override the record, with a note).")
@click.option("--rehearse", is_flag=True, help="Rehearse the transfer in real memory with NIXL (no GPU, no vLLM).")
@click.option("--isl", type=BoundedInt(1, MAX_TOKENS), default=None,
              help="Request length in tokens (rehearsal default: 1.5 blocks; live default: 1.5 blocks).")
@click.option("--seed", type=BoundedInt(0, 2**32 - 1), default=0, show_default=True,
              help="Seed of the full-model state and block ids.")
@click.option("--inject", type=click.Choice(["offset", "length"]), default=None,
              help="Fault injection: shift one remote descriptor by a block, or shorten one.")
@click.option("--inject-rank", type=BoundedInt(0, MAX_TP - 1), default=0, show_default=True,
              help="D rank whose first READ gets the fault.")
@click.option("--device", default="cpu", show_default=True,
              help="Where the rehearsal's KV tensors live: cpu (DRAM), cuda / cuda:N (VRAM, every rank on one GPU), "
                   "cuda:N,M (P ranks on GPU N, D ranks on GPU M).")
@click.option("--transport", type=click.Choice(["nixl", "numpy"]), default="nixl", show_default=True,
              help="nixl: one NIXL agent per rank in separate processes; numpy: in-process copies (no NIXL).")
@click.option("--max-rank-bytes", type=BoundedInt(1 << 20, MAX_BYTES), default=64 << 20, show_default=True,
              help="Cap on KV bytes per rank when --num-blocks is not given.")
@click.option("--decode", "decode_url", default=None, help="Live mode: decode server URL (reads its /metrics).")
@click.option("--prefill", "prefill_url", default=None, help="Live mode: prefill server URL.")
@click.option("--proxy", "proxy_url", default=None, help="Live mode: proxy URL (probes go through it).")
@click.option("--served-model-name", default=None, help="Live mode: model name in requests (default: MODEL).")
@click.option("--prompt-tokens", is_flag=True, help="Live mode: send token-id prompts so the length is exact.")
@click.option("--passive", is_flag=True, help="Live mode: no probes; diff counters over --window seconds.")
@click.option("--window", type=FiniteFloatRange(min=0.1), default=60.0, show_default=True)
@output_options
def verify(model: str | None, deployment_file: str | None, rehearse: bool, isl: int | None, seed: int,
           inject: str | None, inject_rank: int,
           device: str, transport: str, max_rank_bytes: int, decode_url: str | None, prefill_url: str | None,
           proxy_url: str | None, served_model_name: str | None, prompt_tokens: bool, passive: bool,
           window: float, as_json: bool, fmt: str | None, **kw: Any) -> None:
    """Check that P/D moves exactly the bytes the plan predicts, and the right ones.

    \b
    Examples:
    Rehearsal (no GPU, no vLLM):
      hybridpd verify nano-fp8 --ptp 1 --dtp 2 --rehearse
      hybridpd verify granite-tiny --ptp 1 --dtp 2 --rehearse --json     # fails: B/C corruption
      hybridpd verify MODEL --rehearse --inject offset                     # must fail
      hybridpd verify nano --ptp 2 --dtp 2 --rehearse --device cuda        # VRAM, GPU 0
      hybridpd verify nano --ptp 1 --dtp 4 --block-size 2096 --rehearse --device cuda:0,1
    Live:
      hybridpd verify MODEL --ptp 1 --dtp 1 --decode http://d:8200 --prefill http://p:8100
      hybridpd verify MODEL --decode http://d:8200 --proxy http://proxy:8000 --prompt-tokens
      hybridpd verify MODEL --decode http://d:8200 --passive --window 60
      hybridpd verify --deployment ~/.local/state/hybridpd/deployment-all-8000.json
    Exit 1 on any mismatch, 2 on a refused combination.
    """
    from hybridpd.core.plan import build_plan
    from hybridpd.errors import UsageError

    if deployment_file:
        if rehearse:
            raise UsageError("--deployment checks a running deployment; it cannot be combined with --rehearse",
                             field="--deployment")
        from hybridpd.launch.deployment import load

        dep = load(deployment_file)
        if model is not None and model != dep.model and model != dep.served_model_name:
            raise UsageError(f"MODEL {model!r} is not the deployment's model {dep.model!r}", field="MODEL",
                             fix="leave MODEL out with --deployment")
        model = dep.model
        p, d = deployment_settings(kw, dep)
        decode_url = decode_url or (dep.decode_urls[0] if dep.decode_urls else None)
        if not (prefill_url or proxy_url):
            proxy_url = dep.proxy_url
            prefill_url = None if proxy_url else (dep.prefill_urls[0] if dep.prefill_urls else None)
        served_model_name = served_model_name or dep.served_model_name
        prompt_tokens = True  # exact lengths: the probes sit on block boundaries
        if dep.state != "running":
            hint(f"warning: {deployment_file} says the deployment is {dep.state!r}")
        elif not dep.supervisor_alive():
            hint(f"warning: the supervisor recorded in {deployment_file} (pid {dep.record.get('supervisor_pid')}) "
                 "is not running here (another host, or it died)")
    elif model is None:
        raise UsageError("missing MODEL", field="MODEL", fix="give MODEL, or --deployment FILE written by serve")
    else:
        p, d = settings_from(kw)
    plan = build_plan(model, prefill=p, decode=d, vllm_version=target_from(kw), platform=kw["platform"],
                      allow_network=kw["allow_network"])
    out = resolve_format(as_json, fmt)
    if rehearse:
        if decode_url or prefill_url or proxy_url or passive:
            raise UsageError("--rehearse cannot be combined with live options", field="--rehearse")
        data: RehearsalResult | LiveResult | PassiveResult = _rehearse(
            plan, kw["num_blocks"], isl, seed, inject, inject_rank, transport, max_rank_bytes, device)
        render: Callable[[Any], Report] = render_rehearsal
    elif not decode_url:
        raise UsageError("choose a mode: --rehearse, or --decode URL for a live deployment", field="verify",
                         fix="add --rehearse")
    else:
        from hybridpd.verify import live

        if passive:
            data, render = live.run_passive(decode_url, plan, window), render_passive
        else:
            data = live.run_probes(decode_url, plan, served_model_name or model, isls=[isl] if isl else None,
                                   prefill_url=prefill_url, proxy_url=proxy_url, token_ids=prompt_tokens)
            render = render_probes
    assumed: dict[str, Any] | None = None
    if decode_url and not rehearse:
        from hybridpd.verify import live

        assumed = live.read_assumptions(decode_url, plan, from_record=bool(deployment_file))
    if out == "json":
        emit_json({**data.as_dict(), **({"assumptions": assumed} if assumed is not None else {})})
    else:
        rep = render(data)
        if assumed is not None:
            from hybridpd.verify import live

            rep.notes[:0] = live.assumption_lines(assumed)
        emit_report(rep, out)
    if not data.ok:
        raise SystemExit(1)


_SIDE_OPTS = {"ptp": ("tp", "prefill"), "dtp": ("tp", "decode"), "block_size": ("block_size", "both"),
              "p_block_size": ("block_size", "prefill"), "d_block_size": ("block_size", "decode")}


def deployment_settings(kw: dict[str, Any], dep: Any) -> tuple[Any, Any]:
    """P and D settings of the record; an engine option given on the command line overrides it (with a note).
    Sets kw's --vllm-version and --platform to the record's."""
    import dataclasses

    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = {k for k in kw if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT)}
    for k in ("vllm_version", "platform"):
        if k in given and str(kw[k]) != str(getattr(dep, k)):
            hint(f"note: --{k.replace('_', '-')} {kw[k]} overrides the deployment's {getattr(dep, k)}")
        elif k not in given:
            kw[k] = getattr(dep, k)
    cli_p, cli_d = settings_from(kw)
    p, d = dep.prefill, dep.decode
    fields = {f.name for f in dataclasses.fields(p)}
    for k in sorted(given):
        if k in _SIDE_OPTS:
            name, side = _SIDE_OPTS[k]
        elif k in fields:
            name, side = k, "both"
        else:
            continue
        if side in ("prefill", "both"):
            p = dataclasses.replace(p, **{name: getattr(cli_p, name)})
        if side in ("decode", "both"):
            d = dataclasses.replace(d, **{name: getattr(cli_d, name)})
        hint(f"note: --{k.replace('_', '-')} {kw[k]} overrides the deployment record")
    return p, d


def _rehearse(plan: Any, num_blocks: int | None, isl: int | None, seed: int, inject: str | None,
              inject_rank: int, transport: str, max_rank_bytes: int, device: str) -> RehearsalResult:
    from hybridpd.errors import UsageError
    from hybridpd.verify.nixl_agent import check_devices, parse_device
    from hybridpd.verify.rehearsal import make_setup
    from hybridpd.verify.verdict import run_in_memory, summarize

    placement = parse_device(device)
    if placement.on_gpu and transport == "numpy":
        raise UsageError("--transport numpy copies host memory only", field="--transport",
                         fix="use --transport nixl with --device cuda")
    check_devices(placement)

    setup = make_setup(plan, num_blocks=num_blocks, isl=isl, seed=seed, inject=inject, inject_rank=inject_rank,
                       max_rank_bytes=max_rank_bytes)
    for n in setup.notes:
        hint(n)
    if transport == "numpy":
        per_rank = run_in_memory(setup)
    else:
        from hybridpd.verify.nixl_agent import run_nixl

        per_rank = run_nixl(setup, device=placement)
    return summarize(setup, per_rank, transport, memory=placement.describe())


def render_rehearsal(data: RehearsalResult) -> Report:
    rep = Report()
    rows: list[Sequence[Any]] = []
    for r in data.per_rank:
        ec, mc, bad = r.expected_components, r.moved_components, r.mismatched_bytes
        for c in ec:  # FA, the model's conv sub-projections (x/B/C, x, Q/K/V), SSM
            if ec[c] or mc[c] or bad.get(c):
                rows.append([r.rank, c, ec[c], mc[c], bad.get(c, 0), "ok" if ec[c] == mc[c] and not bad.get(c)
                             else "MISMATCH"])
        for c in ("padding", "other"):
            if bad.get(c):
                rows.append([r.rank, c, 0, 0, bad[c], "MISMATCH"])
        tel = r.telemetry or {}
        rows.append([r.rank, "total", r.expected_bytes, r.moved_bytes, sum(bad.values()),
                     f"descs {r.moved_descriptors} (plan {r.expected_descriptors_min}-"
                     f"{r.expected_descriptors}), READs {r.reads}"
                     + (f", NIXL telemetry {tel['bytes']:,} B / {tel['descriptors']} descs" if tel else "")])
    rep.tables.append(Table(
        title=f"Rehearsal {data.model} P TP{data.ptp} -> D TP{data.dtp} (vLLM {data.vllm_profile}, "
              f"{data.transport}), ISL {data.isl} -> {data.tokens_transferred} tokens, "
              f"{data.num_blocks} blocks/rank",
        headers=["D rank", "component", "expected B", "moved B", "wrong B at D", "verdict"], rows=rows))
    if data.ucx_read_transports:
        rep.notes.append(f"KV memory: {data.memory}; UCX carried the READs over "
                         f"{', '.join(data.ucx_read_transports)} ({'; '.join(data.ucx_read_operations)})")
    for w in data.ucx_warnings:
        rep.notes.append(f"UCX: {w}")
    for f in data.findings:
        rep.notes.append(f"plan finding {f.code}: {f.message}")
    for r in data.per_rank:
        for i in r.injected:
            rep.notes.append(i)
        for m in r.mismatches:
            rep.notes.append("MISMATCH " + m)
    rep.notes.append("PASS: every D rank holds exactly its slice, bytes and descriptors match the plan"
                     if data.ok else "FAIL")
    return rep


def render_probes(data: LiveResult) -> Report:
    rep = Report()
    rows = [[p.isl, c.expected_bytes, c.moved_bytes, f"{c.expected_descriptors_min}-{c.expected_descriptors}",
             c.moved_descriptors, c.expected_transfers, c.transfers, "ok" if p.ok else "MISMATCH"]
            for p in data.probes for c in (p.comparison,)]
    rep.tables.append(Table(title=f"Live probes against {data.decode} (via {data.via})",
                            headers=["ISL", "expected B", "moved B", "expected descs", "descs", "expected READs",
                                     "READs", "verdict"], rows=rows))
    for p in data.probes:
        rep.notes.extend(f"ISL {p.isl}: {m}" for m in p.mismatches)
    if data.block_sizes_not_told_apart:
        rep.notes.append(f"these probes cannot tell block size {data.block_size} from "
                         f"{', '.join(map(str, data.block_sizes_not_told_apart))}")
    return _verdict_notes(rep, data.note, data.ok)


def render_passive(data: PassiveResult) -> Report:
    rep = Report()
    rep.tables.append(Table(title=f"Passive window {data.window_s} s (approximate)",
                            headers=["requests", "expected B (min..max)", "moved B", "verdict"],
                            rows=[[data.requests, f"{data.expected_bytes_min:,}..{data.expected_bytes_max:,}",
                                   data.moved_bytes, "ok" if data.ok else "MISMATCH"]]))
    rep.notes.extend(data.mismatches)
    return _verdict_notes(rep, data.note, data.ok)


def _verdict_notes(rep: Report, note: str, ok: bool) -> Report:
    rep.notes.append(note)
    rep.notes.append("HEALTHY" if ok else "NOT HEALTHY")
    return rep
