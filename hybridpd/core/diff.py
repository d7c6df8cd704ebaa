"""What changes between two P/D plans A and B: an upgrade, a TP change, a block size, a dtype.

Pure: both plans are built by ``hybridpd.core.plan.build_plan``; this module reads their library values
(SideLayout, DescriptorLayout, RankRoute, RequestTransfer, Finding, VllmProfile) field by field and
keeps only what differs.  Nothing here parses rendered text.

Sections (``Change.section``): ``settings`` (the inputs), ``layout`` and ``nixl`` (per role, one rank:
all ranks of a side are alike), ``groups``, ``reads`` (per D rank and source P rank), ``transfer``
(per ISL, all D ranks), ``capacity`` (blocks and tokens that fit, per role).  Findings and pairing
(the NIXL compatibility hash) have their own structures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybridpd.core.estimate import Calibration, estimate_request
from hybridpd.core.findings import Finding, errors
from hybridpd.core.layout import SideLayout
from hybridpd.core.plan import Plan, build_plan, compat_hash_inputs
from hybridpd.core.profiles import VllmProfile
from hybridpd.core.settings import flag_of
from hybridpd.core.transfer import DescriptorLayout, Span

SCHEMA_VERSION = 1
SECTIONS = ("settings", "layout", "groups", "nixl", "reads", "transfer", "capacity")
ROLES = ("prefill", "decode")
Value = Any  # JSON-able: int, float, str, bool, None or a list of those
Key = tuple[str, Any, str]  # (section, scope, field); scope: role, ISL, "D0<-P1" or None

NOT_HASHED = "(not hashed)"
LLMD_ADVICE = ("llm-d's guidance: the endpoint picker assumes every P/D pair in an InferencePool is compatible, so "
               "deploy B as a new InferencePool (P and D together), move traffic to it, then retire A's pool; never "
               "let A's and B's engines share one pool")


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One side of the diff: a plan plus what the plan itself does not hold."""

    label: str  # how the user wrote it, e.g. "--vllm-version 0.24"
    plan: Plan
    calibration: Calibration | None = None

    @property
    def vllm_version(self) -> str:
        """The release string vLLM hashes, e.g. "0.24.0"."""
        return self.plan.target.text


@dataclass(frozen=True, kw_only=True)
class Change:
    section: str
    scope: Any
    field: str
    a: Value
    b: Value

    @property
    def ratio(self) -> float | None:
        """B/A for numbers (None when either is not a number or A is 0)."""
        num = (int, float)
        if isinstance(self.a, num) and isinstance(self.b, num) and not isinstance(self.a, bool) \
                and not isinstance(self.b, bool) and self.a:
            return self.b / self.a
        return None

    def as_dict(self) -> dict[str, Any]:
        r = self.ratio
        return {"section": self.section, "scope": self.scope, "field": self.field, "a": self.a, "b": self.b,
                "ratio": None if r is None else round(r, 6)}


@dataclass(frozen=True, kw_only=True)
class MixedPair:
    """A P of one variant paired with a D of the other, as happens half-way through a rolling change."""

    prefill: str  # "A" | "B"
    decode: str
    errors: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True, kw_only=True)
class Pairing:
    factors: tuple[tuple[str, Value, Value], ...]  # (name, A, B): what compute_nixl_compatibility_hash hashes
    mixed: tuple[MixedPair, ...]  # only when the hashes match
    advice: str

    @property
    def differing(self) -> tuple[str, ...]:
        return tuple(n for n, a, b in self.factors if a != b)

    @property
    def hash_matches(self) -> bool:
        return not self.differing


@dataclass(frozen=True, kw_only=True)
class PlanDiff:
    a: Variant
    b: Variant
    changes: tuple[Change, ...]
    findings_added: tuple[Finding, ...]
    findings_removed: tuple[Finding, ...]
    pairing: Pairing

    @property
    def identical(self) -> bool:
        return not (self.changes or self.findings_added or self.findings_removed or self.pairing.differing)

    @property
    def b_introduces_error(self) -> bool:
        """B has an error finding (by code) that A does not have."""
        return bool(errors(self.b.plan.findings, allowed={f.code for f in errors(self.a.plan.findings)}))

    def section(self, name: str) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.section == name)


# ---------------------------------------------------------------------------------------------------------
# Facts: every comparable value of one variant, keyed by (section, scope, field), in display order.


def _shape(v: Iterable[int] | None) -> str | None:
    return "x".join(map(str, v)) if v is not None else None


def _span(s: Span | None) -> str | None:
    return f"{s[0]}+{s[1]}" if s else None


def row_format(profile: VllmProfile) -> str:
    """How a release registers descriptors with NIXL (0.33: strided Nx5 rows, reference vllm-0.24-0.33.md §1)."""
    if profile.strided_descriptors:
        return "strided (addr, len, dev, stride, count)"
    return "flat (addr, len, dev), one per block"


def desc_id_formula(side: SideLayout, desc: DescriptorLayout) -> str:
    nphys = "N_log" if side.physical_per_logical == 1 else f"{side.physical_per_logical}*N_log"
    return (f"FA r*N_phys+b (r < {desc.fa_regions}, N_phys = {nphys}); "
            f"Mamba {desc.fa_regions}*N_phys+m*N_log+b (m < {desc.mamba_regions})")


def _side_facts(s: SideLayout) -> list[tuple[str, Value]]:
    m = s.mamba
    return [
        ("num_kv_heads", s.num_kv_heads),
        ("attention_backend", s.backend),
        ("kv_cache_dtype", s.dtypes.kv),
        ("conv_dtype", s.dtypes.conv if m else None),
        ("ssm_dtype", s.dtypes.ssm if m else None),
        ("conv_layout", s.conv_layout if m else None),
        ("conv_state_shape", _shape(m.conv.shape(s.conv_layout)) if m else None),
        ("ssm_state_shape", _shape(m.ssm_shape) if m else None),
        ("conv_state_bytes", m.conv_bytes if m else 0),
        ("ssm_state_bytes", m.ssm_bytes if m else 0),
        ("attn_bytes_per_token", s.attn_bytes_per_token),
        ("attention_block_size", s.block_size),
        ("kernel_block_sizes_supported", s.kernel_sizes.describe() if s.kernel_sizes else None),
        ("kernel_block_size", s.kernel_block_size),
        ("physical_per_logical", s.physical_per_logical),
        ("derived_ratio_v020", s.derived_ratio_v020 if s.profile.derives_remote_ratio else None),
        ("page_size_bytes", s.page_size_bytes),
        ("kernel_page_bytes", s.kernel_page_bytes),
        ("mamba_page_bytes", s.mamba_page_bytes),
        ("padding_bytes", s.padding_bytes),
        ("padding_pct", round(s.padding_pct, 4)),
        ("num_shared_tensors", s.num_shared_tensors),
        ("num_ssm_slots", s.num_ssm_slots if m else None),
        ("mamba_groups", len(s.mamba_groups)),
        ("attention_groups", len(s.attention_groups)),
        ("prefix_caching", s.prefix_caching),
        ("mamba_cache_mode", s.mamba_cache_mode),
        ("errors", list(s.errors)),
    ]


def _nixl_facts(s: SideLayout) -> list[tuple[str, Value]]:
    d = DescriptorLayout.of(s)
    sub = [(f"{n}_desc_bytes", v) for n, v in zip(d.mamba_desc_names, d.mamba_desc_lens, strict=True)]  # x/B/C/ssm
    return [
        ("regions", d.regions),
        ("fa_regions", d.fa_regions),
        ("mamba_regions", d.mamba_regions),
        ("kv_descs_per_block", s.profile.kv_descs_per_block if d.fa_regions else 0),
        ("fa_desc_bytes", d.fa_desc_len),
        *sub,
        ("row_format", row_format(s.profile)),
        ("desc_id_formula", desc_id_formula(s, d)),
        ("num_phys_blocks", d.num_phys_blocks),
        ("num_fa_descs", d.num_fa_descs),
        ("local_descs", d.local_descs),
        ("registered_rows", d.registered_rows),
    ]


def _settings_facts(v: Variant) -> list[tuple[Key, Value]]:
    p = v.plan
    out: list[tuple[Key, Value]] = [
        (("settings", None, "vllm_version"), v.vllm_version),
        (("settings", None, "vllm_profile"), p.profile.name),
        (("settings", None, "nixl_connector_version"), p.profile.nixl_connector_version),
        (("settings", None, "platform"), p.platform.name),
        (("settings", None, "calibration"), v.calibration.name if v.calibration else None),
    ]
    for side in (p.prefill, p.decode):
        for f in dataclasses.fields(side.settings):
            out.append((("settings", side.role, flag_of(f.name)), getattr(side.settings, f.name)))
    return out


def facts(v: Variant) -> dict[Key, Value]:
    p = v.plan
    out: dict[Key, Value] = dict(_settings_facts(v))
    for side in (p.prefill, p.decode):
        out.update({("layout", side.role, k): val for k, val in _side_facts(side)})
    for g in p.prefill.groups:
        out[("groups", g.index, "group")] = f"{g.kind} layers {','.join(map(str, g.layers))}; {g.padding_slots} padding slots"
    for side in (p.prefill, p.decode):
        out.update({("nixl", side.role, k): val for k, val in _nixl_facts(side)})
    for r in p.routes or ():
        for s in r.sources:
            scope = f"D{r.rank}<-P{s.p_rank}"
            conv: tuple[tuple[str, Value], ...] = (("x", _span(s.x)), ("B", _span(s.b)), ("C", _span(s.c)))
            if s.conv is not None and s.x is None:  # Mamba-1 (x) or GatedDeltaNet (Q, K, V)
                conv = tuple((n, _span(sp)) for n, sp in zip(s.conv_names, s.conv, strict=True))
            for k, val in (("fa", _span(s.fa)), ("fa_v_offset", s.fa_v_offset), *conv, ("ssm", _span(s.ssm)),
                           ("local_part", f"{s.local_slot}/{s.local_parts}")):
                out[("reads", scope, k)] = val
    for t in p.transfers:
        est = estimate_request(t, v.calibration) if v.calibration else None
        vals: tuple[tuple[str, Value], ...] = (
            ("tokens_transferred", t.tokens_transferred), ("logical_blocks", t.logical_blocks), ("bytes", t.bytes),
            ("fa_bytes", t.fa_bytes), ("mamba_bytes", t.mamba_bytes), ("naive_bytes", t.naive_bytes),
            ("descriptors", t.descriptors), ("descriptors_min", t.descriptors_min),
            ("descriptors_per_rank", [r.descriptors for r in t.per_rank]),
            ("bytes_per_rank", [r.bytes for r in t.per_rank]), ("reads", t.reads),
            ("est_request_s", est.request_s if est else None))
        for k, val in vals:
            out[("transfer", t.isl, k)] = val
    for side in (p.prefill, p.decode):
        n = side.num_blocks
        out[("capacity", side.role, "blocks")] = n
        out[("capacity", side.role, "tokens")] = _tokens(side)
    return out


# ---------------------------------------------------------------------------------------------------------
# Pairing: the NIXL compatibility hash (compute_nixl_compatibility_hash in each release's nixl/metadata.py).


def hash_inputs(v: Variant, role: str) -> dict[str, Value]:
    """What one engine feeds NIXL's compatibility hash (``hybridpd.core.plan.compat_hash_inputs``, the one place)."""
    m = v.plan.model
    return compat_hash_inputs(getattr(v.plan, role), v.plan.target, m.source or m.model_id)


def _mixed(a: Variant, b: Variant, isls: tuple[int, ...]) -> tuple[MixedPair, ...]:
    """P of one variant with D of the other; skipped where that pair is A or B itself (one role unchanged)."""
    out = []
    for pv, dv, pn, dn in ((a, b, "A", "B"), (b, a, "B", "A")):
        if pv.plan.prefill.settings == dv.plan.prefill.settings or pv.plan.decode.settings == dv.plan.decode.settings:
            continue
        mix = build_plan(pv.plan.model, prefill=pv.plan.prefill.settings, decode=dv.plan.decode.settings,
                         vllm_version=pv.plan.target, platform=pv.plan.platform.name, isls=isls[:1] or None)
        out.append(MixedPair(prefill=pn, decode=dn, errors=errors(mix.findings)))
    return tuple(out)


def pairing(a: Variant, b: Variant) -> Pairing:
    # P and D of one plan feed the hash the same inputs (TP and block size are not hashed), so A's decode
    # against B's decode is also P(A) against D(B) and P(B) against D(A).
    fa, fb = hash_inputs(a, "decode"), hash_inputs(b, "decode")
    names = list(fa) + [n for n in fb if n not in fa]
    factors = tuple((n, fa.get(n, NOT_HASHED), fb.get(n, NOT_HASHED)) for n in names)
    valued = [f"{n} {x} vs {y}" for n, x, y in factors if x != y and NOT_HASHED not in (x, y)]
    only = [n for n, x, y in factors if x != y and NOT_HASHED in (x, y)]
    if valued or only:
        why = "; ".join(valued + ([f"hashed by one release only: {', '.join(only)}"] if only else []))
        advice = (f"P and D of A and B never pair: the NIXL compatibility hash differs ({why}), so the handshake "
                  f"raises and every request routed across fails. A rolling change must keep each P/D pair on one "
                  f"side: {LLMD_ADVICE}.")
        return Pairing(factors=factors, mixed=(), advice=advice)
    same_platform = a.plan.platform.name == b.plan.platform.name
    mixed = _mixed(a, b, tuple(t.isl for t in a.plan.transfers)) if same_platform else ()
    bad = [m for m in mixed if not m.ok]
    changed = [r for r in ROLES if getattr(a.plan, r).settings != getattr(b.plan, r).settings]
    if bad:
        what = "; ".join(f"P({m.prefill}) -> D({m.decode}): {', '.join(sorted({f.code for f in m.errors}))}"
                         for m in bad)
        advice = (f"the hash matches, so engines of A and B handshake, but mixed pairs fail: {what}. A rolling change "
                  f"must not mix them: move P and D together (a new pool or deployment per change).")
    elif mixed:
        advice = ("the hash matches and the mixed pairs P(A)->D(B) and P(B)->D(A) plan without errors: P and D "
                  "can be replaced one at a time.")
    elif changed:
        advice = (f"the hash matches; only {changed[0]} changes, so while its engines are replaced the pairs are B's "
                  f"own (see B's findings).")
    else:
        advice = "the hash matches and P and D settings are the same in A and B."
    return Pairing(factors=factors, mixed=mixed, advice=advice)


# ---------------------------------------------------------------------------------------------------------


def _finding_key(f: Finding, v: Variant) -> tuple[str, str, str]:
    """A finding's identity: its text with the variant's own release name neutral, so that a finding that only
    names its release ("vLLM 0.24 keeps it" / "vLLM 0.33 keeps it") is the same finding on both sides."""
    text = f.message
    for name in sorted({v.plan.target.text, v.plan.profile.name}, key=len, reverse=True):
        text = text.replace(f"vLLM {name}", "vLLM <release>")
    return (f.severity, f.code, text)


def diff_variants(a: Variant, b: Variant) -> PlanDiff:
    fa, fb = facts(a), facts(b)
    keys = list(fa) + [k for k in fb if k not in fa]
    changes = tuple(Change(section=k[0], scope=k[1], field=k[2], a=fa.get(k), b=fb.get(k))
                    for k in keys if fa.get(k) != fb.get(k))
    order = {s: i for i, s in enumerate(SECTIONS)}
    changes = tuple(sorted(changes, key=lambda c: order[c.section]))  # stable: keeps each section's own order
    ka = {_finding_key(f, a) for f in a.plan.findings}
    kb = {_finding_key(f, b) for f in b.plan.findings}
    return PlanDiff(a=a, b=b, changes=changes,
                    findings_added=tuple(f for f in b.plan.findings if _finding_key(f, b) not in ka),
                    findings_removed=tuple(f for f in a.plan.findings if _finding_key(f, a) not in kb),
                    pairing=pairing(a, b))


def _tokens(s: SideLayout) -> int | None:
    return s.num_blocks * s.block_size if s.num_blocks is not None and s.attention_groups else None


def _pct(a: int | None, b: int | None) -> float | None:
    return None if (a is None or b is None or a == 0) else round(100.0 * (b - a) / a, 4)


def capacity(d: PlanDiff) -> dict[str, Any]:
    """Blocks and tokens that fit per rank, per role, with the change in % (None where no memory is given)."""
    out: dict[str, Any] = {}
    for role in ROLES:
        sa = getattr(d.a.plan, role)
        sb = getattr(d.b.plan, role)
        na, nb = sa.num_blocks, sb.num_blocks
        ta, tb = _tokens(sa), _tokens(sb)
        out[role] = {"blocks_a": na, "blocks_b": nb, "blocks_change_pct": _pct(na, nb), "tokens_a": ta,
                     "tokens_b": tb, "tokens_change_pct": _pct(ta, tb)}
    return out


def diff_to_dict(d: PlanDiff) -> dict[str, Any]:
    """JSON form, stable keys: every key below is always present."""
    def variant(v: Variant) -> dict[str, Any]:
        p = v.plan
        return {"label": v.label, "vllm_version": v.vllm_version, "vllm_profile": p.profile.name,
                "nixl_connector_version": p.profile.nixl_connector_version, "platform": p.platform.name,
                "ptp": p.prefill.tp, "dtp": p.decode.tp, "ok": p.ok,
                "recommended_block_size": p.recommended_block_size,
                "error_codes": sorted({f.code for f in errors(p.findings)})}

    transfer: list[dict[str, Any]] = []
    isls = sorted({c.scope for c in d.section("transfer")})
    for isl in isls:
        rows = {c.field: c for c in d.section("transfer") if c.scope == isl}
        transfer.append({"isl": isl, "changes": {k: c.as_dict() for k, c in rows.items()}})
    pr = d.pairing
    return {
        "schema_version": SCHEMA_VERSION,
        "model": d.a.plan.model.model_id,
        "a": variant(d.a),
        "b": variant(d.b),
        "identical": d.identical,
        "b_introduces_error": d.b_introduces_error,
        "changes": [c.as_dict() for c in d.changes],
        "transfer": transfer,
        "capacity": capacity(d),
        "findings": {"added": [f.as_dict() for f in d.findings_added],
                     "removed": [f.as_dict() for f in d.findings_removed]},
        "pairing": {
            "hash_matches": pr.hash_matches,
            "differing": list(pr.differing),
            "factors": [{"name": n, "a": a, "b": b} for n, a, b in pr.factors],
            "mixed_pairs": [{"prefill": m.prefill, "decode": m.decode, "ok": m.ok,
                             "errors": [f.as_dict() for f in m.errors]} for m in pr.mixed],
            "advice": pr.advice,
        },
    }
