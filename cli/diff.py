"""`hybridpd diff`: what an upgrade or a setting change does to a P/D deployment."""

from __future__ import annotations

import shlex
from typing import Any

import click
from click.core import ParameterSource

from hybridpd.core.settings import both_sides_params

from ._options import ModelArg, engine_options, isl_list, settings_from, target_from
from ._output import Report, Table, emit_json, emit_report, output_options, resolve_format

COMMON_ONLY = ("--isl", "--strict", "--exit-code", "--vary", "--b-recommended")


def _side_command() -> click.Command:
    """Every option `plan` takes that shapes one plan: the engine options plus --calibration/--link."""
    def side(**kw: Any) -> None:  # pragma: no cover - never invoked, only parsed
        pass

    f = click.option("--link", default=None)(side)
    f = click.option("--calibration", "calibration_path", type=click.Path(dir_okay=False), default=None)(f)
    return click.command("side", add_help_option=False)(engine_options(f))


SIDE = _side_command()


def parse_side(args: list[str], where: str) -> dict[str, Any]:
    """Parse plan options for one side; returns only what was given explicitly."""
    try:
        ctx = SIDE.make_context(where, list(args))
    except click.NoSuchOption as e:
        hint = f" ({e.option_name} is common to A and B: give it once, outside {where})" \
            if e.option_name in COMMON_ONLY else ""
        raise click.BadParameter(f"{e.format_message()}{hint}", param_hint=where) from None
    except click.ClickException as e:
        raise click.BadParameter(e.format_message(), param_hint=where) from None
    return {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}


_ON, _OFF = ("on", "yes", "true", "1"), ("off", "no", "false", "0")


def _vary_one(opt: str, value: str) -> dict[str, Any]:
    name = "--" + opt.lstrip("-")
    param = next((p for p in SIDE.params if isinstance(p, click.Option) and name in p.opts + p.secondary_opts), None)
    if param is None:
        raise click.BadParameter(f"{opt!r} is not a plan option (e.g. vllm-version, dtp, block-size, kv-cache-dtype)",
                                 param_hint="--vary")
    assert param.name is not None
    if value == "-":
        return {param.name: param.get_default(click.Context(SIDE))}
    if param.is_flag:
        v = value.lower()
        if v not in _ON + _OFF:
            raise click.BadParameter(f"{name} is a flag: give on or off, got {value!r}", param_hint="--vary")
        if param.secondary_opts:
            return parse_side([param.opts[0] if v in _ON else param.secondary_opts[0]], "--vary")
        return {param.name: v in _ON}
    return parse_side([param.opts[0], value], "--vary")


def _label(vary: tuple[tuple[str, str, str], ...], idx: int, text: str) -> str:
    parts = [f"--{t[0].lstrip('-')} {'(unset)' if t[idx] == '-' else t[idx]}" for t in vary]
    if text:
        parts.append(text)
    return " ".join(parts)


# plan options (click parameter names) that set both sides alike: from the settings table
_BOTH = tuple(x for x in both_sides_params() if x != "weights_memory")


def apply_options(p: Any, d: Any, over: dict[str, Any]) -> tuple[Any, Any]:
    """Plan options over a recorded (prefill, decode) EngineSettings pair, as settings_from would set them."""
    from dataclasses import replace

    pk: dict[str, Any] = {k: over[k] for k in _BOTH if k in over}
    if "weights_memory" in over:
        pk["weights_memory"] = over["weights_memory"] or 0
    dk = dict(pk)
    if "block_size" in over:
        pk["block_size"] = dk["block_size"] = over["block_size"]
    if over.get("p_block_size") is not None:
        pk["block_size"] = over["p_block_size"]
    if over.get("d_block_size") is not None:
        dk["block_size"] = over["d_block_size"]
    if "ptp" in over:
        pk["tp"] = over["ptp"]
    if "dtp" in over:
        dk["tp"] = over["dtp"]
    return replace(p, **pk), replace(d, **dk)


def _opt_text(over: dict[str, Any]) -> str:
    def one(k: str, v: Any) -> str:
        flag = "--" + k.replace("_path", "").replace("_", "-")
        return flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}"
    return " ".join(one(k, v) for k, v in over.items() if v is not None)


@click.command()
@click.argument("model", type=ModelArg(), required=False)
@engine_options
@click.option("--a", "-a", "a_opts", default="", metavar="OPTIONS",
              help='plan options for A over the common ones, quoted, e.g. --a "--vllm-version 0.24".')
@click.option("--b", "-b", "b_opts", default="", metavar="OPTIONS",
              help='plan options for B over the common ones, e.g. --b "--vllm-version 0.33 --dtp 4".')
@click.option("--vary", nargs=3, multiple=True, metavar="OPTION A B",
              help="Shorthand: one plan option with A's and B's value, e.g. --vary vllm-version 0.24 0.33, "
                   "--vary dtp 2 4, --vary kv-cache-dtype auto fp8, --vary block-size - 4176 ('-' = unset; flags "
                   "take on/off). Repeatable.")
@click.option("--b-recommended", is_flag=True,
              help="B = A with --block-size set to A's recommended block size (what plan's fix would cost).")
@click.option("--deployment", "deployment_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="A = the deployment `hybridpd serve` recorded in FILE (model, release, every engine setting); "
                   "B = the same plus the options given here: what a relaunch with them would change. No MODEL.")
@click.option("--isl", "isls", callback=isl_list, default=None,
              help="Input lengths to cost on both sides, comma-separated (k = 1024). Default: plan's.")
@click.option("--calibration", "calibration_path", type=click.Path(dir_okay=False), default=None,
              help="Transfer-time calibration JSON for both sides (per side: inside --a/--b).")
@click.option("--link", default=None, metavar="NAME", help="Calibration entry for both sides (per side: inside --a/--b).")
@click.option("--exit-code", is_flag=True, help="Exit 1 when A and B differ in anything shown (as git diff --exit-code).")
@click.option("--strict", is_flag=True, help="Exit 1 when B has an error finding that A has not.")
@output_options
def diff(model: str | None, a_opts: str, b_opts: str, vary: tuple[tuple[str, str, str], ...], b_recommended: bool,
         deployment_path: str | None, isls: tuple[int, ...] | None, exit_code: bool, strict: bool, as_json: bool,
         fmt: str | None, **base: Any) -> None:
    """Compare two plans of MODEL and show only what differs: layout, NIXL descriptors, bytes and
    descriptors per request, capacity, findings, and whether P and D of A and B can pair.

    A and B are the common options (the same ones `plan` takes) with per-side overrides from --a,
    --b and --vary; or A is a running deployment (--deployment FILE) and B the same with the options
    given. Exit 0 when the diff ran (see --exit-code and --strict), 2 on bad input.

    \b
    Examples:
      hybridpd diff nano --ptp 2 --dtp 2 --vary vllm-version 0.24 0.32
      hybridpd diff nano --ptp 2 --dtp 2 --a "--vllm-version 0.24" --b "--vllm-version 0.33"
      hybridpd diff nano-fp8 --ptp 2 --vary dtp 2 4
      hybridpd diff nano-fp8 --ptp 2 --dtp 4 --gpu-memory 141GB --b-recommended
      hybridpd diff --deployment ~/.local/state/hybridpd/deployment-all-8000.json --vllm-version 0.33
    """
    from hybridpd.core.diff import diff_to_dict, diff_variants

    try:
        a_args, b_args = shlex.split(a_opts), shlex.split(b_opts)
    except ValueError as e:
        raise click.UsageError(f"--a/--b: {e}; quote the options once, e.g. --b \"--dtp 4\"") from None
    over_a, over_b = {}, {}
    for opt, va, vb in vary:
        over_a.update(_vary_one(opt, va))
        over_b.update(_vary_one(opt, vb))
    over_a.update(parse_side(a_args, "--a"))
    over_b.update(parse_side(b_args, "--b"))
    if b_recommended and {"block_size", "p_block_size", "d_block_size"} & set(over_b):
        raise click.UsageError("--b-recommended sets B's --block-size; drop the block size from --b")
    origin = _Origin(model, deployment_path, base, isls)
    if origin.deployment is not None:
        ctx = click.get_current_context()
        given = {k: v for k, v in base.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE
                 and k not in ("calibration_path", "link", "allow_network")}  # those apply to A as well
        over_b = {**given, **over_b}
    def label(*parts: str) -> str:
        return " ".join(x for x in (origin.label, *parts) if x) or "(base options)"

    va = origin.variant(over_a, label(_label(vary, 1, a_opts)), "A")
    core_b = _label(vary, 2, b_opts)
    if origin.deployment is not None and not (vary or b_opts):
        core_b = _opt_text(over_b)
    if b_recommended:
        rec = va.plan.recommended_block_size
        if rec is None:
            raise click.UsageError("--b-recommended: A has no block-size recommendation (its P and D blocks already "
                                   "agree, or the model is not hybrid); set B's block size with --b \"--block-size N\"")
        over_b.update(block_size=rec, p_block_size=None, d_block_size=None)
        core_b = f"{core_b} --block-size {rec} (A's recommendation)".strip()
    label_b = label(core_b)
    vb = origin.variant(over_b, label_b, "B")
    data = diff_to_dict(diff_variants(va, vb))
    out = resolve_format(as_json, fmt)
    if out == "json":
        emit_json(data)
    else:
        emit_report(render(data), out)
    if (exit_code and not data["identical"]) or (strict and data["b_introduces_error"]):
        raise SystemExit(1)


class _Origin:
    """Where both variants start: the command line's common options, or a recorded deployment."""

    def __init__(self, model: str | None, deployment_path: str | None, base: dict[str, Any],
                 isls: tuple[int, ...] | None) -> None:
        from hybridpd.core.families import model_spec
        from hybridpd.core.models import resolve
        from hybridpd.errors import UsageError

        self.base, self.isls, self.deployment, self.label = base, isls, None, ""
        if deployment_path is not None:
            if model is not None:
                raise click.UsageError("MODEL comes from --deployment FILE: drop MODEL, or drop --deployment")
            from hybridpd.launch.deployment import load

            try:
                self.deployment = load(deployment_path)
            except UsageError as e:
                raise click.UsageError(str(e)) from None
            model, self.label = self.deployment.model, f"deployment {deployment_path}"
        elif model is None:
            raise click.UsageError("Missing argument 'MODEL' (or pass --deployment FILE).")
        self.spec = model_spec(resolve(model, allow_network=base["allow_network"]))

    def variant(self, over: dict[str, Any], label: str, which: str) -> Any:
        from hybridpd.core.diff import Variant
        from hybridpd.core.estimate import load_calibration, select
        from hybridpd.core.plan import build_plan
        from hybridpd.errors import UsageError

        kw = {**self.base, **over}
        try:
            if self.deployment is None:
                p, d = settings_from(kw)
                target, platform = target_from(kw), kw["platform"]
            else:
                p, d = apply_options(self.deployment.prefill, self.deployment.decode, over)
                target = target_from({"vllm_version": over.get("vllm_version") or self.deployment.vllm_version})
                platform = over.get("platform") or self.deployment.platform
            entry = select(load_calibration(kw["calibration_path"]), kw["link"], platform=platform)
            plan = build_plan(self.spec, prefill=p, decode=d, vllm_version=target, platform=platform, isls=self.isls)
        except UsageError as e:
            raise click.UsageError(f"{which} ({label}): {e}") from None
        return Variant(label=label, plan=plan, calibration=entry)


LABELS = {
    "num_kv_heads": "KV heads / rank", "attention_backend": "attention backend", "kv_cache_dtype": "KV dtype",
    "conv_dtype": "conv dtype", "ssm_dtype": "SSM dtype", "conv_state_shape": "conv state", "ssm_state_shape": "SSM state",
    "conv_state_bytes": "conv bytes", "ssm_state_bytes": "SSM bytes", "attn_bytes_per_token": "attention bytes / token",
    "attention_block_size": "attention block (tokens)", "kernel_block_sizes_supported": "kernel sizes supported",
    "kernel_block_size": "kernel block", "physical_per_logical": "kernel blocks per block (ratio)",
    "derived_ratio_v020": "ratio 0.20 derives", "page_size_bytes": "page (padded)", "kernel_page_bytes": "kernel page",
    "mamba_page_bytes": "Mamba page (unpadded)", "padding_bytes": "padding B", "padding_pct": "padding %",
    "num_shared_tensors": "layer slots (T)", "num_ssm_slots": "slots with Mamba descriptors",
    "conv_layout": "conv layout", "mamba_groups": "Mamba groups", "attention_groups": "attention groups",
    "prefix_caching": "prefix caching", "mamba_cache_mode": "mamba_cache_mode", "errors": "rejected by vLLM",
    "regions": "regions (T)", "fa_regions": "FA regions", "mamba_regions": "Mamba regions",
    "kv_descs_per_block": "FA descriptors per block", "fa_desc_bytes": "FA desc B", "x_desc_bytes": "x desc B",
    "B_desc_bytes": "B desc B", "C_desc_bytes": "C desc B", "ssm_desc_bytes": "SSM desc B", "row_format": "rows",
    "desc_id_formula": "desc id", "num_phys_blocks": "N_phys", "num_fa_descs": "num_fa_descs",
    "local_descs": "descriptors (flat)", "registered_rows": "rows registered", "tokens_transferred": "tokens moved",
    "logical_blocks": "blocks (L)", "bytes": "bytes moved", "fa_bytes": "FA bytes", "mamba_bytes": "Mamba bytes",
    "naive_bytes": "naive (padded) bytes", "descriptors": "descriptors", "descriptors_min": "descriptors coalesced",
    "descriptors_per_rank": "descriptors per D rank", "bytes_per_rank": "bytes per D rank", "reads": "READs",
    "est_request_s": "est. time",
    "blocks": "blocks that fit", "tokens": "tokens that fit", "vllm_version": "vLLM release",
    "vllm_profile": "profile", "nixl_connector_version": "NIXL connector", "platform": "platform",
    "calibration": "calibration", "local_part": "local part",
}
TITLES = {"settings": "Settings", "layout": "Per-side layout (per rank)", "groups": "HMA groups",
          "nixl": "NIXL layout (per rank)", "reads": "Per D rank reads (offset+length in P's page)",
          "transfer": "Per request, all D ranks", "capacity": "Capacity (per rank)"}
SCOPE = {"settings": "role", "layout": "role", "groups": "group", "nixl": "role", "reads": "D rank <- P rank",
         "transfer": "ISL", "capacity": "role"}


def _val(field: str, v: Any) -> Any:
    if field == "est_request_s" and isinstance(v, float):
        from .plan import fmt_seconds

        return fmt_seconds(v)
    if isinstance(v, list):
        return ", ".join(map(str, v)) if v else "-"
    return v


def _ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.4g}x ({(r - 1) * 100:+.1f}%)"


def render(data: dict[str, Any]) -> Report:
    rep = Report()
    a, b = data["a"], data["b"]
    rep.tables.append(Table(title=f"Diff {data['model']}", headers=["", "A", "B"], rows=[
        ["options", a["label"], b["label"]],
        ["vLLM / profile / connector", f"{a['vllm_version']} / {a['vllm_profile']} / v{a['nixl_connector_version']}",
         f"{b['vllm_version']} / {b['vllm_profile']} / v{b['nixl_connector_version']}"],
        ["TP (P / D)", f"{a['ptp']} / {a['dtp']}", f"{b['ptp']} / {b['dtp']}"],
        ["errors", ", ".join(a["error_codes"]) or "none", ", ".join(b["error_codes"]) or "none"]]))
    numeric = {"layout", "nixl", "transfer", "capacity"}
    for section, title in TITLES.items():
        rows = []
        for c in data["changes"]:
            if c["section"] != section:
                continue
            scope = c["scope"] if c["scope"] is not None else "-"
            row = [scope, LABELS.get(c["field"], c["field"]), _val(c["field"], c["a"]), _val(c["field"], c["b"])]
            if section in numeric:
                row.append(_ratio(c["ratio"]))
            rows.append(row)
        if rows:
            headers = [SCOPE[section], "field", "A", "B"] + (["B/A"] if section in numeric else [])
            if section == "groups":
                headers, rows = [SCOPE[section], "A", "B"], [[r[0], r[2], r[3]] for r in rows]
            rep.tables.append(Table(title=title, headers=headers, rows=rows))
    f = data["findings"]
    frows = sorted([["-", x["severity"], x["code"], x["message"]] for x in f["removed"]]
                   + [["+", x["severity"], x["code"], x["message"]] for x in f["added"]], key=lambda r: (r[2], r[0]))
    if frows:
        rep.tables.append(Table(title="Findings (- only in A, + only in B)", headers=["", "severity", "code", "message"],
                                rows=frows))
    pr = data["pairing"]
    prow = [[x["name"], x["a"], x["b"]] for x in pr["factors"] if x["name"] in pr["differing"]]
    prow += [[f"mixed pair P({m['prefill']}) -> D({m['decode']})", "", "ok" if m["ok"] else
              "fails: " + ", ".join(sorted({e["code"] for e in m["errors"]}))] for m in pr["mixed_pairs"]]
    if prow:
        rep.tables.append(Table(title="Pairing (NIXL compatibility hash)", headers=["factor", "A", "B"], rows=prow))
    if data["identical"]:
        rep.notes.append("A and B plan identically: nothing differs.")
    rep.notes.append(f"pairing: {pr['advice']}")
    return rep
