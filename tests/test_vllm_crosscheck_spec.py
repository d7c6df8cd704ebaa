"""Speculative decoding against the installed release's own code (marker `vllm`; the venvs of scripts/vllm_matrix.py).

* The Mamba manager's blocks per request with ``num_speculative_blocks`` (its own ``allocate_new_blocks``), then the
  release's NIXL scheduler clip (``get_exchange_clipped_blocks`` 0.27+, ``get_sw_clipped_blocks`` before) on them:
  the states that move per Mamba group, against ``transfer.mamba_blocks_per_group``, and the bytes / descriptors
  ``request_transfer`` derives from it.
* The MTP drafter: the release's ``nemotron_h_mtp.py`` places its layers at num_hidden_layers + i and builds '*' as an
  attention layer (source), and the release's HMA grouping of the target's and the drafter's specs equals
  hybridpd's groups with ``--speculative-config`` MTP.
* The compatibility-hash factor (``_get_speculative_compatibility_factors``) and the prefill lookahead
  (``VllmConfig.num_prefill_lookahead_tokens`` with the release's ``SpeculativeConfig.use_eagle`` /
  ``use_multi_module_mtp``) against ``speculative.hash_factor`` / ``prefill_lookahead`` and ``prefill_backoff``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_crosscheck import CUDA, NIXL, PROFILE, TARGET, _attn_spec, _group_fn, _mamba_spec  # noqa: E402

from hybridpd.core import families, layout, models  # noqa: E402
from hybridpd.core.plan import build_plan  # noqa: E402
from hybridpd.core.settings import EngineSettings  # noqa: E402
from hybridpd.core.speculative import hash_factor, prefill_lookahead  # noqa: E402
from hybridpd.core.transfer import mamba_blocks_per_group, prefill_backoff  # noqa: E402


def _spec_side(name: str, tp: int, n: int, method: str | None = "mtp") -> layout.SideLayout:
    spec = families.model_spec(models.resolve(name))
    s = EngineSettings(tp=tp, num_speculative_tokens=n, speculative_method=method, enable_prefix_caching=False)
    return layout.side_layout(spec, s, PROFILE, CUDA, role="prefill")


def _sched_module() -> Any:
    for n in ("base_scheduler", "scheduler"):
        if importlib.util.find_spec(f"{NIXL}.{n}") is not None:
            return importlib.import_module(f"{NIXL}.{n}")
    raise AssertionError("no NIXL scheduler module")


def _sched_cls() -> Any:
    mod = _sched_module()
    return next(c for _, c in inspect.getmembers(mod, inspect.isclass)
                if c.__module__ == mod.__name__ and (hasattr(c, "get_exchange_clipped_blocks")
                                                     or hasattr(c, "get_sw_clipped_blocks")))


def _mamba_manager(mspec: Any) -> Any:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    pool_kw: dict[str, Any] = {}
    if "hash_block_size" in inspect.signature(BlockPool.__init__).parameters:
        pool_kw["hash_block_size"] = mspec.block_size
    pool = BlockPool(num_gpu_blocks=64, enable_caching=False, **pool_kw)
    params = inspect.signature(MambaManager.__init__).parameters
    kw: dict[str, Any] = {"kv_cache_spec": mspec, "block_pool": pool}
    for name, val in (("enable_caching", False), ("kv_cache_group_id", 1),
                      ("scheduler_block_size", mspec.block_size)):
        if name in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kw[name] = val
    sig = inspect.signature(importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
                            .SingleTypeKVCacheManager.__init__).parameters
    kw = {k: v for k, v in kw.items() if k in sig}
    return MambaManager(**kw)


def _clip(block_ids: tuple[list[int], ...], mspec: Any) -> tuple[list[int], ...]:
    """The release's scheduler clip on (attention, Mamba) block lists, as request_finished applies it."""
    cls = _sched_cls()
    stub = SimpleNamespace(_is_hma_required=True, blocks_per_sw=[0, 0],
                           _ssm_spec_blocks=[None, mspec.num_speculative_blocks],
                           _ssm_state_slots_are_positional=False,
                           kv_cache_config=SimpleNamespace(select_transfer_block_ids=lambda b: b))
    if hasattr(cls, "get_exchange_clipped_blocks"):
        return tuple(cls.get_exchange_clipped_blocks(stub, block_ids))
    return tuple(cls.get_sw_clipped_blocks(stub, block_ids))


@pytest.mark.parametrize("num_spec", [1, 2, 3])
@pytest.mark.parametrize("name,tp", [("super", 1), ("super", 4), ("nano", 2)])
def test_mamba_states_moved_per_group_match_the_release(name: str, tp: int, num_spec: int) -> None:
    """'none' mode (prefix caching off): the Mamba block is max_model_len tokens; one request of 1,000 tokens."""
    from dataclasses import replace

    s = _spec_side(name, tp, num_spec, method="mtp" if name == "super" else "ngram")
    max_len = 4096
    mspec = _mamba_spec(s, padded=True)
    kw = {"num_speculative_blocks": num_spec}
    if "mamba_cache_mode" in type(mspec).__dataclass_fields__:
        kw["mamba_cache_mode"] = "none"
    mspec = replace(mspec, block_size=max_len, **kw)
    mgr = _mamba_manager(mspec)
    blocks = mgr.allocate_new_blocks("r0", 1000, 1000)
    assert len(blocks) == 1 + num_spec  # the manager's own count: running state + scratch slots
    ids = [b.block_id for b in blocks]
    moved = _clip(([1, 2, 3], ids), mspec)[1]
    assert len(moved) == mamba_blocks_per_group(s)
    if len(moved) == 1:
        assert moved == [ids[0]]  # the running state, never a scratch slot
    # the bytes and descriptors per request follow: every Mamba span once per (SSM slot, group, state moved)
    plan = build_plan(name, prefill=s.settings, decode=s.settings, vllm_version=TARGET, isls=(1000,))
    r = plan.transfers[0].per_rank[0]
    src = plan.routes[0].sources if plan.routes else ()
    per_state = sum(x.mamba_bytes for x in src)
    assert r.mamba_bytes == per_state * s.num_ssm_slots * len(s.mamba_groups) * len(moved)


def test_mamba_spec_takes_num_speculative_tokens() -> None:
    """MambaBase.get_kv_cache_spec sets num_speculative_blocks from the speculative config, for any method."""
    src = inspect.getsource(importlib.import_module("vllm.model_executor.layers.mamba.abstract"))
    m = re.search(r"num_speculative_blocks=\((.*?)\)\s*,", src, re.S)
    assert m and "num_speculative_tokens" in m.group(1)
    assert "method" not in m.group(1)


def test_mtp_drafter_layers_match_the_release_source() -> None:
    src = inspect.getsource(importlib.import_module("vllm.model_executor.models.nemotron_h_mtp"))
    assert "self.mtp_start_layer_idx = config.num_hidden_layers" in src
    assert re.search(r"layer_idx=self\.mtp_start_layer_idx \+ i", src)
    assert re.search(r'if char == "\*":\s*\n\s*self\.layers\[str\(i\)\] = NemotronHMTPAttentionDecoderLayer', src)
    assert "assert self.num_mtp_layers == 1" in src
    # the model runner keeps every attention layer's spec except kv-sharing ones; the MTP attention does not share
    attn = inspect.getsource(importlib.import_module("vllm.model_executor.models.nemotron_h").NemotronHAttention)
    assert "kv_sharing_target_layer_name" not in attn


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_hma_groups_with_the_mtp_drafter_match_the_release(tp: int) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    s = _spec_side("super", tp, 3)
    base = families.model_spec(models.resolve("super"))
    mspec, aspec = _mamba_spec(s, padded=True), _attn_spec(s)
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in base.cache_layers}
    specs["mtp.layers.0.mixer.attn"] = aspec  # the drafter registers after the target (its layers dict order)
    groups = _group_fn()(specs)
    index = {c.name: c.index for c in base.cache_layers} | {"mtp.layers.0.mixer.attn": base.num_hidden_layers}
    theirs = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "attention",
               tuple(index[n] for n in g.layer_names)) for g in groups]
    assert theirs == [(g.kind, g.layers) for g in s.groups]
    assert max(len(g.layer_names) for g in groups) == s.num_shared_tensors


def _spec_cfg_stub(method: str, n: int, mtp_layers: int) -> Any:
    from vllm.config.speculative import SpeculativeConfig

    hf = SimpleNamespace(num_nextn_predict_layers=mtp_layers)
    stub = SimpleNamespace(method=method, num_speculative_tokens=n,
                           draft_model_config=SimpleNamespace(hf_config=hf, model="drafter", revision=None,
                                                              code_revision=None),
                           parallel_drafting=False, kv_cache_dtype=None)
    stub.use_eagle = lambda: SpeculativeConfig.use_eagle(stub)
    if hasattr(SpeculativeConfig, "use_multi_module_mtp"):
        stub.use_multi_module_mtp = lambda: SpeculativeConfig.use_multi_module_mtp(stub)
    return stub


@pytest.mark.parametrize("method", ["mtp", "ngram", "eagle", "suffix"])
def test_hash_factor_presence_matches(method: str) -> None:
    meta = importlib.import_module(f"{NIXL}.metadata")
    fn = getattr(meta, "_get_speculative_compatibility_factors", None)
    assert (fn is not None) == ("speculative_config" in PROFILE.compat_hash_fields)
    if fn is None:
        pytest.skip(f"vLLM {PROFILE.name}'s compatibility hash has no speculative factor")
    cfg = SimpleNamespace(speculative_config=_spec_cfg_stub(method, 3, 1),
                          cache_config=SimpleNamespace(cache_dtype="auto"))
    theirs = fn(cfg)
    ours = hash_factor(method, None, "m", "auto")
    assert (theirs is None) == (ours is None)
    if theirs is not None:
        assert theirs["method"] == ours["method"]
        assert "num_speculative_tokens" not in theirs  # so a different draft length pairs


@pytest.mark.parametrize("method,n,mtp_layers", [("mtp", 3, 1), ("mtp", 1, 1), ("mtp", 3, 3), ("eagle", 4, 1),
                                                 ("ngram", 4, 1)])
def test_prefill_lookahead_and_backoff_match(method: str, n: int, mtp_layers: int) -> None:
    from vllm.config.vllm import VllmConfig

    prop = VllmConfig.__dict__.get("num_prefill_lookahead_tokens")
    if prop is None:
        assert not PROFILE.backoff_uses_lookahead
        pytest.skip("no num_prefill_lookahead_tokens before 0.31: P backs off 1 token whatever the drafter")
    stub = SimpleNamespace(speculative_config=_spec_cfg_stub(method, n, mtp_layers), num_speculative_tokens=n)
    theirs = prop.fget(stub)
    spec = families.model_spec(models.resolve("super"))
    from dataclasses import replace

    spec = replace(spec, mtp_layers=mtp_layers)
    assert theirs == prefill_lookahead(spec, method, n)
    cls = _sched_cls()
    sched = object.__new__(cls)
    sched._has_mamba, sched._bounded_replay = True, False
    sched.vllm_config = SimpleNamespace(num_prefill_lookahead_tokens=theirs)
    s = layout.side_layout(spec, EngineSettings(tp=1, num_speculative_tokens=n, speculative_method=method,
                                                enable_prefix_caching=False), PROFILE, CUDA, role="prefill")
    assert cls._prefill_backoff(sched) == prefill_backoff(s)
