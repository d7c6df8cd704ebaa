"""One side's KV-cache layout: what vLLM allocates on each rank of a P or D instance.

Mirrors, per profile: ``Platform.update_block_size_for_backend`` / ``_align_hybrid_block_size``
(block-size inflation and Mamba page padding), ``select_common_block_size`` (kernel block),
``_get_kv_cache_groups_uniform_page_size`` (HMA groups) and ``get_kv_cache_config_from_groups``
(shared tensors, blocks that fit).  Pure functions over frozen dataclasses; every decision keeps
its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpd.core import dtypes
from hybridpd.core.families import ATTENTION, MAMBA, ModelSpec
from hybridpd.core.mamba import RankState, rank_state
from hybridpd.core.profiles import KernelSizes, PlatformProfile, VllmProfile
from hybridpd.core.settings import EngineSettings
from hybridpd.core.speculative import with_drafter
from hybridpd.errors import UsageError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class Group:
    """One HMA KV-cache group: its kind and decoder-layer indices, in vLLM's order."""

    index: int
    kind: str  # "mamba" | "attention"
    layers: tuple[int, ...]
    padding_slots: int  # slots (shared tensors) this group leaves unused


@dataclass(frozen=True, kw_only=True)
class Dtypes:
    kv: str
    conv: str
    ssm: str
    reasons: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class SideLayout:
    role: str
    tp: int
    model: ModelSpec
    settings: EngineSettings
    profile: VllmProfile
    platform: PlatformProfile
    backend: str | None
    dtypes: Dtypes
    mamba: RankState | None  # the rank's recurrent state (Mamba2, Mamba-1 or GatedDeltaNet)
    num_kv_heads: int  # per rank
    kv_heads_replicated: bool
    attn_bytes_per_token: int  # a1: K+V bytes of one token on one rank (0 if attention-free)
    kernel_sizes: KernelSizes | None
    block_size: int  # logical attention block (tokens)
    block_reasons: tuple[str, ...]
    kernel_block_size: int
    physical_per_logical: int
    page_size_bytes: int  # uniform page of every shared tensor (per logical block)
    mamba_page_bytes: int  # unpadded conv + ssm (0 if no Mamba)
    padding_bytes: int  # page - mamba page, per Mamba page
    groups: tuple[Group, ...]
    num_shared_tensors: int  # T: layer slots = NIXL regions
    num_ssm_slots: int  # T_ssm: slots that get Mamba descriptors (T before 0.29; slots holding SSM state from 0.29)
    conv_layout: str  # the engine's effective VLLM_SSM_CONV_STATE_LAYOUT
    conv_layout_reason: str
    prefix_caching: bool
    mamba_cache_mode: str  # "none" | "align" | "all"
    num_blocks: int | None  # logical blocks that fit (None: no memory given)
    num_blocks_reason: str | None
    errors: tuple[str, ...]  # what vLLM itself would reject for this side alone

    @property
    def kernel_page_bytes(self) -> int:
        return self.page_size_bytes // self.physical_per_logical if self.physical_per_logical else 0

    @property
    def mamba_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == MAMBA)

    @property
    def attention_groups(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == ATTENTION)

    @property
    def padding_pct(self) -> float:
        return 100.0 * self.padding_bytes / self.mamba_page_bytes if self.mamba_page_bytes else 0.0

    @property
    def derived_ratio_v020(self) -> int | None:
        """What vLLM 0.20 derives for the remote ratio: ceil((conv+ssm)/kernel_page)."""
        if not self.mamba or not self.kernel_page_bytes:
            return None
        return cdiv(self.mamba_page_bytes, self.kernel_page_bytes)


def resolve_dtypes(model: ModelSpec, s: EngineSettings, profile: VllmProfile, platform: PlatformProfile) -> Dtypes:
    reasons: list[str] = []
    model_dtype = dtypes.canonical(s.dtype, field="--dtype") if s.dtype else model.model_dtype
    if s.kv_cache_dtype == "auto":
        if model.kv_cache_quant:
            kv = model.kv_cache_quant
            reasons.append(f"KV cache auto -> {kv} (checkpoint quantization metadata)")
        else:
            kv = model_dtype
    else:
        kv = dtypes.canonical(s.kv_cache_dtype, field="--kv-cache-dtype")
    conv = model_dtype if s.mamba_cache_dtype == "auto" else dtypes.canonical(s.mamba_cache_dtype)
    if s.mamba_ssm_cache_dtype != "auto":
        ssm = dtypes.canonical(s.mamba_ssm_cache_dtype)
    elif model.family == "nemotron_h":
        if model.hf_mamba_ssm_cache_dtype:
            ssm = dtypes.canonical(model.hf_mamba_ssm_cache_dtype, field="mamba_ssm_cache_dtype")
            reasons.append(f"NemotronH SSM state auto -> {ssm} (config.json mamba_ssm_cache_dtype)")
        else:
            ssm = profile.nemotron_ssm_default
            reasons.append(f"NemotronH SSM state auto -> {ssm} (vLLM default when config.json has none)")
    else:
        ssm = conv
    gdn_kept = (model.mamba_type == "gdn" and profile.cpu_fp32_ssm_when == "avx512_bf16"
                and s.mamba_ssm_cache_dtype in ("float16", "bfloat16"))
    if gdn_kept and platform.forces_fp32_ssm:
        reasons.append(f"SSM state stays {ssm}: vLLM {profile.name}'s CPU backend keeps an explicit fp16/bf16 "
                       "state for its accelerated GDN kernel")
    if model.has_mamba and platform.forces_fp32_ssm and ssm != "float32" and profile.cpu_fp32_ssm_when != "never" \
            and not gdn_kept:
        flag = profile.cpu_fp32_ssm_when
        has = s.cpu_avx512_bf16 if flag == "avx512_bf16" else s.cpu_amx_tile
        if has:
            reasons.append(f"SSM state {ssm} -> float32 (vLLM {profile.name}'s CPU backend resets it on {flag} hosts)")
            ssm = "float32"
        else:
            why = f"has no {flag}" if has is False else f"is not known to have {flag}"
            reasons.append(f"SSM state stays {ssm}: the CPU host {why} (vLLM {profile.name} resets it to float32 only "
                           f"on {flag} hosts)")
    return Dtypes(kv=kv, conv=conv, ssm=ssm, reasons=tuple(reasons))


def effective_conv_layout(s: EngineSettings, profile: VllmProfile, platform: PlatformProfile) -> tuple[str, str]:
    """VLLM_SSM_CONV_STATE_LAYOUT as the engine ends up with it, and why (platforms/cpu.py per release)."""
    if not platform.sets_conv_layout:
        return s.conv_layout, f"VLLM_SSM_CONV_STATE_LAYOUT={s.conv_layout}"
    if profile.cpu_ds_with_nixl:
        return s.conv_layout, f"VLLM_SSM_CONV_STATE_LAYOUT={s.conv_layout} (vLLM {profile.name} CPU keeps it; DS when unset)"
    flag = {"amx": s.cpu_amx_tile, "avx512_bf16": s.cpu_avx512_bf16}.get(profile.cpu_sd_conv_when, False)
    if flag and profile.cpu_sd_overrides_env:
        return "SD", (f"vLLM {profile.name}'s CPU platform sets VLLM_SSM_CONV_STATE_LAYOUT=SD on {profile.cpu_sd_conv_when} "
                      f"hosts, overriding the environment")
    return s.conv_layout, f"VLLM_SSM_CONV_STATE_LAYOUT={s.conv_layout}"


def hma_groups(model: ModelSpec) -> tuple[tuple[Group, ...], int]:
    """`_get_kv_cache_groups_uniform_page_size`: buckets by kind in first-appearance order."""
    buckets: dict[str, list[int]] = {}
    for layer in model.cache_layers:
        buckets.setdefault(layer.kind, []).append(layer.index)
    if not buckets:
        return (), 0
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < min(sizes) * 1.5:
        group_size = max(sizes)
    groups: list[Group] = []
    for kind, layers in buckets.items():
        n = cdiv(len(layers), group_size)
        for i in range(n):
            members = tuple(layers[i::n])
            groups.append(Group(index=len(groups), kind=kind, layers=members,
                                padding_slots=group_size - len(members)))
    return tuple(groups), group_size


def _select_kernel_block(block: int, ks: KernelSizes) -> int | None:
    """`select_common_block_size` with the attention backend plus Mamba's MultipleOf(1)."""
    if ks.supports(block):
        return block
    for size in sorted(ks.sizes, reverse=True):
        if block % size == 0:
            return size
    return None


def side_layout(model: ModelSpec, s: EngineSettings, profile: VllmProfile, platform: PlatformProfile,
                *, role: str) -> SideLayout:
    errors: list[str] = []
    model = with_drafter(model, s.speculative_method)  # MTP: the drafter's attention layers join the KV cache
    dt = resolve_dtypes(model, s, profile, platform)
    kv_elem = dtypes.size_of(dt.kv)
    mamba = rank_state(model, tp=s.tp, num_spec=s.num_speculative_tokens, conv_dtype=dt.conv,
                       conv_elem=dtypes.size_of(dt.conv), ssm_dtype=dt.ssm, ssm_elem=dtypes.size_of(dt.ssm))
    if mamba is not None:
        try:
            mamba.validate()  # TP vs heads / n_groups: the mixer's assert, a finding not a crash (#16)
        except UsageError as e:
            errors.append(str(e))
            mamba = None
    attn = model.attention if model.attention_layers else None
    num_kv_heads = max(1, attn.num_kv_heads // s.tp) if attn else 0
    a1 = 2 * num_kv_heads * attn.head_size * kv_elem if attn else 0
    mamba_page = mamba.page_bytes if mamba else 0

    prefix = s.enable_prefix_caching
    if prefix is None:
        prefix = profile.prefix_caching_default_hybrid if model.has_mamba else True
    if model.has_mamba:
        mode = profile.prefix_caching_mode if prefix else "none"
        if mode == "all" and not model.mamba_prefix_caching:
            mode = "align"  # no SupportsMambaPrefixCaching: vLLM falls back to 'align'
    else:
        mode = "none"

    backend = None
    ks = None
    reasons: list[str] = []
    if attn:
        backend = s.attention_backend or platform.default_backend
        if backend not in platform.backends:
            raise UsageError(f"backend {backend!r} is not available on platform {platform.name}",
                             field="--attention-backend", fix=f"use one of {', '.join(platform.backends)}")
        hybrid_fp32 = model.has_mamba and "float32" in (dt.ssm, dt.conv)
        ks = platform.kernel_sizes(backend, profile, hybrid_fp32_mamba=hybrid_fp32)
        if s.block_size is None:
            if platform.block_from_platform:
                block = platform.default_block_size
                reasons.append(f"no --block-size: the {platform.name} platform uses {block}")
            else:
                block = 16 if ks.supports(16) else ks.min_base
                reasons.append(f"no --block-size: {backend} prefers {block}")
        else:
            block = s.block_size
            reasons.append(f"--block-size {block}")
        if mamba is not None and model.is_hybrid:
            align = max(ks.min_base, block)
            if mode == "all":
                chunk = math.lcm(model.mamba_chunk_size or align, align)
                need = chunk * cdiv(cdiv(mamba_page, a1), chunk)
                how = f"prefix caching ('all'): multiple of lcm(chunk {model.mamba_chunk_size}, {align}) = {chunk}"
            else:
                ckpt = mamba.prefill_checkpoint_alignment(platform) if (
                    mode == "align" and profile.checkpoint_alignment) else None
                if ckpt:
                    align = math.lcm(align, ckpt)
                need = align * cdiv(mamba_page, align * a1)
                how = f"multiple of {align}" + (f" (lcm with the {ckpt}-token prefill checkpoint alignment)"
                                                 if ckpt else "")
                if profile.rounds_to_backend_alignment:
                    need = ks.min_base * cdiv(need, ks.min_base)
            if block < need:
                reasons.append(f"raised {block} -> {need} tokens so the attention page ({need}*{a1} B) >= "
                               f"the Mamba page ({mamba_page:,} B); {how}")
                block = need
            else:
                reasons.append(f"kept {block}: its attention page ({block * a1:,} B) already >= the Mamba page "
                               f"({mamba_page:,} B)")
        kernel = _select_kernel_block(block, ks)
        if kernel is None:
            errors.append(f"no kernel block of {backend} {ks.describe()} divides block size {block}; "
                          f"vLLM fails with 'No common block size'")
            kernel = block
        ratio = block // kernel
        page = block * a1
    else:
        block = s.block_size or platform.default_block_size
        kernel, ratio = block, 1
        page = mamba_page
        if mamba is not None:
            reasons.append("attention-free model: no attention backend, the block size is never aligned")
    padding = page - mamba_page if (mamba is not None and attn) else 0

    groups, group_size = hma_groups(model)
    ssm_slots = group_size
    if profile.mamba_descs_ssm_regions_only:
        ssm_slots = max((len(g.layers) for g in groups if g.kind == MAMBA), default=0)
    conv_layout, conv_reason = effective_conv_layout(s, profile, platform)
    if s.disable_hybrid_kv_cache_manager and model.is_hybrid:
        errors.append("hybrid KV cache manager disabled: vLLM cannot unify Mamba and attention specs and fails "
                      "('Failed to promote local KV cache specs to one unified type')")

    num_blocks, nb_reason = _blocks_that_fit(s, page, group_size)
    return SideLayout(
        role=role, tp=s.tp, model=model, settings=s, profile=profile, platform=platform, backend=backend,
        dtypes=dt, mamba=mamba, num_kv_heads=num_kv_heads,
        kv_heads_replicated=bool(attn and s.tp > attn.num_kv_heads), attn_bytes_per_token=a1,
        kernel_sizes=ks, block_size=block, block_reasons=tuple(reasons), kernel_block_size=kernel,
        physical_per_logical=ratio, page_size_bytes=page, mamba_page_bytes=mamba_page, padding_bytes=padding,
        groups=groups, num_shared_tensors=group_size, num_ssm_slots=ssm_slots, conv_layout=conv_layout,
        conv_layout_reason=conv_reason, prefix_caching=bool(prefix),
        mamba_cache_mode=mode, num_blocks=num_blocks,
        num_blocks_reason=nb_reason, errors=tuple(errors))


def _blocks_that_fit(s: EngineSettings, page: int, group_size: int) -> tuple[int | None, str | None]:
    per_block = page * max(group_size, 1)
    if per_block <= 0:
        return None, None
    if s.num_blocks is not None:
        return s.num_blocks, "--num-blocks"
    if s.kv_cache_memory is not None:
        return s.kv_cache_memory // per_block, f"{s.kv_cache_memory:,} B KV-cache memory // ({page:,} B page * {group_size} tensors)"
    if s.gpu_memory is not None:
        budget = int(s.gpu_memory * s.gpu_memory_utilization) - s.weights_memory
        if budget <= 0:
            return 0, "no memory left after weights"
        note = "" if s.weights_memory else " (upper bound: weights and activations not subtracted; pass --weights-memory)"
        return budget // per_block, f"{s.gpu_memory_utilization:g} * {s.gpu_memory:,} B - weights{note}"
    return None, None
