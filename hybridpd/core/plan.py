"""The pipeline in one call: model -> layouts (P, D) -> transfer plan -> findings, and its JSON form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from hybridpd.core.estimate import Calibration, estimate_request
from hybridpd.core.families import ModelSpec, model_spec
from hybridpd.core.findings import Context, Finding, errors, run_rules
from hybridpd.core.layout import SideLayout, cdiv, side_layout
from hybridpd.core.models import resolve
from hybridpd.core.profiles import PlatformProfile, Target, VllmProfile, platform_for, resolve_target
from hybridpd.core.settings import EngineSettings
from hybridpd.core.speculative import hash_factor
from hybridpd.core.transfer import DescriptorLayout, RankRoute, RequestTransfer, request_transfer, routes, tp_ratio
from hybridpd.errors import UsageError

DEFAULT_ISLS = (1024, 8192, 32768, 131072)
SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class BlockDecision:
    """The block-size decision, made once: what each side gets, whether they agree, and the fix if not.

    ``plan`` prints it, ``serve`` applies ``recommended`` (--auto-block-size) and ``verify`` probes around
    ``prefill``; nobody re-derives it."""

    prefill: int
    decode: int
    kernel_prefill: int
    kernel_decode: int
    agree: bool
    recommended: int | None  # smallest --block-size both sides keep unchanged (None: they agree, or none found)
    prefill_reasons: tuple[str, ...]
    decode_reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "kernel_prefill": self.kernel_prefill,
                "kernel_decode": self.kernel_decode, "agree": self.agree, "recommended": self.recommended,
                "prefill_reasons": list(self.prefill_reasons), "decode_reasons": list(self.decode_reasons)}


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    target: Target
    platform: PlatformProfile
    prefill: SideLayout
    decode: SideLayout
    routes: tuple[RankRoute, ...] | None
    transfers: tuple[RequestTransfer, ...]
    findings: tuple[Finding, ...]
    block: BlockDecision

    @property
    def profile(self) -> VllmProfile:
        return self.target.profile

    @property
    def recommended_block_size(self) -> int | None:
        return self.block.recommended

    @property
    def ok(self) -> bool:
        return not errors(self.findings)

    def transfer_for(self, isl: int) -> RequestTransfer:
        assert self.routes is not None
        return request_transfer(self.prefill, self.decode, self.routes, isl)


def sides_agree(a: SideLayout, b: SideLayout) -> bool:
    """P and D share one logical and kernel block, and (0.20) neither side's derived remote ratio is wrong."""
    ratio_ok = not a.profile.derives_remote_ratio or all(
        s.derived_ratio_v020 in (None, s.physical_per_logical) for s in (a, b))
    return a.block_size == b.block_size and a.kernel_block_size == b.kernel_block_size and ratio_ok


def recommended_block(model: ModelSpec, lp: SideLayout, ld: SideLayout) -> int | None:
    """Smallest --block-size that both sides keep unchanged, so that ``sides_agree`` holds."""
    if not lp.attention_groups:
        return None
    step = max(lp.kernel_sizes.min_base if lp.kernel_sizes else 16, 16)
    cand = step * cdiv(max(lp.block_size, ld.block_size), step)
    for _ in range(64):
        a = side_layout(model, replace(lp.settings, block_size=cand), lp.profile, lp.platform, role="prefill")
        b = side_layout(model, replace(ld.settings, block_size=cand), ld.profile, ld.platform, role="decode")
        if a.block_size == cand and sides_agree(a, b):
            return cand
        cand += step
    return None


def max_model_len(spec: ModelSpec, s: EngineSettings, *, cap: int | None = None) -> int | None:
    """The max-model-len vLLM runs with: --max-model-len when given, else the model's max_position_embeddings
    (vLLM's own default), lowered to ``cap`` when one is given (`serve` on cpu launches with at most 4096);
    None when neither is known. The one answer for `plan`'s ISLs, `serve`'s --max-model-len and `verify`'s
    probe lengths."""
    if s.max_model_len:
        return s.max_model_len
    mpe = spec.max_position_embeddings
    return min(mpe, cap) if mpe and cap else mpe


def chosen_isls(spec: ModelSpec, s: EngineSettings, isls: tuple[int, ...] | None) -> tuple[int, ...]:
    """The ISLs to cost.  vLLM refuses a prompt of max_model_len tokens or more (no room for one output
    token: "This model's maximum context length is ..."), so such an ISL is refused here too."""
    limit = max_model_len(spec, s)
    if isls:
        too_long = [i for i in isls if limit is not None and i >= limit]
        if too_long:
            raise UsageError(f"{too_long[0]:,} tokens: vLLM refuses a prompt of max_model_len ({limit:,}) tokens or "
                             "more", field="--isl", fix=f"use ISLs below {limit:,}, or raise --max-model-len")
        return isls
    if limit is None:
        return DEFAULT_ISLS
    return tuple(i for i in DEFAULT_ISLS if i < limit) or (limit - 1,)


def build_plan(model: str | ModelSpec, *, prefill: EngineSettings, decode: EngineSettings,
               vllm_version: str | Target | None = None, platform: str = "cuda", isls: tuple[int, ...] | None = None,
               allow_network: bool = False) -> Plan:
    """The whole pipeline.  ``vllm_version``: a resolved Target (the CLI resolves it with the host's
    installed vLLM), a version string, or None for the newest profile."""
    spec = model if isinstance(model, ModelSpec) else model_spec(resolve(model, allow_network=allow_network))
    target = vllm_version if isinstance(vllm_version, Target) else resolve_target(vllm_version)
    prof = target.profile
    plat = platform_for(platform)
    chosen = chosen_isls(spec, prefill, isls)
    p = side_layout(spec, prefill, prof, plat, role="prefill")
    d = side_layout(spec, decode, prof, plat, role="decode")
    a, b = sorted((p.tp, d.tp))
    rts = None
    movable = not spec.mamba_type or (spec.mamba_type in prof.pd_mamba_types and spec.state_modelled)
    attention_ok = bool(p.attention_groups) or (spec.has_mamba and prof.attention_free_pd)
    if b % a == 0 and not p.errors and not d.errors and attention_ok and movable:
        rts = routes(p, d)
    agree = sides_agree(p, d)
    rec = recommended_block(spec, p, d) if spec.is_hybrid and not agree else None
    block = BlockDecision(prefill=p.block_size, decode=d.block_size, kernel_prefill=p.kernel_block_size,
                          kernel_decode=d.kernel_block_size, agree=agree, recommended=rec,
                          prefill_reasons=p.block_reasons, decode_reasons=d.block_reasons)
    findings = run_rules(Context(p=p, d=d, routes=rts, recommended_block=rec, target=target))
    transfers = tuple(request_transfer(p, d, rts, n) for n in chosen) if rts is not None else ()
    return Plan(model=spec, target=target, platform=plat, prefill=p, decode=d, routes=rts, transfers=transfers,
                findings=findings, block=block)


def compat_hash_inputs(side: SideLayout, target: Target, model: str) -> dict[str, Any]:
    """The factors of NIXL's compatibility hash this release computes (P and D must be equal in every one).

    Values are what hybridpd knows of them: ``model`` is the --model string, ``cross_layers_blocks`` is off for
    Mamba models and off by default otherwise, ``transfer_mode`` is "pull" (the NixlConnector default)."""
    attn = side.model.attention if side.model.attention_layers else None
    values: dict[str, Any] = {
        "vllm_version": target.text, "nixl_connector_version": side.profile.nixl_connector_version, "model": model,
        "dtype": side.settings.dtype or side.model.model_dtype, "num_kv_heads": attn.num_kv_heads if attn else 0,
        "head_size": attn.head_size if attn else 0, "num_hidden_layers": side.model.num_hidden_layers,
        "attn_backend_name": side.backend, "cache_dtype": side.dtypes.kv, "cross_layers_blocks": False,
        "is_hma_enabled": not side.settings.disable_hybrid_kv_cache_manager and side.model.is_hybrid,
        "speculative_config": hash_factor(side.settings.speculative_method, side.settings.speculative_model, model,
                                          side.dtypes.kv), "transfer_mode": "pull"}
    return {k: values[k] for k in side.profile.compat_hash_fields}


def _side_dict(s: SideLayout) -> dict[str, Any]:
    m = s.mamba
    desc = DescriptorLayout.of(s)
    return {
        "role": s.role,
        "tp": s.tp,
        "attention_backend": s.backend,
        "kv_cache_dtype": s.dtypes.kv,
        "conv_dtype": s.dtypes.conv if m else None,
        "ssm_dtype": s.dtypes.ssm if m else None,
        "num_kv_heads": s.num_kv_heads,
        "kv_heads_replicated": s.kv_heads_replicated,
        "attn_bytes_per_token": s.attn_bytes_per_token,
        "n_groups_effective": m.n_groups_eff if m else None,
        "conv_state_shape": list(m.conv.shape(s.settings.conv_layout)) if m else None,
        "conv_state_shape_sd": list(m.conv.shape("SD")) if m else None,
        "conv_state_shape_ds": list(m.conv.shape("DS")) if m else None,
        "conv_split": m.conv.as_dict() if m else None,
        "ssm_state_shape": list(m.ssm_shape) if m else None,
        "conv_state_bytes": m.conv_bytes if m else 0,
        "ssm_state_bytes": m.ssm_bytes if m else 0,
        "mamba_page_bytes": s.mamba_page_bytes,
        "attention_block_size": s.block_size,
        "block_size_reasons": list(s.block_reasons),
        "kernel_block_size": s.kernel_block_size,
        "kernel_block_sizes_supported": s.kernel_sizes.describe() if s.kernel_sizes else None,
        "physical_per_logical": s.physical_per_logical,
        "derived_ratio_v020": s.derived_ratio_v020,
        "page_size_bytes": s.page_size_bytes,
        "kernel_page_bytes": s.kernel_page_bytes,
        "padding_bytes": s.padding_bytes,
        "padding_pct": round(s.padding_pct, 4),
        "prefix_caching": s.prefix_caching,
        "mamba_cache_mode": s.mamba_cache_mode,
        "groups": [{"index": g.index, "kind": g.kind, "layers": list(g.layers), "padding_slots": g.padding_slots}
                   for g in s.groups],
        "num_shared_tensors": s.num_shared_tensors,
        "num_ssm_slots": s.num_ssm_slots,
        "conv_layout": s.conv_layout if m else None,
        "num_blocks": s.num_blocks,
        "num_blocks_reason": s.num_blocks_reason,
        "descriptors": {
            "regions": desc.regions, "fa_regions": desc.fa_regions, "mamba_regions": desc.mamba_regions,
            "fa_desc_bytes": desc.fa_desc_len,
            "mamba_desc_bytes": dict(zip(desc.mamba_desc_names, desc.mamba_desc_lens, strict=True)),
            "num_phys_blocks": desc.num_phys_blocks, "num_logical_blocks": desc.num_logical_blocks,
            "num_fa_descs": desc.num_fa_descs, "local_descs": desc.local_descs,
            "registered_rows": desc.registered_rows,
            "row_format": "strided (addr, len, dev, stride, count)" if s.profile.strided_descriptors
            else "flat (addr, len, dev)",
            "desc_id_formula": {
                "fa": "r * N_phys + b   (r < fa_regions, b = kernel block id)",
                "mamba": desc.mamba_id_formula,
            },
        },
    }


def _span(s: tuple[int, int] | None) -> list[int] | None:
    return list(s) if s else None


def plan_to_dict(plan: Plan, *, estimate_with: Calibration | None = None) -> dict[str, Any]:
    """The plan's JSON form. ``estimate_with`` adds "calibration" and an "estimate" per transfer (hybridpd.core.estimate)."""
    m = plan.model
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "id": m.model_id, "source": m.source, "family": m.family, "architecture": m.architecture,
            "layers": m.num_hidden_layers, "pattern": m.layer_pattern,
            "mamba_layers": len(m.mamba_layers), "attention_layers": len(m.attention_layers),
            "mamba_type": m.mamba_type, "model_dtype": m.model_dtype,
            "mamba": None if m.mamba is None else {
                "num_heads": m.mamba.num_heads, "head_dim": m.mamba.head_dim, "n_groups": m.mamba.n_groups,
                "state_size": m.mamba.state_size, "conv_kernel": m.mamba.conv_kernel,
                "intermediate_size": m.mamba.intermediate_size},
            "recurrent": None if m.recurrent is None else {"kind": m.mamba_type, **asdict(m.recurrent)},
            "attention": None if m.attention is None else {
                "num_heads": m.attention.num_heads, "num_kv_heads": m.attention.num_kv_heads,
                "head_size": m.attention.head_size},
        },
        "vllm_profile": plan.profile.name,
        "vllm": plan.target.as_dict(),
        "nixl_connector_version": plan.profile.nixl_connector_version,
        "platform": plan.platform.name,
        "tp_ratio": tp_ratio(plan.prefill.tp, plan.decode.tp),
        "prefill": _side_dict(plan.prefill),
        "decode": _side_dict(plan.decode),
        "compat_hash_inputs": {role: compat_hash_inputs(side, plan.target, m.model_id)
                               for role, side in (("prefill", plan.prefill), ("decode", plan.decode))},
        "recommended_block_size": plan.recommended_block_size,
        "block_decision": plan.block.as_dict(),
        "conv_offsets": [] if plan.routes is None else [
            {"rank": r.rank, "sources": [
                {"p_rank": s.p_rank, "fa": _span(s.fa), "fa_v_offset": s.fa_v_offset, "x": _span(s.x),
                 "B": _span(s.b), "C": _span(s.c), "ssm": _span(s.ssm), "local_slot": s.local_slot,
                 "local_parts": s.local_parts,
                 "conv": None if s.conv is None else dict(zip(s.conv_names, map(list, s.conv), strict=True))}
                for s in r.sources]}
            for r in plan.routes],
        "transfer": [
            {"isl": t.isl, "tokens_transferred": t.tokens_transferred, "logical_blocks": t.logical_blocks,
             "bytes": t.bytes, "fa_bytes": t.fa_bytes, "mamba_bytes": t.mamba_bytes, "naive_bytes": t.naive_bytes,
             "bytes_saved": t.naive_bytes - t.bytes, "descriptors": t.descriptors,
             "descriptors_min": t.descriptors_min, "reads": t.reads,
             "per_rank": [{"rank": r.rank, "bytes": r.bytes, "fa_bytes": r.fa_bytes, "mamba_bytes": r.mamba_bytes,
                           "naive_bytes": r.naive_bytes, "descriptors": r.descriptors,
                           "descriptors_min": r.descriptors_min, "reads": r.reads} for r in t.per_rank]}
            for t in plan.transfers],
        "findings": [f.as_dict() for f in plan.findings],
        "ok": plan.ok,
    }
    if estimate_with is not None:
        out["calibration"] = estimate_with.as_dict()
        for td, t in zip(out["transfer"], plan.transfers, strict=True):
            td["estimate"] = estimate_request(t, estimate_with).as_dict()
    return out
