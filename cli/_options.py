"""Click options and types shared by plan, verify and serve (domain units parse at the edge)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hybridpd.core.profiles import versions_help
from hybridpd.core.settings import ATTENTION_BACKENDS, KV_DTYPES, MAMBA_DTYPES, MODEL_DTYPES, EngineSettings
from hybridpd.core.validate import MAX_BLOCK_SIZE, MAX_BYTES, MAX_NUM_BLOCKS, MAX_SPEC_TOKENS, MAX_TOKENS, MAX_TP

F = TypeVar("F", bound=Callable[..., Any])


# Upper bounds on flags are the ones deployment records are checked against (hybridpd.core.validate): far above
# any real deployment, low enough that nothing runs for ever or eats memory.
MAX_ISLS = 64

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d{1,3}))?\s*([kKmMgGtTpP]?)(i?)([bB]?)\s*")
_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_byte_size(text: str, *, field: str = "size", max_bytes: int = MAX_BYTES) -> int:
    """'141GB' (10^9), '80GiB' (2^30), '512MiB', '1.5e9B' -> bytes. A unit is required: a bare '141' is refused."""
    from hybridpd.errors import UsageError

    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise UsageError(f"cannot parse size {str(text)[:40]!r}", field=field, fix="write e.g. 141GB, 80GiB or 512MiB")
    digits, exp, unit, binary, b = m.groups()
    if not unit and not b:
        n = str(text).strip() if not exp and len(digits) <= 12 else "141"
        raise UsageError(f"size {n!r} has no unit", field=field,
                         fix=f"write {n}GB (10^9 bytes), {n}GiB (2^30 bytes) or {n}B (bytes)")
    if binary and not unit:
        raise UsageError(f"cannot parse size {text.strip()!r}", field=field, fix="write e.g. 141GB, 80GiB or 512MiB")
    from fractions import Fraction  # only when a size is given (~2 ms of `plan`'s cold start otherwise)

    num = Fraction(digits) * Fraction(10) ** int(exp or 0) * (1024 if binary else 1000) ** _UNITS[unit.upper()]
    if num > max_bytes:
        raise UsageError(f"size {text.strip()!r} is more than {max_bytes:,} bytes (1 PiB)", field=field,
                         fix="give the memory of one device, e.g. 141GB")
    return int(num)


class ByteSize(click.ParamType):
    """A memory size with a unit (141GB, 80GiB, 512MiB); bare numbers, inf/nan and more than 1 PiB are refused."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        from hybridpd.errors import UsageError

        try:
            return parse_byte_size(value, field="")  # click names the option
        except UsageError as e:
            self.fail(str(e), param, ctx)


class BoundedInt(click.IntRange):
    """click.IntRange that also refuses more than 30 digits before converting (no int-string limit traceback)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and len(value.strip()) > 30:
            self.fail(f"{value[:20]!r}... is not a valid integer in range {self._describe_range()}", param, ctx)
        return super().convert(value, param, ctx)


def TPSize() -> BoundedInt:  # noqa: N802 - reads like a type at the call site
    """A tensor-parallel size, 1..MAX_TP."""
    t = BoundedInt(1, MAX_TP)
    t.name = "TP"
    return t


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan and inf (click lets nan through every range check)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


class ModelArg(click.ParamType):
    name = "MODEL"

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from .completions import model_items  # ids and aliases, plus file names (ux, #16)

        return model_items(incomplete)


_ISL_RE = re.compile(r"(\d{1,30}(?:\.\d{0,6})?|\.\d{1,6})\s*([kK]?)")


def parse_isls(value: str, *, max_tokens: int = MAX_TOKENS) -> tuple[int, ...]:
    """'1024,8k,1.5k' -> (1024, 8192, 1536); each in 1..max_tokens, at most MAX_ISLS of them."""
    parts = [x.strip() for x in value.split(",")]
    if len(parts) > MAX_ISLS:
        raise click.BadParameter(f"{len(parts)} input lengths; at most {MAX_ISLS}")
    out = []
    for part in parts:
        m = _ISL_RE.fullmatch(part)
        if not m:
            raise click.BadParameter(f"{part[:20]!r} is not a token count: use comma-separated token counts, "
                                     "e.g. 1024,8k,32k (k = 1024)")
        from fractions import Fraction

        n = Fraction(m.group(1)) * (1024 if m.group(2) else 1)
        if n.denominator != 1:
            raise click.BadParameter(f"{part!r} is {float(n):g} tokens, not a whole number")
        if not 1 <= n <= max_tokens:
            raise click.BadParameter(f"{part!r} = {int(n):,} tokens is outside 1..{max_tokens:,}")
        out.append(int(n))
    return tuple(out)


def isl_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """--isl; the model's own limit (max_model_len) is checked by build_plan, which knows the model."""
    if not value:
        return None
    return parse_isls(value)


def engine_options(func: F) -> F:
    """The `vllm serve` flags that shape the layout, for both sides of the pair."""
    opts = [
        click.option("--ptp", type=TPSize(), default=1, show_default=True, help="Prefill TP size."),
        click.option("--dtp", type=TPSize(), default=1, show_default=True, help="Decode TP size."),
        click.option("--block-size", type=BoundedInt(1, MAX_BLOCK_SIZE), default=None,
                     help="--block-size for both sides (default: backend/platform choice)."),
        click.option("--p-block-size", type=BoundedInt(1, MAX_BLOCK_SIZE), default=None, help="Override for P only."),
        click.option("--d-block-size", type=BoundedInt(1, MAX_BLOCK_SIZE), default=None, help="Override for D only."),
        click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True),
        click.option("--mamba-cache-dtype", type=click.Choice(MAMBA_DTYPES), default="auto", show_default=True),
        click.option("--mamba-ssm-cache-dtype", type=click.Choice(MAMBA_DTYPES), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(MODEL_DTYPES), default=None,
                     help="Model dtype override."),
        click.option("--attention-backend", type=click.Choice(ATTENTION_BACKENDS),
                     default=None, help="Default: flash_attn (cuda) / cpu_attn (cpu)."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                     help="Default: vLLM's default for the version (0.32: on for hybrid)."),
        click.option("--num-speculative-tokens", type=BoundedInt(0, MAX_SPEC_TOKENS), default=0, show_default=True),
        click.option("--max-model-len", type=BoundedInt(1, MAX_TOKENS), default=None),
        click.option("--gpu-memory", type=ByteSize(), default=None, help="Device memory, e.g. 141GB."),
        click.option("--gpu-memory-utilization", type=FiniteFloatRange(0, 1, min_open=True), default=0.9,
                     show_default=True),
        click.option("--weights-memory", type=ByteSize(), default=None,
                     help="Weights per rank to subtract from --gpu-memory (default: not subtracted, upper bound)."),
        click.option("--kv-cache-memory", type=ByteSize(), default=None, help="KV-cache budget per rank."),
        click.option("--num-blocks", type=BoundedInt(1, MAX_NUM_BLOCKS), default=None, help="Logical blocks per rank."),
        click.option("--conv-layout", type=click.Choice(["DS", "SD"]), default="DS", show_default=True,
                     help="VLLM_SSM_CONV_STATE_LAYOUT."),
        click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=False),
        click.option("--vllm-version", default=None, metavar="X.Y[.Z]", shell_complete=_complete_versions,
                     help=f"vLLM release to plan for; verified: {versions_help()} (a newer release is planned with "
                          "the newest profile and a warning). Default: the installed vLLM, else the newest profile."),
        click.option("--platform", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True),
        click.option("--cpu-amx-tile/--no-cpu-amx-tile", default=None,
                     help="--platform cpu: whether the target host has AMX tiles (vLLM 0.22-0.28 force the SD conv "
                          "layout there). Default: this host's CPU flags."),
        click.option("--cpu-avx512-bf16/--no-cpu-avx512-bf16", default=None,
                     help="--platform cpu: whether the target host has avx512_bf16 (vLLM then keeps the SSM "
                          "state in fp32). Default: this host's CPU flags."),
        click.option("--allow-network", is_flag=True, default=False,
                     help="Let MODEL resolution download config.json from the Hugging Face Hub."),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def _complete_versions(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    from hybridpd.core.profiles import PROFILES

    return [p.name for p in PROFILES if p.name.startswith(incomplete)]


def _host_flag(given: bool | None, name: str) -> bool:
    """A CPU flag of the target host: the flag's value, else this host's (read once, here at the edge)."""
    if given is not None:
        return given
    from hybridpd.host import cpu_flags

    return bool(getattr(cpu_flags(), name))


def target_from(kw: dict[str, Any], *, installed: str | None = None, installed_source: str = "installed vLLM") -> Any:
    """The vLLM release a command targets: --vllm-version, else the installed vLLM, else the newest profile."""
    from hybridpd.core.profiles import resolve_target
    from hybridpd.host import installed_vllm_version

    if installed is None:
        installed = installed_vllm_version()
    return resolve_target(kw["vllm_version"], installed=installed, installed_source=installed_source)


def settings_from(kw: dict[str, Any]) -> tuple[EngineSettings, EngineSettings]:
    """(P, D) from the engine options, through the settings table (hybridpd.core.settings.SETTINGS)."""
    from hybridpd.core.settings import pair_from_flags

    return pair_from_flags({**kw, "cpu_avx512_bf16": _host_flag(kw["cpu_avx512_bf16"], "avx512_bf16"),
                            "cpu_amx_tile": _host_flag(kw.get("cpu_amx_tile"), "amx_tile")})
