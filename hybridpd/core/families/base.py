"""What every family adapter shares: typed reading of a raw config, the common checks, and building the ModelSpec.

An adapter is ``(RawModel, Cfg) -> ModelSpec``; every failure is a ConfigError naming the key as config.json spells it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridpd.core.families.spec import ATTENTION, MAMBA, AttentionDims, CacheLayer, GdnDims, Mamba1Dims, MambaDims, ModelSpec
from hybridpd.core.models import RawModel
from hybridpd.errors import ConfigError

# Accepted ranges: generous against every published checkpoint, small enough that `plan` stays fast and
# bounded in memory (its work grows with layers x TP). (low, high); a value outside names its key and range.
LAYERS = (1, 4096)
WIDTH = (1, 1 << 20)  # hidden_size, Mamba x channels
HEADS = (1, 1 << 16)
HEAD_DIM = (1, 1 << 14)
GROUPS = (1, 1 << 16)
STATE = (1, 1 << 14)
CONV_KERNEL = (2, 1 << 10)  # vLLM's conv state keeps conv_kernel - 1 columns: 1 would leave it empty
EXPAND = (1, 64)
POSITIONS = (1, 1 << 30)
CHUNK = (1, 1 << 20)
_WHY = {CONV_KERNEL: " (vLLM keeps {key} - 1 columns of conv state, so 1 leaves the state empty)"}


def show(val: Any) -> str:
    """A value for an error message, never longer than a line."""
    if isinstance(val, int) and not isinstance(val, bool) and abs(val) >= 10**15:
        return f"an integer of {len(str(abs(val))) if abs(val) < 10**4000 else 'over 4000'} digits"
    text = repr(val) if not isinstance(val, (dict, list)) else type(val).__name__
    return text if len(text) <= 40 else text[:37] + "..."


class Cfg:
    """Typed access to a raw config; every failure names the key as the config spells it."""

    def __init__(self, raw: dict[str, Any], model_id: str, prefix: str = "") -> None:
        self.raw = raw
        self.model_id = model_id
        self.prefix = prefix  # "ssm_cfg." for a nested object
        self.notes: list[str] = []

    def name(self, key: str) -> str:
        return self.prefix + key

    def int(self, *keys: str, default: int | None = None, bounds: tuple[int, int] = WIDTH) -> int:
        lo, hi = bounds
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                val = self.raw[key]
                k = self.name(key)
                if isinstance(val, bool) or not isinstance(val, int):
                    raise ConfigError(f"{k} must be an integer, got {show(val)}", field=k,
                                      fix=f"set {k} to an integer in {lo}..{hi}")
                if not lo <= val <= hi:
                    raise ConfigError(f"{k} must be in {lo}..{hi}, got {show(val)}{_WHY.get(bounds, '').format(key=k)}", field=k,
                                      fix=f"set {k} to an integer in {lo}..{hi}")
                return val
        if default is None:
            k = self.name(keys[0])
            raise ConfigError(f"{k} is missing from config.json", field=k, fix=f"add {k} to the model's config.json")
        self.notes.append(f"{self.name(keys[0])} not in config.json; used the transformers default {default}")
        return default

    def list(self, key: str, *, max_len: builtins.int = LAYERS[1]) -> builtins.list[Any] | None:
        val = self.raw.get(key)
        if val is None:
            return None
        k = self.name(key)
        if not isinstance(val, list):
            raise ConfigError(f"{k} must be a list, got {type(val).__name__}", field=k, fix=f"set {k} to a JSON list")
        if len(val) > max_len:
            raise ConfigError(f"{k} has {len(val)} entries, more than {max_len}", field=k,
                              fix=f"give {k} at most {max_len} entries")
        return val

    def str_list(self, key: str, allowed: dict[str, str]) -> builtins.list[str] | None:
        """A list of layer-type names, each mapped through ``allowed``."""
        vals = self.list(key)
        if vals is None:
            return None
        k = self.name(key)
        out = []
        for i, v in enumerate(vals):
            if not isinstance(v, str) or v not in allowed:
                raise ConfigError(f"{k}[{i}] is {show(v)}, not a known layer type", field=k,
                                  fix=f"use one of {', '.join(sorted(allowed))}")
            out.append(allowed[v])
        return out

    def str(self, key: str, *, max_len: builtins.int = 256) -> str | None:
        val = self.raw.get(key)
        if val is None:
            return None
        k = self.name(key)
        if not isinstance(val, str):
            raise ConfigError(f"{k} must be a string, got {show(val)}", field=k, fix=f"set {k} to a string")
        if len(val) > max_len:
            raise ConfigError(f"{k} is {len(val)} characters long, more than {max_len}", field=k,
                              fix=f"shorten {k}")
        return val


Adapter = Callable[[RawModel, Cfg], ModelSpec]


def _model_dtype(cfg: Cfg) -> str:
    key = "torch_dtype" if "torch_dtype" in cfg.raw else "dtype"
    val = cfg.raw.get(key)
    if val is None:
        cfg.notes.append("torch_dtype not in config.json; assuming bfloat16 (pass --dtype to override)")
        return "bfloat16"
    if not isinstance(val, str):
        raise ConfigError(f"{key} must be a dtype string, got {show(val)}", field=key, fix="e.g. \"bfloat16\"")
    val = val.removeprefix("torch.")
    if val in ("float32", "float"):
        # vLLM's dtype="auto" serves fp32 checkpoints in bf16 on GPUs.
        return "bfloat16"
    if val not in ("bfloat16", "float16"):
        raise ConfigError(f"unsupported model dtype {show(val)}", field=key,
                          fix="use bfloat16 or float16, or pass --dtype")
    return val


def _kv_quant(raw: RawModel) -> str | None:
    """KV-cache dtype implied by quantization metadata, as vLLM resolves cache_dtype='auto'."""
    q = raw.config.get("quantization_config")
    if isinstance(q, dict):
        scheme = q.get("kv_cache_scheme")
        if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            return "fp8"
        algo = q.get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo.upper().startswith("FP8"):
            return "fp8"
    hq = raw.quant_config
    if isinstance(hq, dict):
        hqq = hq.get("quantization")
        algo = hqq.get("kv_cache_quant_algo") if isinstance(hqq, dict) else None
        if isinstance(algo, str) and algo.upper().startswith("FP8"):
            return "fp8"
    return None


def attention_dims(cfg: Cfg, *, head_dim_keys: tuple[str, ...] = ("head_dim",)) -> AttentionDims:
    heads = cfg.int("num_attention_heads", bounds=HEADS)
    kv = cfg.int("num_key_value_heads", default=heads, bounds=HEADS)
    head_size = None
    for key in head_dim_keys:
        if cfg.raw.get(key) is not None:
            head_size = cfg.int(key, bounds=HEAD_DIM)
            break
    if head_size is None:
        hidden = cfg.int("hidden_size")
        where = head_dim_keys[0] if head_dim_keys else "num_attention_heads"
        fix = f"add {where} to config.json" if head_dim_keys else "make hidden_size a multiple of num_attention_heads"
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}", field=where,
                              fix=fix)
        head_size = hidden // heads
        if head_size > HEAD_DIM[1]:
            raise ConfigError(f"hidden_size / num_attention_heads = {head_size} is more than {HEAD_DIM[1]}",
                              field=where, fix=fix)
    if heads % kv:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                          field="num_key_value_heads", fix="fix the head counts")
    return AttentionDims(num_heads=heads, num_kv_heads=kv, head_size=head_size)


def cache_layers(kinds: list[str]) -> tuple[tuple[CacheLayer, ...], str]:
    """kinds: per decoder layer one of 'M','*','-','E','H' (H = attention + mamba, attention first)."""
    out: list[CacheLayer] = []
    for i, k in enumerate(kinds):
        if k in ("*", "H"):
            out.append(CacheLayer(index=i, kind=ATTENTION, name=f"model.layers.{i}.self_attn.attn"))
        if k in ("M", "H"):
            out.append(CacheLayer(index=i, kind=MAMBA, name=f"model.layers.{i}.mixer"))
    return tuple(out), "".join(kinds)


def check_count(key: str, kinds: list[str], n: int) -> None:
    if len(kinds) != n:
        raise ConfigError(f"{key} has {len(kinds)} entries but num_hidden_layers is {n}", field=key,
                          fix=f"give {key} one entry per layer")


def _architecture(cfg: Cfg, family: str) -> str:
    archs = cfg.list("architectures", max_len=16)
    if archs:
        if not isinstance(archs[0], str) or not archs[0] or len(archs[0]) > 256:
            raise ConfigError(f"architectures[0] must be a class name, got {show(archs[0])}", field="architectures",
                              fix="e.g. [\"NemotronHForCausalLM\"]")
        return archs[0]
    mt = cfg.raw.get("model_type")
    return mt if isinstance(mt, str) else family


# transformers 5 config-class defaults (NemotronHConfig.chunk_size, GraniteMoeHybridConfig.mamba_chunk_size, ...)
_CHUNK_DEFAULT = {"nemotron_h": 128, "granitemoehybrid": 256, "falcon_h1": 256, "zamba2": 256, "mamba2": 256}


def build_spec(raw: RawModel, cfg: Cfg, family: str, layers: tuple[CacheLayer, ...], pattern: str,
               mamba: MambaDims | None, attn: AttentionDims | None, mamba_type: str | None,
               hf_ssm: str | None = None, recurrent: Mamba1Dims | GdnDims | None = None,
               mamba_prefix_caching: bool = True) -> ModelSpec:
    """The fields every family reads the same way (architecture, dtype, positions, chunk size, KV quant, notes)."""
    arch = _architecture(cfg, family)
    dtype = _model_dtype(cfg)
    mpe = cfg.int("max_position_embeddings", bounds=POSITIONS) if cfg.raw.get("max_position_embeddings") is not None \
        else None
    # ModelConfig.get_mamba_chunk_size reads mamba_chunk_size, then chunk_size, from the transformers config
    # object, so the config class's default applies when config.json has neither; 2048 when the class has none.
    chunk_key = next((k for k in ("mamba_chunk_size", "chunk_size") if cfg.raw.get(k) is not None), None)
    chunk = cfg.int(chunk_key, bounds=CHUNK) if chunk_key else _CHUNK_DEFAULT.get(family, 2048)
    notes = list(cfg.notes)
    conf = raw.provenance.get("_confidence") if raw.provenance else None
    if isinstance(conf, dict) and conf.get("not_found"):
        notes.append("bundled config is incomplete; not found upstream: " + "; ".join(map(str, conf["not_found"])))
    return ModelSpec(
        model_id=raw.model_id, source=raw.source, family=family, architecture=arch,
        num_hidden_layers=len(pattern), cache_layers=layers, mamba=mamba, attention=attn, model_dtype=dtype,
        hf_mamba_ssm_cache_dtype=hf_ssm, kv_cache_quant=_kv_quant(raw), max_position_embeddings=mpe,
        mamba_type=mamba_type, layer_pattern=pattern, mamba_chunk_size=chunk if (mamba or recurrent) else None,
        recurrent=recurrent, mamba_prefix_caching=mamba_prefix_caching, notes=tuple(notes))


@dataclass(frozen=True, kw_only=True)
class MambaKeys:
    """How one family spells the Mamba2 fields (read by ``mamba2_dims``, named in error messages)."""

    heads: str
    head_dim: str
    groups: str
    state: str
    conv: str
    inter: str  # the key that sets the x channels (or the first key of the product that does)
    inter_expr: str  # how the x channels are computed, e.g. "mamba_expand * hidden_size"


def check_mamba(d: MambaDims, k: MambaKeys) -> MambaDims:
    prod = d.num_heads * d.head_dim
    if d.intermediate_size > WIDTH[1]:
        raise ConfigError(f"{k.inter_expr} = {d.intermediate_size} is more than {WIDTH[1]} channels", field=k.inter,
                          fix=f"set {k.inter} so that {k.inter_expr} <= {WIDTH[1]}")
    if d.intermediate_size != prod:
        raise ConfigError(
            f"{k.inter_expr} = {d.intermediate_size} but {k.heads} * {k.head_dim} = {prod}; vLLM's Mamba2 mixer "
            "needs them equal", field=k.inter, fix=f"make {k.heads} * {k.head_dim} equal {k.inter_expr}")
    if d.num_heads % d.n_groups:
        raise ConfigError(f"{k.heads} {d.num_heads} is not divisible by {k.groups} {d.n_groups}", field=k.groups,
                          fix=f"set {k.groups} to a divisor of {k.heads}")
    return d


def mamba2_dims(cfg: Cfg, keys: MambaKeys, inter: Callable[[int, int], int], *,
                groups_default: int | None = 1) -> MambaDims:
    """A Mamba2 mixer's geometry under one family's key names, checked.

    ``inter(heads, head_dim)`` gives the x channels; it runs last, so notes and errors come in the keys' order.
    ``groups_default`` None: the groups key is required.
    """
    heads = cfg.int(keys.heads, bounds=HEADS)
    head_dim = cfg.int(keys.head_dim, bounds=HEAD_DIM)
    return check_mamba(MambaDims(
        num_heads=heads, head_dim=head_dim, n_groups=cfg.int(keys.groups, default=groups_default, bounds=GROUPS),
        state_size=cfg.int(keys.state, bounds=STATE), conv_kernel=cfg.int(keys.conv, default=4, bounds=CONV_KERNEL),
        intermediate_size=inter(heads, head_dim)), keys)
