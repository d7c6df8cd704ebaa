"""Model listing data for `hybridpd models`: every bundled config, its layer mix and P/D support per profile.

Computed on each call (no disk cache); a full listing takes well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridpd.core.families import ModelSpec, model_spec
from hybridpd.core.findings import errors
from hybridpd.core.models import ALIASES, bundled_ids, load_bundled
from hybridpd.core.profiles import PROFILES, VllmProfile
from hybridpd.errors import HybridPDError


@dataclass(frozen=True, kw_only=True)
class Support:
    supported: bool
    reason: str | None  # first error finding's code when unsupported, else None

    def as_dict(self) -> dict[str, Any]:
        return {"supported": self.supported, "reason": self.reason}


@dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    id: str
    aliases: tuple[str, ...]
    family: str | None
    architecture: str | None
    mamba_layers: int
    attention_layers: int
    mamba_type: str | None
    n_groups: int | None
    layer_pattern: str
    pd_support: dict[str, Support] = field(default_factory=dict)
    hetero_tp: Support | None = None  # P TP 1 -> D TP 2 on the newest profile (HETERO_TP)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "aliases": list(self.aliases), "family": self.family,
                "architecture": self.architecture, "mamba_layers": self.mamba_layers,
                "attention_layers": self.attention_layers, "mamba_type": self.mamba_type,
                "n_groups": self.n_groups, "pd_support": {k: v.as_dict() for k, v in self.pd_support.items()},
                "hetero_tp": None if self.hetero_tp is None else {"prefill_tp": HETERO_TP[0],
                                                                  "decode_tp": HETERO_TP[1],
                                                                  "profile": PROFILES[-1].name,
                                                                  **self.hetero_tp.as_dict()}}


HETERO_TP = (1, 2)  # the heterogeneous pair `models` checks: TP 1/1 support can hide that 1 -> 2 corrupts state


def aliases_for(hf_id: str) -> tuple[str, ...]:
    return tuple(sorted(a for a, target in ALIASES.items() if target == hf_id))


def pd_support(spec: ModelSpec, profile: VllmProfile, tp: tuple[int, int] = (1, 1)) -> Support:
    """Decide P/D support with the plan engine at TP ``tp`` (1/1) and default settings for this profile."""
    if spec.has_mamba and not spec.attention_layers:
        return Support(supported=False, reason="attention-free")
    if spec.mamba_type and spec.mamba_type not in profile.pd_mamba_types:
        return Support(supported=False, reason="unsupported-mamba-type")
    from hybridpd.core.plan import build_plan
    from hybridpd.core.settings import EngineSettings

    try:
        plan = build_plan(spec, prefill=EngineSettings(tp=tp[0]), decode=EngineSettings(tp=tp[1]),
                          vllm_version=_version_in(profile),
                          isls=(min(1024, (spec.max_position_embeddings or 1025) - 1),))
    except HybridPDError as e:
        return Support(supported=False, reason=type(e).__name__)
    refused = errors(plan.findings)
    if refused:
        return Support(supported=False, reason=refused[0].code)
    return Support(supported=True, reason=None)


def _version_in(profile: VllmProfile) -> str:
    """A concrete version the profile covers (its last; its first may be special-cased, e.g. 0.22.0)."""
    return ".".join(map(str, profile.last))


def profile_names() -> list[str]:
    return [p.name for p in PROFILES]


def catalog_entry(hf_id: str, profiles: tuple[VllmProfile, ...] = PROFILES) -> CatalogEntry:
    aliases = aliases_for(hf_id)
    try:
        spec = model_spec(load_bundled(hf_id))
    except HybridPDError as e:
        reason = type(e).__name__
        return CatalogEntry(id=hf_id, aliases=aliases, family=None, architecture=None, mamba_layers=0,
                            attention_layers=0, mamba_type=None, n_groups=None, layer_pattern="",
                            pd_support={p.name: Support(supported=False, reason=reason) for p in profiles})
    return CatalogEntry(
        id=hf_id, aliases=aliases, family=spec.family, architecture=spec.architecture,
        mamba_layers=len(spec.mamba_layers), attention_layers=len(spec.attention_layers),
        mamba_type=spec.mamba_type, n_groups=spec.mamba.n_groups if spec.mamba else None,
        layer_pattern=spec.layer_pattern,
        pd_support={p.name: pd_support(spec, p) for p in profiles},
        hetero_tp=pd_support(spec, PROFILES[-1], HETERO_TP))


def catalog(profiles: tuple[VllmProfile, ...] = PROFILES) -> list[CatalogEntry]:
    """Every bundled model, sorted by id."""
    return [catalog_entry(i, profiles) for i in bundled_ids()]
