"""The installed release's NIXL worker builds hybridpd's Mamba2 descriptor table: `_build_mamba_local` of 0.24 …
0.33 (lists of (addr, len, dev) through 0.25, Nx3 arrays 0.26–0.32, Nx5 strided rows in 0.33, expanded here the way
NIXL >= 1.5 expands them: `count` blocks `stride` apart) called on a stub carrying what `register_kv_caches` sets
(vllm-0.32-nixl-audit.md §1: block_len = block stride = the kernel page; one base address per layer slot), against
`descriptors.local_table`'s Mamba part.  From 0.29 only slots that hold SSM state get Mamba rows: the stub's
`_ssm_region_indices` comes from the release's own HMA grouping, not from hybridpd.  Also `_block_strided_descs`
(0.33's FA rows) against hybridpd's FA part.  Marked `vllm`; see tests/test_vllm_crosscheck.py for the venvs.
"""

from __future__ import annotations

import importlib
import inspect
import os
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import numpy as np  # noqa: E402
from test_vllm_crosscheck import COMBOS, PROFILE, _attn_spec, _group_fn, _mamba_spec, _side  # noqa: E402

from hybridpd.core.descriptors import local_table, request_desc_ids  # noqa: E402

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _worker_cls() -> Any:
    if importlib.util.find_spec(f"{NIXL}.base_worker") is None:
        pytest.skip("0.20-0.23 build Mamba descriptors inside register_kv_caches (no _build_mamba_local)")
    return importlib.import_module(f"{NIXL}.base_worker").NixlBaseConnectorWorker


def _flat(desc: Any) -> tuple[np.ndarray, np.ndarray]:
    """(addr, len) per indexable descriptor: Nx5 strided rows expanded, Nx3 arrays and tuple lists as they are."""
    a = np.asarray(desc, dtype=np.uint64)
    if a.ndim == 2 and a.shape[1] == 5:
        addrs = [row[0] + np.arange(int(row[4]), dtype=np.uint64) * row[3] for row in a]
        lens = [np.full(int(row[4]), row[1], dtype=np.uint64) for row in a]
        return np.concatenate(addrs), np.concatenate(lens)
    return a[:, 0], a[:, 1]


def _ssm_slots_from_vllm(s: Any) -> list[int]:
    """Layer slots holding SSM state: positions used by the largest Mamba group in the release's own grouping."""
    from vllm.v1.kv_cache_interface import MambaSpec

    mspec, aspec = _mamba_spec(s, padded=True), _attn_spec(s)
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in s.model.cache_layers}
    groups = _group_fn()(specs)
    return list(range(max(len(g.layer_names) for g in groups if isinstance(g.kv_cache_spec, MambaSpec))))


def _stub(s: Any, n_log: int, cls: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split

    info = derive_mamba_conv_split(_mamba_spec(s), s.tp)
    T = s.num_shared_tensors
    stub = SimpleNamespace(
        _conv_decomp=info, _mamba_ssm_size=tuple(info.ssm_sizes), _logical_num_blocks=n_log,
        _physical_blocks_per_logical_kv_block=s.physical_per_logical, device_id=0,
        block_len_per_layer=[s.kernel_page_bytes] * T, block_stride_per_layer=[s.kernel_page_bytes] * T,
        _ple_region_index=None, tp_rank=0, _transfer_layer_region_indices=None, region_num_blocks=[n_log] * T,
        transfer_topo=object())
    if "_ssm_region_indices" in inspect.getsource(cls._build_mamba_local):
        stub._ssm_region_indices = _ssm_slots_from_vllm(s)
    for name in ("_stack_descs", "_pack_strided_descs", "_block_strided_descs"):
        if hasattr(cls, name):
            setattr(stub, name, getattr(cls, name))
    return stub


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0 and tp <= 4])
def test_local_mamba_descriptors_match_the_worker(name: str, tp: int) -> None:
    cls = _worker_cls()
    s = _side(name, tp)
    n_log = 5
    bases = [(i + 1) << 36 for i in range(s.num_shared_tensors)]
    stub = _stub(s, n_log, cls)
    params = inspect.signature(cls._build_mamba_local).parameters
    theirs = (cls._build_mamba_local(stub, bases, 1) if "block_size_ratio" in params
              else cls._build_mamba_local(stub, bases))
    addr, length = _flat(theirs)
    ours = local_table(s, bases, n_log)
    nfa = ours.num_fa_descs
    assert addr.shape[0] == len(ours) - nfa
    assert np.array_equal(addr, ours.addr[nfa:]) and np.array_equal(length, ours.length[nfa:])
    if PROFILE.strided_descriptors:  # one Nx5 row per (SSM slot, sub-projection)
        assert np.asarray(theirs).shape == (4 * len(_ssm_slots_from_vllm(s)), 5)


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0 and tp in (1, 4)])
@pytest.mark.parametrize("block", [None, 64])
def test_local_fa_descriptors_match_the_worker(name: str, tp: int, block: int | None) -> None:
    cls = _worker_cls()
    if not hasattr(cls, "_block_strided_descs"):
        pytest.skip("FA rows are built from the backend's K/V split before 0.33; covered by the 0.32 audit")
    s = _side(name, tp, block=block)
    n_log = 6
    bases = [(i + 1) << 36 for i in range(s.num_shared_tensors)]
    ratio = s.physical_per_logical
    rows = np.concatenate([cls._block_strided_descs(b, s.page_size_bytes // ratio, s.page_size_bytes, n_log, ratio, 0)
                           for b in bases])
    addr, length = _flat(rows)
    ours = local_table(s, bases, n_log)
    assert addr.shape[0] == ours.num_fa_descs
    assert np.array_equal(addr, ours.addr[:ours.num_fa_descs]) and np.array_equal(length, ours.length[:ours.num_fa_descs])
    assert rows.shape[0] == s.num_shared_tensors  # K+V of a region collapse into one strided row


@pytest.mark.parametrize("name,tp", [(n, tp) for n, tp, ns in COMBOS if ns == 0 and tp in (1, 2, 4)])
def test_request_desc_ids_match_the_worker(name: str, tp: int) -> None:
    """Desc ids for one request (2 FA blocks + the one Mamba state block per group), as the worker's own
    `_compute_desc_ids` numbers them (local side, equal blocks on P and D) vs `descriptors.request_desc_ids`."""
    from vllm.v1.kv_cache_interface import MambaSpec

    cls = _worker_cls()
    s = _side(name, tp)
    if s.physical_per_logical != 1:
        pytest.skip("kernel ids of an inflated block are expanded before _compute_desc_ids (not called here)")
    n_log = 8
    mspec, aspec = _mamba_spec(s, padded=True), _attn_spec(s)
    specs = {c.name: (mspec if c.kind == "mamba" else aspec) for c in s.model.cache_layers}
    groups = _group_fn()(specs)
    block_ids = [[3 + i] if isinstance(g.kv_cache_spec, MambaSpec) else [1, 2] for i, g in enumerate(groups)]
    stub = _stub(s, n_log, cls)
    stub._has_mamba = True
    stub._ssm_region_indices = _ssm_slots_from_vllm(s)
    stub._group_spec_types = tuple(type(g.kv_cache_spec) for g in groups)
    # K and V halves are separate regions while the FA shape splits them (test_kv_descriptors_per_block_match)
    stub.num_regions = s.num_shared_tensors * PROFILE.kv_descs_per_block
    stub._transfer_layer_group_ids = []
    stub._scratch_region_indices = []
    stub._ple_group_index = None
    theirs = cls._compute_desc_ids(stub, block_ids, n_log, None, 1)
    table = local_table(s, [(i + 1) << 36 for i in range(s.num_shared_tensors)], n_log)
    ours = request_desc_ids(s, table, block_ids)
    assert np.array_equal(np.asarray(theirs, dtype=np.int64), ours)
