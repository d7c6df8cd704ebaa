"""`hybridpd plan`: the layout engine's report."""

from __future__ import annotations

from typing import Any

import click

from ._options import MAX_NUM_BLOCKS, BoundedInt, ModelArg, engine_options, isl_list, settings_from, target_from
from ._output import Report, Table, Verdict, emit_json, emit_report, fmt_bytes, output_options, resolve_format
from .completions import link_items


@click.command()
@click.argument("model", type=ModelArg())
@engine_options
@click.option("--isl", "isls", callback=isl_list, default=None,
              help="Input lengths to cost, comma-separated (k = 1024, e.g. 1k,8k,32k). Default: 1k,8k,32k,128k within "
                   "max-model-len.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write bytes per request vs input length (actual vs naive) to a PNG (needs matplotlib).")
@click.option("--speculative-config", "speculative_config", default=None, metavar="JSON",
              help='vLLM\'s --speculative-config for P and D, e.g. \'{"method":"mtp","num_speculative_tokens":3}\' '
                   "(sets --num-speculative-tokens; MTP drafter layers join the KV cache).")
@click.option("--strict", is_flag=True, help="Exit 1 on warnings too (a refused combination always exits 1).")
@click.option("--calibration", "calibration_path", type=click.Path(dir_okay=False), default=None,
              help="Transfer-time calibration JSON (schema hybridpd-calibration/1) for the per-request time "
                   "estimate reads x t0 + n_desc x c + bytes / bw. Default: the bundled table.")
@click.option("--link", default=None, metavar="NAME", shell_complete=link_items,
              help="Calibration entry to estimate with. Default: the first VRAM entry (--platform cuda) or DRAM "
                   "entry (--platform cpu).")
@click.option("--max-num-seqs", type=BoundedInt(1, MAX_NUM_BLOCKS), default=None,
              help="vLLM's --max-num-seqs on both sides, for the capacity check (default: vLLM's default).")
@click.option("--enforce-eager", is_flag=True,
              help="vLLM runs with --enforce-eager (no CUDA graphs: max_num_seqs may exceed the Mamba blocks).")
@output_options
def plan(model: str, isls: tuple[int, ...] | None, plot_path: str | None, strict: bool, calibration_path: str | None,
         link: str | None, max_num_seqs: int | None, enforce_eager: bool, as_json: bool, fmt: str | None,
         speculative_config: str | None, **kw: Any) -> None:
    """Predict vLLM's KV-cache layout and P/D transfer for MODEL, to the byte.

    MODEL is a bundled id or alias (see `hybridpd models`), a model directory or config.json, or a
    Hugging Face id in the local cache.

    The first line is the verdict: OK, or REFUSED with the number of errors and the top fix.
    Exit status: 0 when vLLM would accept the combination, 1 when a finding has severity error (the
    same rule as `serve` and `verify`), 2 for usage errors.

    \b
    Examples:
      hybridpd plan nano-fp8 --ptp 1 --dtp 4
      hybridpd plan nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8 --ptp 4 --dtp 4 \\
          --kv-cache-dtype fp8 --block-size 128 --vllm-version 0.20 --json
    """
    from hybridpd.core.estimate import MEMORY_OF_PLATFORM, load_calibration, select
    from hybridpd.core.plan import build_plan, plan_to_dict

    entries = load_calibration(calibration_path)
    entry = select(entries, link, platform=kw["platform"])
    p, d = settings_from(kw)
    if speculative_config is not None:
        p, d = with_speculative(p, d, speculative_config, kw["num_speculative_tokens"])
    target = target_from(kw)
    result = build_plan(model, prefill=p, decode=d, vllm_version=target, platform=kw["platform"],
                        isls=isls, allow_network=kw["allow_network"])
    data = plan_to_dict(result, estimate_with=entry)
    add_capacity(data, result, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager)
    if entry is None:
        data["calibration"] = None
    if plot_path:
        from hybridpd.core.plotting import plot_transfer

        plot_transfer(result, plot_path)
    data["verdict"] = verdict_dict(data, fix_holds_for(result, p, d, kw, target))
    out = resolve_format(as_json, fmt)
    if out == "json":
        emit_json(data)
    else:
        rep = render(data)
        if entry is None and data["transfer"]:
            rep.notes.append(f"est. time omitted: no {MEMORY_OF_PLATFORM[kw['platform']]} entry for --platform "
                             f"{kw['platform']} in {entries[0].source}; pass --calibration FILE with one, or --link NAME.")
        emit_report(rep, out)
    if not data["ok"] or (strict and data["verdict"]["warnings"]):
        raise SystemExit(1)


def add_capacity(data: dict[str, Any], result: Any, *, max_num_seqs: int | None, enforce_eager: bool) -> None:
    """data["capacity"] per side (hybridpd.core.capacity); its refusals join the findings and the verdict."""
    from hybridpd.core.capacity import plan_capacity

    cap = plan_capacity(result, max_num_seqs=(max_num_seqs, max_num_seqs), enforce_eager=(enforce_eager, enforce_eager))
    data["capacity"] = cap.as_dict()
    found = [f.as_dict() for f in cap.findings]
    if found:
        order = {"error": 0, "warning": 1, "info": 2}
        data["findings"] = sorted(data["findings"] + found, key=lambda f: order[f["severity"]])
        data["ok"] = data["ok"] and not any(f["severity"] == "error" for f in found)


def _capacity_rows(cap: dict[str, Any]) -> list[list[Any]]:
    p, d = cap["prefill"], cap["decode"]

    def at_max(c: dict[str, Any]) -> str:
        r = c["blocks_per_request_at_max_model_len"]
        return f"{r['blocks']:,} ({r['attention_blocks']:,} attention + {r['mamba_blocks']:,} Mamba)" if r else "-"

    def conc(c: dict[str, Any]) -> str:
        return "-" if c["max_concurrency"] is None else f"{c['max_concurrency']:,.2f}x ({c['kv_cache_tokens']:,} tokens)"

    def seqs(c: dict[str, Any]) -> str:
        return "-" if c["concurrency"] is None else f"{c['concurrency']:,} (limited by {c['limited_by']})"

    def flipped(c: dict[str, Any]) -> str:
        f = c["prefix_caching_flipped"]
        if not f or f["max_concurrency"] is None:
            return "-"
        return (f"{'on' if f['prefix_caching'] else 'off'} ({f['mamba_cache_mode']}): block {f['block_size']}, "
                f"{f['num_blocks']:,} blocks, {f['max_concurrency']:,.2f}x")

    rows: list[list[Any]] = [
        ["blocks that fit", p["num_blocks"], d["num_blocks"]],
        [f"blocks per request at {p['max_model_len'] or '-'} tokens", at_max(p), at_max(d)],
        ["max concurrency (vLLM's log)", conc(p), conc(d)],
        ["requests at once (max_num_seqs)", seqs(p), seqs(d)],
        *[[f"blocks per request at ISL {a['isl']:,}", f"{a['blocks']:,}", f"{b['blocks']:,}"]
          for a, b in zip(p["per_isl"], d["per_isl"], strict=True)],
        ["prefix caching flipped", flipped(p), flipped(d)],
    ]
    return rows


def with_speculative(p: Any, d: Any, text: str, num_tokens_flag: int) -> tuple[Any, Any]:
    """Both sides with --speculative-config applied (its num_speculative_tokens wins; a different
    --num-speculative-tokens beside it is a usage error)."""
    from dataclasses import replace

    from hybridpd.core.speculative import parse_speculative_config
    from hybridpd.errors import UsageError

    sc = parse_speculative_config(text)
    if num_tokens_flag and num_tokens_flag != sc.num_speculative_tokens:
        raise UsageError(f"--num-speculative-tokens {num_tokens_flag} contradicts --speculative-config's "
                         f"num_speculative_tokens {sc.num_speculative_tokens}", field="--num-speculative-tokens",
                         fix="drop --num-speculative-tokens; --speculative-config carries it")
    kw = dict(num_speculative_tokens=sc.num_speculative_tokens, speculative_method=sc.method,
              speculative_model=sc.model)
    return replace(p, **kw), replace(d, **kw)


def _conv_parts(p: dict[str, Any], d: dict[str, Any]) -> list[str]:
    """The conv sub-projections of this model (x/B/C Mamba2, x Mamba-1, Q/K/V GatedDeltaNet)."""
    split = p["conv_split"] or d["conv_split"]
    return [k for k in split if k != "state_len"] if split else ["x", "B", "C"]


def _side_rows(p: dict[str, Any], d: dict[str, Any]) -> list[list[Any]]:
    def shape(v: Any) -> str:
        return "x".join(map(str, v)) if v else "-"

    rows: list[list[Any]] = [
        ["TP", p["tp"], d["tp"]],
        ["KV heads / rank", p["num_kv_heads"], d["num_kv_heads"]],
        ["dtypes (kv / conv / ssm)", f"{p['kv_cache_dtype']} / {p['conv_dtype']} / {p['ssm_dtype']}",
         f"{d['kv_cache_dtype']} / {d['conv_dtype']} / {d['ssm_dtype']}"],
        ["conv state SD / DS", f"{shape(p['conv_state_shape_sd'])} / {shape(p['conv_state_shape_ds'])}",
         f"{shape(d['conv_state_shape_sd'])} / {shape(d['conv_state_shape_ds'])}"],
        [" / ".join(_conv_parts(p, d)) + " channels",
         *(" / ".join(str(s["conv_split"][k]) for k in _conv_parts(p, d)) if s["conv_split"] else "-"
           for s in (p, d))],
        ["SSM state", shape(p["ssm_state_shape"]), shape(d["ssm_state_shape"])],
        ["conv + ssm bytes", f"{p['conv_state_bytes']:,} + {p['ssm_state_bytes']:,}",
         f"{d['conv_state_bytes']:,} + {d['ssm_state_bytes']:,}"],
        ["attention bytes / token", p["attn_bytes_per_token"], d["attn_bytes_per_token"]],
        ["attention block (tokens)", p["attention_block_size"], d["attention_block_size"]],
        ["kernel block / ratio", f"{p['kernel_block_size']} / {p['physical_per_logical']}",
         f"{d['kernel_block_size']} / {d['physical_per_logical']}"],
        ["page (padded)", p["page_size_bytes"], d["page_size_bytes"]],
        ["Mamba page (unpadded)", p["mamba_page_bytes"], d["mamba_page_bytes"]],
        ["padding", f"{p['padding_bytes']:,} B ({p['padding_pct']:.2f}%)",
         f"{d['padding_bytes']:,} B ({d['padding_pct']:.2f}%)"],
        ["shared tensors (T)", p["num_shared_tensors"], d["num_shared_tensors"]],
        ["blocks that fit", p["num_blocks"], d["num_blocks"]],
    ]
    return rows


def fmt_seconds(s: float) -> str:
    """A duration for tables: µs below 1 ms, ms below 1 s, else s."""
    if s < 1e-3:
        return f"{s * 1e6:,.1f} µs"
    if s < 1:
        return f"{s * 1e3:,.2f} ms"
    return f"{s:,.2f} s"


def _est_cell(e: dict[str, Any]) -> str:
    cell = fmt_seconds(e["request_s"])
    if e["request_s_coalesced"] < e["request_s"] * (1 - 1e-9):
        cell += f" ({fmt_seconds(e['request_s_coalesced'])} coalesced)"
    return cell


def _est_note(c: dict[str, Any]) -> str:
    t0 = f"t0 = {c['per_read_us']:,.0f} µs per READ, " if c.get("per_read_us") else ""
    return (f"est. time: slowest D rank, {c.get('model', 'n_desc × c + bytes / bw')}, calibration '{c['name']}' "
            f"({c['transport']}, {c['memory']}: {t0}c = {c['per_descriptor_us']:,.2f} µs per descriptor, "
            f"bw = {c['bandwidth_gbps']:,.1f} GB/s; "
            f"{c['hardware']}; {c['software']}; measured {c['measured']}; from {c['source']}). n_desc as vLLM issues "
            "them; 'coalesced' = every contiguous run merged into one descriptor.")


def sp(v: list[int] | None) -> str:
    """A byte span as offset+length."""
    return f"{v[0]}+{v[1]}" if v else "-"


SEVERITY = {"error": "ERROR", "warning": "warning", "info": "info"}  # the JSON's words, errors shouted


def fix_holds_for(result: Any, p: Any, d: Any, kw: dict[str, Any], target: Any) -> dict[str, Any] | None:
    """Check the recommended --block-size under the dtypes the plan had to assume.

    A dtype flag left at 'auto' is resolved from the checkpoint's metadata, which may be missing or
    reconstructed; the fix is re-planned with every other plausible value (KV: the model dtype or fp8;
    NemotronH SSM state: float32 or float16) and the result says for which values it holds and, for the
    others, which block size would.
    """
    from dataclasses import replace

    from hybridpd.core.plan import build_plan
    from hybridpd.errors import HybridPDError

    rec = result.recommended_block_size
    if not rec:
        return None
    kv_now, ssm_now = result.prefill.dtypes.kv, result.prefill.dtypes.ssm
    alts: list[tuple[str, str, dict[str, str]]] = []
    if kw["kv_cache_dtype"] == "auto":
        for kv in dict.fromkeys((p.dtype or result.model.model_dtype, "fp8")):
            if kv != kv_now:
                alts.append(("KV", kv, {"kv_cache_dtype": kv}))
    if kw["mamba_ssm_cache_dtype"] == "auto" and result.model.family == "nemotron_h" and result.model.has_mamba:
        for ssm in ("float32", "float16"):
            if ssm != ssm_now:
                alts.append(("SSM", ssm, {"mamba_ssm_cache_dtype": ssm}))
    holds, fails = [], []
    for what, val, change in alts:
        try:
            fixed = build_plan(result.model, prefill=replace(p, block_size=rec, **change),
                               decode=replace(d, block_size=rec, **change), vllm_version=target,
                               platform=result.platform.name, isls=(1024,))
            if fixed.recommended_block_size is None and fixed.prefill.block_size == fixed.decode.block_size == rec:
                holds.append(f"{what} {val}")
                continue
            base = build_plan(result.model, prefill=replace(p, **change), decode=replace(d, **change),
                              vllm_version=target, platform=result.platform.name, isls=(1024,))
        except HybridPDError:
            continue  # that combination is not plannable at all; nothing to say about the fix under it
        fails.append({"dtype": f"{what} {val}", "block_size": base.recommended_block_size})
    every = None
    cands = [f["block_size"] for f in fails if f["block_size"]]
    if cands and len(cands) == len(fails):
        big = max(rec, *cands)
        ok = True
        for change in [{}] + [c for _, _, c in alts]:
            try:
                t = build_plan(result.model, prefill=replace(p, block_size=big, **change),
                               decode=replace(d, block_size=big, **change), vllm_version=target,
                               platform=result.platform.name, isls=(1024,))
            except HybridPDError:
                continue
            ok = ok and t.recommended_block_size is None and t.prefill.block_size == t.decode.block_size == big
        every = big if ok else None
    return {"block_size": rec, "assumes": [f"KV {kv_now}"] + ([f"SSM {ssm_now}"] if result.model.has_mamba else []),
            "also_holds_for": holds, "fails_for": fails, "holds_for_all": every}


def verdict_dict(data: dict[str, Any], fix_check: dict[str, Any] | None) -> dict[str, Any]:
    errs = [f for f in data["findings"] if f["severity"] == "error"]
    warns = [f for f in data["findings"] if f["severity"] == "warning"]
    top = errs[0] if errs else None
    return {"ok": not errs, "errors": len(errs), "warnings": len(warns),
            "top_code": top["code"] if top else None, "top_fix": top["fix"] if top else None,
            "warning_codes": [w["code"] for w in warns], "block_fix_check": fix_check}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _release(data: dict[str, Any]) -> str:
    r = data.get("vllm") or {}
    if r and not r.get("verified", True):
        return f"{r['version']} (planned with the {r['profile']} profile, unverified)"
    return str(r.get("version") or data["vllm_profile"])


def verdict_line(data: dict[str, Any]) -> Verdict:
    v = data["verdict"]
    warn = f"{_plural(v['warnings'], 'warning')} ({', '.join(v['warning_codes'])})" if v["warnings"] else "no warnings"
    if v["ok"]:
        return Verdict(level="warning" if v["warnings"] else "ok",
                       text=f"OK: vLLM {_release(data)} accepts this P/D pair; 0 errors, {warn}.")
    text = f"REFUSED: {_plural(v['errors'], 'error')}, {warn}. Top: {v['top_code']}. Fix: {v['top_fix']}"
    chk = v.get("block_fix_check")
    if chk and v["top_code"] and "block" in v["top_code"]:
        text += f"; planned for {', '.join(chk['assumes'])}"
        if chk["also_holds_for"]:
            text += f" and also right for {', '.join(chk['also_holds_for'])}"
        for f in chk["fails_for"]:
            text += f"; with {f['dtype']} use --block-size {f['block_size']} instead"
        if chk.get("holds_for_all"):
            text += f" (--block-size {chk['holds_for_all']} holds for all of these, with more padding)"
    return Verdict(level="error", text=text + ".")


def preface(data: dict[str, Any]) -> list[str]:
    p = data["prefill"] if data["prefill"]["ssm_dtype"] or not data["decode"]["ssm_dtype"] else data["decode"]
    dt = f"dtypes: KV cache {p['kv_cache_dtype']}"
    if p["ssm_dtype"]:
        dt += f", conv state {p['conv_dtype']}, SSM state {p['ssm_dtype']}"
    why = [f["message"] for f in data["findings"] if f["code"] == "dtype"]
    lines = [dt + (f" ({'; '.join(why)})" if why else "")]
    prefix = "bundled config is incomplete; not found upstream: "
    for f in data["findings"]:
        if f["code"] != "model-config":
            continue
        msg = f["message"]
        if msg.startswith(prefix):  # keep the items that change the plan (they say what was assumed)
            parts = [x for x in msg[len(prefix):].split("; the ") if "assum" in x]
            if parts:
                lines.append("Assumed (bundled config): " + "; the ".join(parts))
        elif "assum" in msg:
            lines.append(f"Assumed: {msg}")
    return lines


def render(data: dict[str, Any]) -> Report:
    m = data["model"]
    p, d = data["prefill"], data["decode"]
    rep = Report(verdict=verdict_line(data), preface=preface(data))
    rep.tables.append(Table(title="Findings", headers=["severity", "code", "message", "fix"], heading_columns=2,
                            rows=[[SEVERITY[f["severity"]], f["code"], f["message"], f["fix"]]
                                  for f in data["findings"]]))
    rep.tables.append(Table(
        title=f"Model {m['id']}", headers=["field", "value"],
        rows=[["family / architecture", f"{m['family']} / {m['architecture']}"],
              ["layers (mamba / attention)", f"{m['layers']} ({m['mamba_layers']} / {m['attention_layers']})"],
              ["vLLM (how chosen)", f"{_release(data)} ({data['vllm']['source']})" if "vllm" in data
               else data["vllm_profile"]],
              ["vLLM profile / NIXL connector", f"{data['vllm_profile']} / v{data['nixl_connector_version']}"],
              ["platform / backend", f"{data['platform']} / {p['attention_backend']}"],
              ["tp ratio (D/P)", data["tp_ratio"]]]))
    rep.tables.append(Table(title="Per-side layout (per rank)", headers=["", "prefill", "decode"],
                            rows=_side_rows(p, d), caption="; ".join(p["block_size_reasons"])))
    rep.tables.append(Table(
        title="HMA groups (vLLM order)", headers=["group", "kind", "layers", "padding slots"],
        rows=[[g["index"], g["kind"], ",".join(map(str, g["layers"])), g["padding_slots"]] for g in p["groups"]]))
    rows = []
    for side in (p, d):
        ds = side["descriptors"]
        mb = ds["mamba_desc_bytes"]
        rows.append([side["role"], ds["regions"], ds["fa_regions"], ds["mamba_regions"], ds["fa_desc_bytes"],
                     "/".join(str(v) for v in mb.values()), ds["num_fa_descs"], ds["local_descs"]])
    parts = _conv_parts(p, d)
    rep.tables.append(Table(title="NIXL descriptors (per rank)",
                            headers=["side", "regions", "FA regions", "Mamba regions", "FA desc B",
                                     "/".join(parts) + "/SSM desc B", "num_descs (FA/Mamba boundary)", "local descs"],
                            rows=rows, caption="desc id: FA r*N_phys+b; Mamba num_fa_descs+m*N_log+b"))
    if data["conv_offsets"]:
        rows = []
        for r in data["conv_offsets"]:
            for s in r["sources"]:
                conv = s.get("conv") or {}
                rows.append([r["rank"], s["p_rank"], sp(s["fa"]), *(sp(conv.get(k)) for k in parts), sp(s["ssm"])])
        rep.tables.append(Table(title="Per D rank reads (offset+length in P's page)",
                                headers=["D rank", "P rank", "FA", *parts, "SSM"], rows=rows))
    cap = data.get("capacity")
    if cap and (cap["prefill"]["num_blocks"] is not None or cap["decode"]["num_blocks"] is not None):
        rep.tables.append(Table(title="Capacity (per rank)", headers=["", "prefill", "decode"],
                                rows=_capacity_rows(cap), caption=cap["note"]))
    if data["transfer"]:
        est = data.get("calibration") is not None
        rows = []
        for t in data["transfer"]:
            desc = (f"{t['descriptors']:,}" if t["descriptors"] == t["descriptors_min"]
                    else f"{t['descriptors']:,} ({t['descriptors_min']:,} if coalesced)")
            rows.append([t["isl"], fmt_bytes(t["fa_bytes"]), fmt_bytes(t["mamba_bytes"]), fmt_bytes(t["bytes"]),
                         fmt_bytes(t["naive_bytes"]), fmt_bytes(t["bytes_saved"]), desc, t["reads"],
                         *([_est_cell(t["estimate"])] if est else [])])
        rep.tables.append(Table(title="Per request, all D ranks (N-1 rule applied)" if m["mamba_layers"]
                                else "Per request, all D ranks",
                                headers=["ISL", "FA", "Mamba", "moved", "naive (padded)", "saved", "descriptors",
                                         "READs", *(["est. time"] if est else [])], rows=rows,
                                caption="descriptors: as vLLM issues them, summed over D ranks; '(N if coalesced)' "
                                        "= every contiguous run merged into one descriptor"))
        if est:
            rep.notes.append(_est_note(data["calibration"]))
    return rep
