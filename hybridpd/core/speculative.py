"""Speculative decoding (``--speculative-config``) and what it changes in the KV cache and the P -> D transfer.

Read from each release's wheel (0.20.2 … 0.33.0; paths relative to ``vllm/``):

* ``model_executor/models/nemotron_h_mtp.py``: NemotronH's MTP drafter builds ``num_nextn_predict_layers`` x
  ``mtp_hybrid_override_pattern`` layers, layer_idx = num_hidden_layers + i; '*' is a full attention layer with the
  target's heads, 'E' a MoE layer (no cache), anything else NotImplementedError; ``assert num_mtp_layers == 1`` in
  every release.  ``v1/worker/gpu_model_runner.py::get_kv_cache_spec`` takes every attention layer of the static
  forward context, the drafter's included, so its attention layers join the target's attention KV-cache group(s):
  the HMA grouping, the shared tensors (NIXL regions) and the FA descriptors change.
* ``model_executor/layers/mamba/abstract.py``: ``MambaSpec.num_speculative_blocks = num_speculative_tokens`` (any
  method), and ``mamba_mixer2`` adds ``num_speculative_tokens`` columns to the conv state.  The Mamba manager
  (``v1/core/single_type_kv_cache_manager.py``) gives a request ``1 + num_speculative_blocks`` blocks per Mamba group
  ('none' mode: cdiv(tokens + block * num_spec, block), block = max_model_len).
* ``distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``: from 0.27 ``get_exchange_clipped_blocks`` drops
  the trailing ``num_speculative_blocks`` scratch slots (``_ssm_spec_blocks``) before the block ids are exchanged,
  so one state per Mamba group moves; 0.20 … 0.26 exchange every block (``get_sw_clipped_blocks`` keeps non-SWA
  groups whole) and the worker reads all ``1 + num_spec`` states per group.
* ``nixl/metadata.py``: from 0.28 the compatibility hash has a ``speculative_config`` factor, a dict of
  {method, draft model, revision, code_revision, parallel_drafting, kv_cache_dtype, auxiliary_layer_ids} only
  when ``use_eagle()`` (eagle, eagle3, mtp, ...), else None; ``num_speculative_tokens`` is not in it.
* ``config/vllm.py::num_prefill_lookahead_tokens`` (0.31+): 0 without an EAGLE-family method, the draft length
  for multi-module MTP (min(num_nextn_predict_layers, num_speculative_tokens) > 1), else 1; P backs off
  max(1 with Mamba, lookahead - 1) prompt tokens.  NemotronH has one MTP module, so its backoff stays 1.
* No release refuses n-gram or EAGLE with a hybrid target in ``config/speculative.py`` or ``v1/spec_decode/``
  (searched for a raise/assert naming mamba, hybrid or linear attention); an external EAGLE drafter's own layers
  are not known without its config, so a plan with one says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hybridpd.core.families.spec import ATTENTION, CacheLayer, ModelSpec
from hybridpd.errors import UsageError

if TYPE_CHECKING:
    from hybridpd.core.settings import EngineSettings

# methods whose drafter reads the target's hidden states (SpeculativeConfig.use_eagle()); the hash factor and the
# lookahead apply to these only
EAGLE_FAMILY = ("eagle", "eagle3", "mtp", "dflash", "dspark")
METHODS = ("mtp", "ngram", "eagle", "eagle3", "suffix", "draft_model")
MAX_SPEC_TOKENS = 256
CLIPS_SPEC_BLOCKS_FROM = (0, 27, 0)  # nixl base_scheduler strips _ssm_spec_blocks (0.27.0 … 0.33.0)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """The fields of ``--speculative-config`` that change the layout or the pairing."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft model (EAGLE / draft_model); None = the target (MTP) or none (n-gram)

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, "model": self.model}


def parse_speculative_config(text: str, *, field: str = "--speculative-config") -> SpeculativeConfig:
    """vLLM's JSON form, e.g. '{"method":"mtp","num_speculative_tokens":3}'."""
    fix = 'write JSON like \'{"method":"mtp","num_speculative_tokens":3}\''
    if len(text) > 4096:
        raise UsageError("more than 4096 characters", field=field, fix=fix)
    try:
        raw = json.loads(text)
    except ValueError:
        raise UsageError(f"not JSON: {text[:40]!r}", field=field, fix=fix) from None
    if not isinstance(raw, dict):
        raise UsageError("must be a JSON object", field=field, fix=fix)
    method = raw.get("method")
    if method not in METHODS:
        raise UsageError(f"unknown method {str(method)[:30]!r}", field=f"{field} method",
                         fix=f"use one of {', '.join(METHODS)}")
    n = raw.get("num_speculative_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPEC_TOKENS:
        raise UsageError(f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {str(n)[:20]}",
                         field=f"{field} num_speculative_tokens", fix=fix)
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or len(model) > 1024):
        raise UsageError("model must be a string", field=f"{field} model", fix="give the draft model's id or path")
    if method in ("eagle", "eagle3", "draft_model") and not model:
        raise UsageError(f"method {method!r} needs a draft model", field=f"{field} model",
                         fix='add "model": "<draft model id>"')
    return SpeculativeConfig(method=method, num_speculative_tokens=n, model=model)


def drafter_layers(model: ModelSpec, method: str | None) -> tuple[CacheLayer, ...]:
    """The cache-owning layers the drafter adds to the target's KV cache (MTP: the checkpoint's own layers)."""
    if method != "mtp" or model.family != "nemotron_h" or model.mtp_layers != 1:
        return ()
    out = []
    for i, ch in enumerate(model.mtp_pattern):
        if ch == "*":
            idx = model.num_hidden_layers + i
            out.append(CacheLayer(index=idx, kind=ATTENTION, name=f"mtp.layers.{i}.mixer.attn"))
    return tuple(out)


def with_drafter(model: ModelSpec, method: str | None) -> ModelSpec:
    """MODEL as its KV cache is laid out with the drafter loaded: the drafter's attention layers appended (the
    forward context registers them after the target's).  ``num_hidden_layers`` stays the target's."""
    have = {(c.index, c.kind) for c in model.cache_layers}
    extra = tuple(c for c in drafter_layers(model, method) if (c.index, c.kind) not in have)
    return replace(model, cache_layers=(*model.cache_layers, *extra)) if extra else model


def refusal(model: ModelSpec, method: str | None) -> str | None:
    """Why vLLM would not start with this method on this model (None: it starts)."""
    if method != "mtp":
        return None
    if model.family == "nemotron_h":
        if model.mtp_layers == 0:
            return ("the checkpoint has no MTP layers (num_nextn_predict_layers is absent), so vLLM has no MTP "
                    "drafter to load")
        if model.mtp_layers != 1:
            return (f"num_nextn_predict_layers is {model.mtp_layers}: NemotronHMultiTokenPredictor asserts "
                    "'Only one MTP layer is supported for NemotronH-MTP'")
        bad = sorted(set(model.mtp_pattern) - set("*E"))
        if not model.mtp_pattern or bad:
            return (f"mtp_hybrid_override_pattern {model.mtp_pattern!r}: the MTP predictor builds only '*' and 'E' "
                    "layers (NotImplementedError otherwise)")
    return None


def drafter_known(model: ModelSpec, method: str | None) -> bool:
    """hybridpd knows every cache-owning layer the drafter adds (none for n-gram / suffix)."""
    if method in (None, "ngram", "suffix"):
        return True
    return method == "mtp" and model.family == "nemotron_h"


def clips_spec_blocks(version: tuple[int, int, int]) -> bool:
    """The release's NIXL scheduler strips the Mamba scratch slots before exchanging block ids (0.27+)."""
    return version >= CLIPS_SPEC_BLOCKS_FROM


def mamba_blocks_moved(num_spec: int, first: tuple[int, int, int]) -> int:
    """Mamba blocks (states) per group one request moves in 'none' mode: the running state, plus the
    ``num_spec`` scratch slots where the release exchanges them (< 0.27)."""
    return 1 if clips_spec_blocks(first) else 1 + num_spec


def prefill_lookahead(model: ModelSpec, method: str | None, num_spec: int) -> int:
    """``VllmConfig.num_prefill_lookahead_tokens`` (0.31+)."""
    if not num_spec or method not in EAGLE_FAMILY:
        return 0
    if method == "mtp" and min(model.mtp_layers or 1, num_spec) > 1:
        return num_spec
    return 1


def hash_factor(method: str | None, draft_model: str | None, target_model: str, kv_cache_dtype: str) -> Any:
    """The ``speculative_config`` factor of NIXL's compatibility hash (0.28+), as hybridpd knows it."""
    if method not in EAGLE_FAMILY:
        return None
    return {"method": method, "model": draft_model or target_model, "kv_cache_dtype": kv_cache_dtype}


def _describe(s: EngineSettings) -> str:
    if not s.speculative_method and not s.num_speculative_tokens:
        return "none"
    return f"{s.speculative_method or 'unknown method'} x {s.num_speculative_tokens}"


def spec_checks(p: Any, d: Any) -> list[tuple[str, str, str, str]]:
    """(severity, code, message, fix) for the speculative config of a P/D pair (two core.layout.SideLayout: not
    imported here, since layout imports this module); findings.py turns them into Findings."""
    out: list[tuple[str, str, str, str]] = []
    prof = p.profile
    for side in (p, d):
        why = refusal(side.model, side.settings.speculative_method)
        if why:
            out.append(("error", "spec-decode-refused", f"{side.role}: {why}",
                        "drop --speculative-config, or use a checkpoint with one MTP layer "
                        "(e.g. Nemotron-3 Super)"))
            return out
    ps, ds = p.settings, d.settings
    if (ps.speculative_method, ps.num_speculative_tokens, ps.speculative_model) != (
            ds.speculative_method, ds.num_speculative_tokens, ds.speculative_model):
        hashed = "speculative_config" in prof.compat_hash_fields
        kv = p.dtypes.kv
        hp = hash_factor(ps.speculative_method, ps.speculative_model, p.model.model_id, kv)
        hd = hash_factor(ds.speculative_method, ds.speculative_model, d.model.model_id, kv)
        if hashed and hp != hd:
            how = "the NIXL compatibility hash differs (its speculative_config factor), so the handshake fails"
        elif hashed:
            how = ("the compatibility hash does not include num_speculative_tokens, so they pair, with conv states "
                   "and Mamba blocks of different shapes")
        else:
            how = f"vLLM {prof.name}'s compatibility hash has no speculative factor, so they pair with different layouts"
        out.append(("error", "spec-decode-mismatch",
                    f"P runs speculative decoding {_describe(ps)}, D {_describe(ds)}: {how}",
                    "pass the same --speculative-config to P and D"))
    method = ps.speculative_method
    if not method:
        return out
    extra = drafter_layers(p.model, method)
    if extra:
        out.append(("info", "spec-drafter-layers",
                    f"the MTP drafter's attention layer(s) {', '.join(str(c.index) for c in extra)} join the attention "
                    f"KV-cache group: {len(p.groups)} groups, {p.num_shared_tensors} shared tensors per rank, and P's "
                    "prefill writes their KV, which moves with the target's",
                    "nothing to do; D must run the same drafter"))
    elif not drafter_known(p.model, method):
        out.append(("warning", "spec-drafter-unknown",
                    f"method {method!r}: the drafter's own attention layers join the KV-cache groups, but hybridpd does "
                    "not know them, so groups, shared tensors and FA bytes here are the target's alone",
                    "verify with `hybridpd verify`, or use MTP"))
    if p.model.has_mamba and ps.num_speculative_tokens:
        n = ps.num_speculative_tokens
        if clips_spec_blocks(prof.first):
            what = (f"vLLM {prof.name}'s NIXL scheduler strips them (_ssm_spec_blocks), so one state per Mamba "
                    "group moves")
        else:
            what = (f"vLLM {prof.name} exchanges every one of them, so {1 + n} states per Mamba group move "
                    f"({n} of them scratch)")
        out.append(("info", "spec-mamba-blocks",
                    f"each request holds 1 + {n} Mamba blocks per group (num_speculative_blocks) and the conv state "
                    f"has {n} extra columns; {what}",
                    "nothing to do" if clips_spec_blocks(prof.first) else "expected; vLLM >= 0.27 moves one state"))
    return out
