"""Click options and types shared by plan, verify and serve (domain units parse at the edge)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from hybridpd.settings import KV_DTYPES, MAMBA_DTYPES, EngineSettings, parse_size

F = TypeVar("F", bound=Callable[..., Any])


class ByteSize(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        from hybridpd.errors import UsageError

        try:
            return parse_size(value, field=param.opts[0] if param else "size")
        except UsageError as e:
            self.fail(str(e), param, ctx)


class ModelArg(click.ParamType):
    name = "MODEL"

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        from hybridpd.models import completion_candidates

        return [CompletionItem(c) for c in completion_candidates() if c.startswith(incomplete)]


def isl_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        out = tuple(int(float(v[:-1]) * 1024) if v.lower().endswith("k") else int(v)
                    for v in (x.strip() for x in value.split(",")))
    except ValueError:
        raise click.BadParameter(f"{value!r}: use comma-separated token counts, e.g. 1024,8k,32k") from None
    if any(v < 1 for v in out):
        raise click.BadParameter("input lengths must be >= 1")
    return out


def engine_options(func: F) -> F:
    """The `vllm serve` flags that shape the layout, for both sides of the pair."""
    opts = [
        click.option("--ptp", type=click.IntRange(min=1), default=1, show_default=True, help="Prefill TP size."),
        click.option("--dtp", type=click.IntRange(min=1), default=1, show_default=True, help="Decode TP size."),
        click.option("--block-size", type=click.IntRange(min=1), default=None,
                     help="--block-size for both sides (default: backend/platform choice)."),
        click.option("--p-block-size", type=click.IntRange(min=1), default=None, help="Override for P only."),
        click.option("--d-block-size", type=click.IntRange(min=1), default=None, help="Override for D only."),
        click.option("--kv-cache-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True),
        click.option("--mamba-cache-dtype", type=click.Choice(MAMBA_DTYPES), default="auto", show_default=True),
        click.option("--mamba-ssm-cache-dtype", type=click.Choice(MAMBA_DTYPES), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default=None,
                     help="Model dtype override."),
        click.option("--attention-backend", type=click.Choice(["flash_attn", "flashinfer", "triton", "cpu_attn"]),
                     default=None, help="Default: flash_attn (cuda) / cpu_attn (cpu)."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                     help="Default: vLLM's default for the version (0.32: on for hybrid)."),
        click.option("--num-speculative-tokens", type=click.IntRange(min=0), default=0, show_default=True),
        click.option("--max-model-len", type=click.IntRange(min=1), default=None),
        click.option("--gpu-memory", type=ByteSize(), default=None, help="Device memory, e.g. 141GB."),
        click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9,
                     show_default=True),
        click.option("--weights-memory", type=ByteSize(), default=None,
                     help="Weights per rank to subtract from --gpu-memory (default: not subtracted, upper bound)."),
        click.option("--kv-cache-memory", type=ByteSize(), default=None, help="KV-cache budget per rank."),
        click.option("--num-blocks", type=click.IntRange(min=1), default=None, help="Logical blocks per rank."),
        click.option("--conv-layout", type=click.Choice(["DS", "SD"]), default="DS", show_default=True,
                     help="VLLM_SSM_CONV_STATE_LAYOUT."),
        click.option("--disable-hybrid-kv-cache-manager", is_flag=True, default=False),
        click.option("--vllm-version", default=None, help="vLLM release, e.g. 0.20, 0.22.1, 0.32 "
                                                          "(default: installed vLLM, else newest profile)."),
        click.option("--platform", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True),
        click.option("--cpu-avx512-bf16/--no-cpu-avx512-bf16", default=None,
                     help="--platform cpu: whether the target host has avx512_bf16 (vLLM then keeps the SSM "
                          "state in fp32). Default: this host's CPU flags."),
        click.option("--allow-network", is_flag=True, default=False,
                     help="Let MODEL resolution download config.json from the Hugging Face Hub."),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def settings_from(kw: dict[str, Any]) -> tuple[EngineSettings, EngineSettings]:
    common = dict(
        kv_cache_dtype=kw["kv_cache_dtype"], mamba_cache_dtype=kw["mamba_cache_dtype"],
        mamba_ssm_cache_dtype=kw["mamba_ssm_cache_dtype"], dtype=kw["dtype"],
        attention_backend=kw["attention_backend"], enable_prefix_caching=kw["enable_prefix_caching"],
        num_speculative_tokens=kw["num_speculative_tokens"], max_model_len=kw["max_model_len"],
        num_blocks=kw["num_blocks"], kv_cache_memory=kw["kv_cache_memory"], gpu_memory=kw["gpu_memory"],
        gpu_memory_utilization=kw["gpu_memory_utilization"], weights_memory=kw["weights_memory"] or 0,
        disable_hybrid_kv_cache_manager=kw["disable_hybrid_kv_cache_manager"], conv_layout=kw["conv_layout"],
        cpu_avx512_bf16=kw["cpu_avx512_bf16"])
    p = EngineSettings(tp=kw["ptp"], block_size=kw["p_block_size"] or kw["block_size"], **common)
    d = EngineSettings(tp=kw["dtp"], block_size=kw["d_block_size"] or kw["block_size"], **common)
    return p, d
