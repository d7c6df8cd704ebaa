"""How many requests one side holds: blocks that fit, blocks per request, maximum concurrency and its limit.

Mirrors, per release (read from the 0.24.0, 0.26.0 and 0.32.0 wheels, identical in what is used here):
- ``get_num_blocks`` / ``get_kv_cache_config_from_groups``: ``available // page // group_size`` blocks in one pool
  that every HMA group (attention and Mamba) draws from (``SideLayout.num_blocks``);
- ``get_max_concurrency_for_kv_cache_config``: a request at ``max_model_len`` takes, per group,
  ``cdiv(spec.max_memory_usage_bytes, page)`` blocks, i.e. ``cdiv(len, block)`` per attention group and, per Mamba
  group, by ``mamba_cache_mode``: 'none' ``1 + spec``, 'align' ``2 + spec``, 'all' ``cdiv(len, block) + spec``
  (``MambaSpec.max_memory_usage_bytes``; spec = ``num_speculative_blocks``); the engine logs
  ``num_blocks / blocks_per_request`` as "Maximum concurrency" and ``int(that * max_model_len)`` as
  "GPU KV cache size: N tokens" (``get_kv_cache_capacity``);
- ``_check_enough_kv_cache_memory``: the engine refuses to start when one request at ``max_model_len`` needs more
  than the pool (equivalently: more blocks than fit);
- ``CompilationConfig`` (vLLM issue 49064, PR 38270): with full CUDA graphs (CUDA, no ``--enforce-eager``) and Mamba
  layers, the engine refuses ``max_num_seqs > num_blocks`` ("exceeds available Mamba cache blocks");
- ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``: the OpenAI server's default ``max_num_seqs``
  is 1024 on a GPU with >= 70 GiB (not an A100), 256 on smaller GPUs, ``128 * world_size`` on CPU.

Pure functions over frozen dataclasses; the engine-logged figures they reproduce are pinned in
tests/test_capacity.py (H200 logs under docs/gpu-vllm-2026-12-01/).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hybridpd.core.families import ATTENTION, MAMBA
from hybridpd.core.findings import ERROR, WARNING, Finding
from hybridpd.core.layout import SideLayout, cdiv, side_layout

if TYPE_CHECKING:
    from hybridpd.core.plan import Plan

GIB = 1 << 30
# EngineArgs defaults for the OpenAI server (0.24 .. 0.32 alike): (device memory >= this, max_num_seqs)
CUDA_DEFAULT_MAX_NUM_SEQS = ((70 * GIB, 1024), (0, 256))
CPU_DEFAULT_MAX_NUM_SEQS_PER_RANK = 128
POOL_NOTE = ("one block pool shared by every HMA group: each block holds one page per layer slot, for attention "
             "KV or a Mamba state alike")


def mamba_blocks_per_group(mode: str, length: int, block: int, spec_blocks: int = 0) -> int:
    """Blocks one request of ``length`` tokens takes in one Mamba group (``MambaSpec.max_memory_usage_bytes``)."""
    if mode == "all":
        return cdiv(length, block) + spec_blocks
    if mode == "align":
        return 2 + spec_blocks
    return 1 + spec_blocks


@dataclass(frozen=True, kw_only=True)
class RequestBlocks:
    """The blocks one request of ``length`` tokens takes from the pool, split by group kind."""

    length: int
    attention: int  # over all attention groups
    mamba: int  # over all Mamba groups
    fits: int | None  # requests of this length the pool holds at once (None: memory not given)

    @property
    def total(self) -> int:
        return self.attention + self.mamba

    def as_dict(self) -> dict[str, Any]:
        return {"isl": self.length, "attention_blocks": self.attention, "mamba_blocks": self.mamba,
                "blocks": self.total, "requests_that_fit": self.fits}


def request_blocks(side: SideLayout, length: int) -> RequestBlocks:
    spec = side.settings.num_speculative_tokens if side.mamba is not None else 0
    n_attn = sum(1 for g in side.groups if g.kind == ATTENTION)
    n_mamba = sum(1 for g in side.groups if g.kind == MAMBA)
    attn = n_attn * cdiv(length, side.block_size)
    mamba = n_mamba * mamba_blocks_per_group(side.mamba_cache_mode, length, side.block_size, spec)
    total = attn + mamba
    fits = side.num_blocks // total if side.num_blocks is not None and total else None
    return RequestBlocks(length=length, attention=attn, mamba=mamba, fits=fits)


@dataclass(frozen=True, kw_only=True)
class SideCapacity:
    role: str
    prefix_caching: bool
    mamba_cache_mode: str
    block_size: int
    page_size_bytes: int
    num_shared_tensors: int
    num_blocks: int | None
    num_blocks_reason: str | None
    max_model_len: int | None
    at_max: RequestBlocks | None  # one request at max_model_len
    per_isl: tuple[RequestBlocks, ...]
    max_num_seqs: int | None
    max_num_seqs_source: str
    cuda_graphs: bool
    has_mamba: bool

    @property
    def pool_bytes(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.page_size_bytes * self.num_shared_tensors

    @property
    def max_concurrency(self) -> float | None:
        """vLLM's "Maximum concurrency for max_model_len tokens per request" (num_blocks / blocks per request)."""
        if self.num_blocks is None or self.at_max is None or not self.at_max.total:
            return None
        return self.num_blocks / self.at_max.total

    @property
    def kv_cache_tokens(self) -> int | None:
        """vLLM's "GPU KV cache size: N tokens" (int(max_concurrency * max_model_len))."""
        c = self.max_concurrency
        return None if c is None or self.max_model_len is None else int(c * self.max_model_len)

    @property
    def concurrency(self) -> int | None:
        """Requests at max_model_len running at once: whole requests that fit, capped by max_num_seqs."""
        c = self.max_concurrency
        if c is None:
            return None
        fit = int(c)
        return min(fit, self.max_num_seqs) if self.max_num_seqs is not None else fit

    @property
    def limited_by(self) -> str | None:
        """'max_num_seqs', or the kind of group ('attention' / 'mamba') that takes most of a request's blocks."""
        c = self.max_concurrency
        if c is None or self.at_max is None:
            return None
        if self.max_num_seqs is not None and self.max_num_seqs <= int(c):
            return "max_num_seqs"
        return ATTENTION if self.at_max.attention >= self.at_max.mamba else MAMBA

    def findings(self) -> Iterable[Finding]:
        nb = self.num_blocks
        if nb is None:
            return
        where = f"{self.role}: "
        if self.at_max is not None and self.at_max.total > nb:
            yield Finding(severity=ERROR, code="kv-cache-too-small",
                          message=f"{where}one request at max_model_len {self.max_model_len:,} needs "
                                  f"{self.at_max.total:,} blocks ({self.at_max.attention:,} attention + "
                                  f"{self.at_max.mamba:,} Mamba), {nb:,} fit ({self.num_blocks_reason}); vLLM "
                                  "refuses to start ('larger than the available KV cache memory')",
                          fix="give that side more KV-cache memory, or lower --max-model-len")
        if not (self.has_mamba and self.cuda_graphs):
            return
        if self.max_num_seqs is not None and self.max_num_seqs > nb:
            yield Finding(severity=ERROR, code="max-num-seqs-mamba",
                          message=f"{where}max_num_seqs {self.max_num_seqs:,} ({self.max_num_seqs_source}) exceeds the "
                                  f"{nb:,} Mamba cache blocks that fit; with CUDA graphs vLLM refuses to start "
                                  "('exceeds available Mamba cache blocks', vLLM issue 49064)",
                          fix=f"pass --max-num-seqs {nb} or less to vLLM (after --), give that side more KV-cache "
                              "memory, or --enforce-eager")
        elif self.max_num_seqs is None:
            low = min(n for _, n in CUDA_DEFAULT_MAX_NUM_SEQS)
            high = max(n for _, n in CUDA_DEFAULT_MAX_NUM_SEQS)
            if nb < high:
                gpus = "every GPU" if nb < low else "a GPU with >= 70 GiB"
                yield Finding(severity=ERROR if nb < low else WARNING, code="max-num-seqs-mamba",
                              message=f"{where}{nb:,} Mamba cache blocks fit, fewer than vLLM's default max_num_seqs on "
                                      f"{gpus} ({high} from 70 GiB, {low} below); with CUDA graphs vLLM refuses to "
                                      "start ('exceeds available Mamba cache blocks', vLLM issue 49064)",
                              fix=f"pass --max-num-seqs {nb} or less to vLLM (after --), or --gpu-memory so the "
                                  "default is known")

    def as_dict(self) -> dict[str, Any]:
        c = self.max_concurrency
        return {"role": self.role, "prefix_caching": self.prefix_caching, "mamba_cache_mode": self.mamba_cache_mode,
                "block_size": self.block_size, "num_blocks": self.num_blocks,
                "num_blocks_reason": self.num_blocks_reason, "pool_bytes": self.pool_bytes,
                "max_model_len": self.max_model_len,
                "blocks_per_request_at_max_model_len": self.at_max.as_dict() if self.at_max else None,
                "max_concurrency": None if c is None else round(c, 4), "kv_cache_tokens": self.kv_cache_tokens,
                "max_num_seqs": self.max_num_seqs, "max_num_seqs_source": self.max_num_seqs_source,
                "cuda_graphs": self.cuda_graphs, "concurrency": self.concurrency, "limited_by": self.limited_by,
                "per_isl": [r.as_dict() for r in self.per_isl]}


def default_max_num_seqs(side: SideLayout) -> tuple[int | None, str]:
    """vLLM's default max_num_seqs for this side's platform and memory (None: depends on a GPU size not given)."""
    if side.platform.name == "cpu":
        return CPU_DEFAULT_MAX_NUM_SEQS_PER_RANK * side.tp, f"vLLM's CPU default {CPU_DEFAULT_MAX_NUM_SEQS_PER_RANK} x TP"
    mem = side.settings.gpu_memory
    if mem is None:
        return None, "vLLM's default (256, or 1024 on GPUs with >= 70 GiB); pass --gpu-memory to know which"
    for floor, n in CUDA_DEFAULT_MAX_NUM_SEQS:
        if mem >= floor:
            return n, f"vLLM's default for a {mem / GIB:.0f} GiB GPU" + (" (256 on an A100)" if n == 1024 else "")
    raise AssertionError("unreachable: the last floor is 0")


def side_capacity(side: SideLayout, *, max_model_len: int | None, isls: Sequence[int] = (),
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  enforce_eager: bool = False) -> SideCapacity:
    """One side's capacity; ``max_num_seqs`` / ``max_num_batched_tokens`` / ``enforce_eager`` as `vllm serve`
    gets them (None: vLLM's default, which it lowers to --max-num-batched-tokens when that is given)."""
    mns: int | None
    if max_num_seqs is not None:
        mns, src = max_num_seqs, "--max-num-seqs"
    else:
        mns, src = default_max_num_seqs(side)
        low = min(n for _, n in CUDA_DEFAULT_MAX_NUM_SEQS)
        if max_num_batched_tokens is not None and max_num_batched_tokens < (mns if mns is not None else low):
            mns, src = max_num_batched_tokens, "vLLM's default lowered to --max-num-batched-tokens"
    return SideCapacity(
        role=side.role, prefix_caching=side.prefix_caching, mamba_cache_mode=side.mamba_cache_mode,
        block_size=side.block_size, page_size_bytes=side.page_size_bytes,
        num_shared_tensors=max(side.num_shared_tensors, 1), num_blocks=side.num_blocks,
        num_blocks_reason=side.num_blocks_reason, max_model_len=max_model_len,
        at_max=request_blocks(side, max_model_len) if max_model_len else None,
        per_isl=tuple(request_blocks(side, n) for n in isls), max_num_seqs=mns, max_num_seqs_source=src,
        cuda_graphs=side.platform.name == "cuda" and not enforce_eager, has_mamba=side.mamba is not None)


def other_prefix_caching(side: SideLayout) -> SideLayout | None:
    """The same side with prefix caching flipped (its own block size, mode and blocks), or None if not plannable."""
    from hybridpd.errors import HybridPDError

    try:
        other = side_layout(side.model, replace(side.settings, enable_prefix_caching=not side.prefix_caching),
                            side.profile, side.platform, role=side.role)
    except HybridPDError:
        return None
    return other if not other.errors else None


@dataclass(frozen=True, kw_only=True)
class PlanCapacity:
    prefill: SideCapacity
    decode: SideCapacity
    prefill_other: SideCapacity | None  # prefix caching flipped
    decode_other: SideCapacity | None

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(f for s in (self.prefill, self.decode) for f in s.findings())

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"note": POOL_NOTE}
        for role, cur, other in (("prefill", self.prefill, self.prefill_other),
                                 ("decode", self.decode, self.decode_other)):
            out[role] = {**cur.as_dict(), "prefix_caching_flipped": other.as_dict() if other else None}
        return out


def plan_capacity(plan: Plan, *, max_num_seqs: tuple[int | None, int | None] = (None, None),
                  max_num_batched_tokens: tuple[int | None, int | None] = (None, None),
                  enforce_eager: tuple[bool, bool] = (False, False), flipped: bool = True) -> PlanCapacity:
    """Both sides of ``plan`` at its ISLs; the engine arguments per side (P, D) as `vllm serve` gets them;
    ``flipped`` adds each side with prefix caching the other way (hybrids only)."""
    from hybridpd.core.plan import max_model_len

    isls = [t.isl for t in plan.transfers]
    caps: list[SideCapacity] = []
    others: list[SideCapacity | None] = []
    for i, side in enumerate((plan.prefill, plan.decode)):
        mml = max_model_len(plan.model, side.settings)
        kw: dict[str, Any] = dict(max_model_len=mml, isls=isls, max_num_seqs=max_num_seqs[i],
                                  max_num_batched_tokens=max_num_batched_tokens[i], enforce_eager=enforce_eager[i])
        caps.append(side_capacity(side, **kw))
        other = other_prefix_caching(side) if flipped and side.model.has_mamba else None
        others.append(side_capacity(other, **kw) if other is not None else None)
    return PlanCapacity(prefill=caps[0], decode=caps[1], prefill_other=others[0], decode_other=others[1])


def engine_args(argv: Sequence[str]) -> tuple[int | None, int | None, bool]:
    """(--max-num-seqs, --max-num-batched-tokens, --enforce-eager) as a `vllm serve` argv sets them (the last wins;
    a value vLLM cannot parse is left to vLLM to reject)."""
    ints: dict[str, int | None] = {"--max-num-seqs": None, "--max-num-batched-tokens": None}
    eager = False
    args = list(argv)
    for i, a in enumerate(args):
        name, _, val = a.partition("=")
        if name in ints:
            if not val and i + 1 < len(args):
                val = args[i + 1]
            ints[name] = int(val) if val.isdigit() else None
        elif a in ("--enforce-eager", "--no-enforce-eager"):
            eager = a == "--enforce-eager"
    return ints["--max-num-seqs"], ints["--max-num-batched-tokens"], eager
