"""The `vllm serve` flags that change the KV-cache layout, for one side (P or D) of a P/D pair."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridpd.errors import UsageError

MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    tp: int = 1
    block_size: int | None = None  # --block-size; None = platform/backend default
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    dtype: str | None = None  # --dtype override of the model dtype
    attention_backend: str | None = None  # None = platform default
    enable_prefix_caching: bool | None = None  # None = vLLM's default for this version
    num_speculative_tokens: int = 0
    speculative_method: str | None = None  # --speculative-config method (core/speculative.py); None: not given
    speculative_model: str | None = None  # --speculative-config model (a separate draft model)
    max_model_len: int | None = None
    num_blocks: int | None = None  # --num-gpu-blocks-override
    kv_cache_memory: int | None = None  # bytes available to the KV cache (--kv-cache-memory-bytes)
    gpu_memory: int | None = None  # bytes of device memory (upper bound: weights not subtracted)
    gpu_memory_utilization: float = 0.9
    weights_memory: int = 0  # bytes to subtract from gpu_memory*utilization, per rank
    disable_hybrid_kv_cache_manager: bool = False
    conv_layout: str = "DS"  # VLLM_SSM_CONV_STATE_LAYOUT
    cpu_avx512_bf16: bool | None = None  # CPU platform: target host has avx512_bf16 (None: not known; the CLI fills it)
    cpu_amx_tile: bool | None = None  # CPU platform: target host has AMX tiles (None: not known; the CLI fills it)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise UsageError(f"TP must be >= 1, got {self.tp}", field="--ptp/--dtp")
        if self.block_size is not None and self.block_size < 1:
            raise UsageError(f"must be >= 1, got {self.block_size}", field="--block-size")
        for name, val, allowed in (("--kv-cache-dtype", self.kv_cache_dtype, KV_DTYPES),
                                   ("--mamba-cache-dtype", self.mamba_cache_dtype, MAMBA_DTYPES),
                                   ("--mamba-ssm-cache-dtype", self.mamba_ssm_cache_dtype, MAMBA_DTYPES)):
            if val not in allowed:
                raise UsageError(f"unknown value {val!r}", field=name, fix=f"use one of {', '.join(allowed)}")
        if self.num_speculative_tokens < 0:
            raise UsageError("must be >= 0", field="--num-speculative-tokens")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UsageError(f"must be in (0, 1], got {self.gpu_memory_utilization}",
                             field="--gpu-memory-utilization")
        if self.conv_layout not in ("DS", "SD"):
            raise UsageError(f"unknown layout {self.conv_layout!r}", field="--conv-layout", fix="use DS or SD")


def parse_size(text: str, *, field: str) -> int:
    """'141GB', '80GiB', '512MiB', '1e9' -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise UsageError(f"cannot parse size {text!r}", field=field, fix="write e.g. 141GB, 80GiB or 512MiB")
    num = float(m.group(1))
    unit = m.group(2).upper()
    base = 1024 if m.group(3) else 1000
    exp = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit]
    return int(num * base**exp)


# ------------------------------------------------------------------------------------ the settings table


@dataclass(frozen=True)
class Setting:
    """One engine setting: the EngineSettings field, how vLLM and hybridpd spell it, and what 'auto' means.

    ``side``: "each" (one hybridpd flag per side: ``flags`` is (P flag, D flag), ``flag`` sets both when given),
    "both" (one flag for both sides), "host" (hybridpd only: no vLLM flag, it describes the target host).
    ``kind``: how a value given to vLLM is read (int, float, bool, choice, json); ``vllm`` lists vLLM's
    spellings (the first is what hybridpd writes); a bool's negation is ``--no-`` + the flag, as vLLM's parser.
    """

    field: str
    kind: str
    side: str
    auto: str
    vllm: tuple[str, ...] = ()
    flag: str | None = None  # hybridpd flag (both sides); None: only per side
    param: str | None = None  # its click parameter name
    flags: tuple[str, str] | None = None  # (P flag, D flag) of a per-side setting
    params: tuple[str, str] | None = None  # their click parameter names
    choices: tuple[str, ...] = ()
    env: str | None = None  # environment variable that sets it (--env KEY=VALUE)
    aliases: tuple[tuple[str, str], ...] = ()  # vLLM value -> hybridpd value

    @property
    def hybridpd_flags(self) -> tuple[str, ...]:
        return tuple(x for x in (self.flag, *(self.flags or ())) if x)


ATTENTION_BACKENDS = ("flash_attn", "flashinfer", "triton", "cpu_attn")
MODEL_DTYPES = ("bfloat16", "float16")

SETTINGS: tuple[Setting, ...] = (
    Setting("tp", "int", "each", "1", vllm=("--tensor-parallel-size", "-tp"), flags=("--ptp", "--dtp"),
            params=("ptp", "dtp")),
    Setting("block_size", "int", "each", "the attention backend's / platform's block", vllm=("--block-size",),
            flag="--block-size", param="block_size", flags=("--p-block-size", "--d-block-size"),
            params=("p_block_size", "d_block_size")),
    Setting("dtype", "choice", "both", "the model's dtype", vllm=("--dtype",), flag="--dtype", param="dtype",
            choices=MODEL_DTYPES, aliases=(("auto", ""), ("half", "float16"))),
    Setting("kv_cache_dtype", "choice", "both", "the model dtype", vllm=("--kv-cache-dtype",),
            flag="--kv-cache-dtype", param="kv_cache_dtype", choices=KV_DTYPES),
    Setting("mamba_cache_dtype", "choice", "both", "the model dtype (conv and SSM state)",
            vllm=("--mamba-cache-dtype",), flag="--mamba-cache-dtype", param="mamba_cache_dtype", choices=MAMBA_DTYPES),
    Setting("mamba_ssm_cache_dtype", "choice", "both", "--mamba-cache-dtype", vllm=("--mamba-ssm-cache-dtype",),
            flag="--mamba-ssm-cache-dtype", param="mamba_ssm_cache_dtype", choices=MAMBA_DTYPES),
    Setting("attention_backend", "choice", "both", "the platform's default backend", vllm=("--attention-backend",),
            flag="--attention-backend", param="attention_backend", choices=ATTENTION_BACKENDS,
            aliases=(("triton_attn", "triton"),)),
    Setting("enable_prefix_caching", "bool", "both", "vLLM's default for the release",
            vllm=("--enable-prefix-caching",), flag="--enable-prefix-caching", param="enable_prefix_caching"),
    Setting("num_speculative_tokens", "json", "both", "0 (no speculative decoding)", vllm=("--speculative-config",),
            flag="--num-speculative-tokens", param="num_speculative_tokens"),
    Setting("max_model_len", "int", "both", "the model's max_position_embeddings", vllm=("--max-model-len",),
            flag="--max-model-len", param="max_model_len"),
    Setting("num_blocks", "int", "both", "what the memory budget holds", vllm=("--num-gpu-blocks-override",),
            flag="--num-blocks", param="num_blocks"),
    Setting("kv_cache_memory", "int", "both", "--gpu-memory x utilization", vllm=("--kv-cache-memory-bytes",),
            flag="--kv-cache-memory", param="kv_cache_memory"),
    Setting("gpu_memory_utilization", "float", "both", "0.9", vllm=("--gpu-memory-utilization",),
            flag="--gpu-memory-utilization", param="gpu_memory_utilization"),
    Setting("disable_hybrid_kv_cache_manager", "bool", "both", "off (HMA on)",
            vllm=("--disable-hybrid-kv-cache-manager",), flag="--disable-hybrid-kv-cache-manager",
            param="disable_hybrid_kv_cache_manager"),
    Setting("conv_layout", "choice", "both", "DS", flag="--conv-layout", param="conv_layout", choices=("DS", "SD"),
            env="VLLM_SSM_CONV_STATE_LAYOUT"),
    Setting("gpu_memory", "bytes", "host", "not known (no capacity figures)", flag="--gpu-memory", param="gpu_memory"),
    Setting("weights_memory", "bytes", "host", "0 (not subtracted: an upper bound)", flag="--weights-memory",
            param="weights_memory"),
    Setting("cpu_avx512_bf16", "bool", "host", "this host's CPU flags", flag="--cpu-avx512-bf16",
            param="cpu_avx512_bf16"),
    Setting("cpu_amx_tile", "bool", "host", "this host's CPU flags", flag="--cpu-amx-tile", param="cpu_amx_tile"),
)
BY_FIELD = {s.field: s for s in SETTINGS}
# vLLM flags serve writes itself and a pass-through argument must not override (the launch would not be the plan's)
OWNED_FLAGS = {"--host": "--host", "--port": "--prefill-port/--decode-port"}


def flag_of(field: str) -> str:
    """The flag a user reads a field as (plan's flag; per-side only: TP)."""
    s = BY_FIELD.get(field)
    if s is None:
        return field
    return "TP" if s.field == "tp" else (s.flag or field)


def both_sides_params() -> tuple[str, ...]:
    """Click parameter names of the settings one flag sets on both sides alike."""
    return tuple(s.param for s in SETTINGS if s.side in ("both", "host") and s.param)


def pair_from_flags(values: Mapping[str, Any]) -> tuple[EngineSettings, EngineSettings]:
    """(P, D) settings from parsed hybridpd flags (click parameter names -> values; absent or None = auto)."""
    common: dict[str, Any] = {}
    for s in SETTINGS:
        if s.side == "each" or s.param is None:
            continue
        v = values.get(s.param)
        if v is not None:  # None: the field's default (its 'auto')
            common[s.field] = v
    sides = []
    for i in (0, 1):
        own: dict[str, Any] = {}
        for s in SETTINGS:
            if s.side != "each" or s.params is None:
                continue
            v = values.get(s.params[i])
            if v is None and s.param:
                v = values.get(s.param)
            if v is not None:
                own[s.field] = v
        sides.append(EngineSettings(**common, **own))
    return sides[0], sides[1]


# ----------------------------------------------------------------------- vLLM arguments -> settings


@dataclass(frozen=True)
class Overlay:
    """What a list of `vllm serve` arguments (or environment pairs) sets: fields, the arguments that set each, and
    the arguments left to pass through (those the table does not know, plus --speculative-config, kept as given)."""

    values: tuple[tuple[str, Any], ...] = ()
    given: tuple[tuple[str, str], ...] = ()  # (field, the argument text that set it)
    rest: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)


def _vllm_index() -> dict[str, tuple[Setting, bool]]:
    out: dict[str, tuple[Setting, bool]] = {}
    for s in SETTINGS:
        for f in s.vllm:
            out[f] = (s, True)
            if s.kind == "bool":
                out["--no-" + f[2:]] = (s, False)
    return out


def _convert(s: Setting, text: str, flag: str, where: str) -> Any:
    bad = UsageError(f"{flag} {text[:40]!r} is not a valid value", field=where,
                     fix=f"give {flag} " + ({"int": "a whole number", "float": "a number"}.get(s.kind, "")
                                            or ("one of " + ", ".join(s.choices) if s.choices else "a JSON object")))
    if s.kind == "int":
        if not text.strip().isdigit() or len(text.strip()) > 18:
            raise bad
        return int(text)
    if s.kind == "float":
        try:
            v = float(text)
        except ValueError:
            raise bad from None
        return v
    if s.kind == "json":  # --speculative-config: the field is its num_speculative_tokens
        import json

        try:
            cfg = json.loads(text)
        except ValueError:
            raise bad from None
        n = cfg.get("num_speculative_tokens", 0) if isinstance(cfg, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise UsageError(f"{flag} has no whole num_speculative_tokens", field=where,
                             fix='write e.g. {"method": "mtp", "num_speculative_tokens": 1}')
        return n
    key = text.lower() if s.field == "attention_backend" else text
    name = dict(s.aliases).get(key, key)
    if name == "" and s.field == "dtype":
        return None
    if name not in s.choices:
        raise bad
    return name


def parse_vllm_args(args: tuple[str, ...] | list[str], *, where: str) -> Overlay:
    """The settings a list of `vllm serve` arguments sets (the last one wins, as in vLLM's parser).

    ``where`` names the option the arguments came from (--decode-arg, ...) in errors. A flag serve writes
    itself (--host, --port) is refused: the launch would not be the one planned."""
    index = _vllm_index()
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    args = list(args)
    while i < len(args):
        a = args[i]
        flag, eq, inline = a.partition("=")
        if flag in OWNED_FLAGS:
            raise UsageError(f"{flag} is set by hybridpd serve", field=where, fix=f"use serve's {OWNED_FLAGS[flag]}")
        hit = index.get(flag) if flag.startswith("-") else None
        if hit is None:
            rest.append(a)
            i += 1
            continue
        s, positive = hit
        if s.kind == "bool":
            if eq:
                raise UsageError(f"{flag} takes no value", field=where, fix=f"write {flag} or --no-{flag[2:]}")
            values[s.field], given[s.field] = positive, flag
            i += 1
            continue
        if eq:
            text, used = inline, [a]
        elif i + 1 < len(args):
            text, used = args[i + 1], [a, args[i + 1]]
        else:
            raise UsageError(f"{flag} needs a value", field=where)
        values[s.field] = _convert(s, text, flag, where)
        given[s.field] = " ".join(used)
        if s.kind == "json":  # hybridpd does not write --speculative-config: it passes through as given
            rest += used
        i += len(used)
    return Overlay(values=tuple(values.items()), given=tuple(given.items()), rest=tuple(rest))


def parse_env(pairs: tuple[tuple[str, str], ...], *, where: str = "--env") -> Overlay:
    """The settings environment variables set (VLLM_SSM_CONV_STATE_LAYOUT -> conv_layout)."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for k, v in pairs:
        for s in SETTINGS:
            if s.env == k:
                values[s.field] = _convert(s, v, k, where)
                given[s.field] = f"{k}={v}"
    return Overlay(values=tuple(values.items()), given=tuple(given.items()))


def apply_overlay(s: EngineSettings, *overlays: Overlay) -> EngineSettings:
    """Settings with each overlay's values over them, in order."""
    from dataclasses import replace

    out = s
    for o in overlays:
        if o.values:
            out = replace(out, **o.as_dict())
    return out
