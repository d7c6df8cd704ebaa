"""The pipeline in one call: model -> layouts (P, D) -> transfer plan -> findings, and its JSON form."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .estimate import Calibration, estimate_request
from .families import ModelSpec, model_spec
from .findings import ERROR, Context, Finding, run_rules
from .layout import SideLayout, side_layout
from .models import resolve
from .profiles import PlatformProfile, VllmProfile, platform_for, profile_for
from .settings import EngineSettings
from .transfer import DescriptorLayout, RankRoute, RequestTransfer, request_transfer, routes, tp_ratio

DEFAULT_ISLS = (1024, 8192, 32768, 131072)
SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    profile: VllmProfile
    platform: PlatformProfile
    prefill: SideLayout
    decode: SideLayout
    routes: tuple[RankRoute, ...] | None
    transfers: tuple[RequestTransfer, ...]
    findings: tuple[Finding, ...]
    recommended_block_size: int | None

    @property
    def ok(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

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
    cand = step * -(-max(lp.block_size, ld.block_size) // step)
    for _ in range(64):
        a = side_layout(model, replace(lp.settings, block_size=cand), lp.profile, lp.platform, role="prefill")
        b = side_layout(model, replace(ld.settings, block_size=cand), ld.profile, ld.platform, role="decode")
        if a.block_size == cand and sides_agree(a, b):
            return cand
        cand += step
    return None


def build_plan(model: str | ModelSpec, *, prefill: EngineSettings, decode: EngineSettings,
               vllm_version: str | None = None, platform: str = "cuda", isls: tuple[int, ...] | None = None,
               allow_network: bool = False) -> Plan:
    spec = model if isinstance(model, ModelSpec) else model_spec(resolve(model, allow_network=allow_network))
    prof = profile_for(vllm_version)
    plat = platform_for(platform)
    p = side_layout(spec, prefill, prof, plat, role="prefill")
    d = side_layout(spec, decode, prof, plat, role="decode")
    a, b = sorted((p.tp, d.tp))
    rts = None
    if b % a == 0 and not p.errors and not d.errors and p.attention_groups:
        if not (spec.mamba_type and spec.mamba_type not in prof.pd_mamba_types):
            rts = routes(p, d)
    rec = recommended_block(spec, p, d) if spec.is_hybrid and not sides_agree(p, d) else None
    findings = run_rules(Context(p=p, d=d, routes=rts, recommended_block=rec))
    max_len = prefill.max_model_len or spec.max_position_embeddings or max(DEFAULT_ISLS)
    chosen = isls or tuple(i for i in DEFAULT_ISLS if i <= max_len) or (max_len,)
    transfers = tuple(request_transfer(p, d, rts, n) for n in chosen) if rts is not None else ()
    return Plan(model=spec, profile=prof, platform=plat, prefill=p, decode=d, routes=rts, transfers=transfers,
                findings=findings, recommended_block_size=rec)


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
        "conv_split": {"x": m.conv.x_channels, "B": m.conv.b_channels, "C": m.conv.b_channels,
                       "state_len": m.conv.state_len} if m else None,
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
        "num_blocks": s.num_blocks,
        "num_blocks_reason": s.num_blocks_reason,
        "descriptors": {
            "regions": desc.regions, "fa_regions": desc.fa_regions, "mamba_regions": desc.mamba_regions,
            "fa_desc_bytes": desc.fa_desc_len,
            "mamba_desc_bytes": dict(zip(("x", "B", "C", "ssm"), desc.mamba_desc_lens, strict=True)),
            "num_phys_blocks": desc.num_phys_blocks, "num_logical_blocks": desc.num_logical_blocks,
            "num_fa_descs": desc.num_fa_descs, "local_descs": desc.local_descs,
            "desc_id_formula": {
                "fa": "r * N_phys + b   (r < fa_regions, b = kernel block id)",
                "mamba": "num_fa_descs + m * N_log + b   (m = 4*tensor + {x:0,B:1,C:2,SSM:3}, b = logical block)",
            },
        },
    }


def _span(s: tuple[int, int] | None) -> list[int] | None:
    return list(s) if s else None


def plan_to_dict(plan: Plan, *, estimate_with: Calibration | None = None) -> dict[str, Any]:
    """The plan's JSON form. ``estimate_with`` adds "calibration" and an "estimate" per transfer (hybridpd.estimate)."""
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
            "attention": None if m.attention is None else {
                "num_heads": m.attention.num_heads, "num_kv_heads": m.attention.num_kv_heads,
                "head_size": m.attention.head_size},
        },
        "vllm_profile": plan.profile.name,
        "nixl_connector_version": plan.profile.nixl_connector_version,
        "platform": plan.platform.name,
        "tp_ratio": tp_ratio(plan.prefill.tp, plan.decode.tp),
        "prefill": _side_dict(plan.prefill),
        "decode": _side_dict(plan.decode),
        "recommended_block_size": plan.recommended_block_size,
        "conv_offsets": [] if plan.routes is None else [
            {"rank": r.rank, "sources": [
                {"p_rank": s.p_rank, "fa": _span(s.fa), "fa_v_offset": s.fa_v_offset, "x": _span(s.x),
                 "B": _span(s.b), "C": _span(s.c), "ssm": _span(s.ssm), "local_slot": s.local_slot,
                 "local_parts": s.local_parts} for s in r.sources]}
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
