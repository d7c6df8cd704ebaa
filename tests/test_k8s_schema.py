"""Every emitted object validates strictly: core objects against the Kubernetes 1.33 OpenAPI schema
(kubernetes-validate), custom resources against their projects' CRDs (tests/data/k8s, sources in
SOURCES.md), the EPP config against its Go types; and the validator rejects what it must (the pre-#14
output, unknown fields, a P/D config that would run decode only)."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridpd.core.settings import EngineSettings
from hybridpd.launch.commands import LaunchOptions, build_launch_plan
from hybridpd.launch.entry import entry_for
from hybridpd.launch.k8s.llmd import epp_config
from hybridpd.launch.k8s.manifests import K8sOptions, build_manifests, to_yaml
from hybridpd.launch.k8s.schema import epp_config_problems, strict_crd_schema, validate_docs

DATA = Path(__file__).resolve().parent / "data" / "k8s"
GOLDEN = Path(__file__).resolve().parent / "golden" / "k8s"
K8S_VERSION = "1.33"


def _read(name: str) -> bytes:
    raw = (DATA / name).read_bytes()
    return gzip.decompress(raw) if name.endswith(".gz") else raw


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the LWS CRD is 1.5 MB
    return [yaml.load(_read(n), Loader=loader) for n in ("inference.networking.k8s.io_inferencepools.yaml",
                                                         "disaggregatedset.x-k8s.io_disaggregatedsets.yaml.gz",
                                                         "gateway.networking.k8s.io_httproutes.yaml.gz")]


@pytest.fixture(scope="module")
def epp_schema() -> dict[str, Any]:
    return json.loads((DATA / "endpointpickerconfig.v1alpha1.schema.json").read_text())


def emitted(target: str, model: str = "nano", ptp: int = 2, dtp: int = 2, **kw: Any) -> list[dict[str, Any]]:
    lp = build_launch_plan(model, prefill=EngineSettings(tp=ptp), decode=EngineSettings(tp=dtp),
                           options=LaunchOptions(auto_block_size=True, num_decode=2),
                           entry=entry_for("/opt/venv/bin/python", "vllm", "0.32.0"), vllm_version="0.32.0")
    m = build_manifests(lp, K8sOptions(target=target, vllm_version="0.32.0", **kw))
    return list(yaml.safe_load_all(to_yaml(m.docs)))


def test_vendored_schemas_match_their_sources() -> None:
    """Each vendored CRD is byte-identical to the git blob named in SOURCES.md."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{40}) \|$", (DATA / "SOURCES.md").read_text(), re.M)
    assert len(rows) == 3
    for name, blob in rows:
        raw = _read(name)
        assert hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest() == blob, name


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
@pytest.mark.parametrize("case", [("nano", 2, 2, {}), ("nano", 1, 4, {"namespace": "llm"}),
                                  ("super-fp8", 4, 4, {"name": "super"})])
def test_every_object_validates_strictly(target: str, case: tuple[Any, ...], crds: list[dict[str, Any]],
                                         epp_schema: dict[str, Any]) -> None:
    model, ptp, dtp, kw = case
    docs = emitted(target, model, ptp, dtp, **kw)
    assert validate_docs(docs, crds, k8s_version=K8S_VERSION, epp_schema=epp_schema) == []
    kinds = {d["kind"] for d in docs}
    want = {"plain": {"Deployment", "Service"},
            "llm-d": {"Deployment", "Service", "InferencePool", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
                      "HTTPRoute"},
            "lws": {"DisaggregatedSet", "Deployment", "Service", "InferencePool", "ConfigMap", "ServiceAccount",
                    "Role", "RoleBinding", "HTTPRoute"}}[target]
    assert kinds == want


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_goldens_validate(target: str, crds: list[dict[str, Any]], epp_schema: dict[str, Any]) -> None:
    docs = list(yaml.safe_load_all((GOLDEN / f"{target}.yaml").read_text()))
    assert validate_docs(docs, crds, k8s_version=K8S_VERSION, epp_schema=epp_schema) == []


def test_old_output_fails(crds: list[dict[str, Any]]) -> None:
    """The pre-#14 `--emit k8s --llm-d` output (JSON documents, :latest, host venv paths, no pool)."""
    docs = [d for d in yaml.safe_load_all((DATA / "old-output-llm-d.yaml").read_text()) if d]
    problems = validate_docs(docs, crds, k8s_version=K8S_VERSION)
    text = "\n".join(problems)
    assert "vllm/vllm-openai:latest' is not pinned" in text
    assert "/work/main/.venv/bin/python, a path outside the pod's volumes" in text
    assert "no InferencePool selects the pod" in text


def _problems_after(mutate: Any, target: str, crds: list[dict[str, Any]], epp_schema: dict[str, Any]) -> list[str]:
    docs = copy.deepcopy(emitted(target))
    mutate(docs)
    return validate_docs(docs, crds, k8s_version=K8S_VERSION, epp_schema=epp_schema)


def _find(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))


MUTATIONS = {
    # kubernetes-validate strict: unknown field / wrong type in a core object
    "unknown container field": ("llm-d", lambda ds: _find(ds, "Deployment", "-prefill")["spec"]["template"]["spec"]
                                ["containers"][0].update(gpus=2), "Additional properties"),
    "replicas as string": ("plain", lambda ds: _find(ds, "Deployment", "-decode")["spec"].update(replicas="2"),
                           "is not of type"),
    # CRD made strict: unknown field in the InferencePool, in the DisaggregatedSet's embedded pod
    "unknown pool field": ("llm-d", lambda ds: _find(ds, "InferencePool")["spec"].update(extensionRef={}),
                           "Additional properties"),
    "pool without selector": ("llm-d", lambda ds: _find(ds, "InferencePool")["spec"].pop("selector"),
                              "'selector' is a required property"),
    "bad failureMode": ("llm-d", lambda ds: _find(ds, "InferencePool")["spec"]["endpointPickerRef"]
                        .update(failureMode="Open"), "is not one of"),
    "guide's groupIdentity": ("lws", lambda ds: _find(ds, "DisaggregatedSet")["spec"]["roles"][0]["spec"]
                              .update(groupIdentity="Hash"), "'groupIdentity' was unexpected"),
    "unknown field in LWS pod": ("lws", lambda ds: _find(ds, "DisaggregatedSet")["spec"]["roles"][1]["spec"]
                                 ["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(gpu=1),
                                 "'gpu' was unexpected"),
    # API-server rules beyond OpenAPI, and P/D wiring
    "port name too long": ("llm-d", lambda ds: _find(ds, "Deployment", "-decode")["spec"]["template"]["spec"]
                           ["containers"][0]["ports"][1].update(name="nixl-side-channel"), "IANA service name"),
    "label value with slash": ("llm-d", lambda ds: _find(ds, "Deployment", "-prefill")["metadata"]["labels"]
                               .update({"llm-d.ai/model": "nvidia/x"}), "label value"),
    "decode without sidecar": ("llm-d", lambda ds: _find(ds, "Deployment", "-decode")["spec"]["template"]["spec"]
                               .pop("initContainers"), "no routing-proxy native sidecar"),
    "latest image": ("llm-d", lambda ds: _find(ds, "Deployment", "-decode")["spec"]["template"]["spec"]
                     ["initContainers"][0].update(image="ghcr.io/llm-d/llm-d-routing-sidecar:latest"), "not pinned"),
    "route to a Service kind typo": ("llm-d", lambda ds: _find(ds, "HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]
                                     .update(namespace="Bad_NS"), "does not match"),
    "service selects nothing": ("plain", lambda ds: _find(ds, "Service", "-prefill")["spec"]["selector"]
                                .update({"hybridpd.io/compat": "000000000000"}), "selects no pod"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_validator_rejects(case: str, crds: list[dict[str, Any]], epp_schema: dict[str, Any]) -> None:
    target, mutate, expect = MUTATIONS[case]
    problems = _problems_after(mutate, target, crds, epp_schema)
    assert any(expect in p for p in problems), problems


def test_crd_strictness_keeps_preserve_unknown_fields(crds: list[dict[str, Any]]) -> None:
    s = strict_crd_schema(crds[0])
    assert s["properties"]["spec"]["additionalProperties"] is False
    assert s["properties"]["apiVersion"] == {"const": "inference.networking.k8s.io/v1"}
    node = {"type": "object", "properties": {"a": {"type": "string"}}, "x-kubernetes-preserve-unknown-fields": True}
    crd = {"metadata": {"name": "x"}, "spec": {"group": "g", "names": {"kind": "K"},
                                               "versions": [{"name": "v1", "served": True,
                                                             "schema": {"openAPIV3Schema": node}}]}}
    assert "additionalProperties" not in strict_crd_schema(crd)


def test_epp_config_checks(epp_schema: dict[str, Any]) -> None:
    assert epp_config_problems(epp_config(), epp_schema) == []
    cfg = epp_config()
    next(p for p in cfg["plugins"] if p["type"] == "disagg-profile-handler").pop("parameters")
    assert any("decode only" in p for p in epp_config_problems(cfg, epp_schema))
    cfg = epp_config()
    cfg["schedulingProfiles"][0]["plugins"].append({"pluginRef": "kv-cache-utilization-scorer"})
    assert any("names no plugin" in p for p in epp_config_problems(cfg, epp_schema))
    cfg = epp_config()
    cfg["apiVersion"] = "llm-d.ai/v1"  # the newest guide's; the pinned v0.8.0 EPP decodes only the GAIE one
    assert epp_config_problems(cfg, epp_schema)
    cfg = epp_config()
    cfg["plugin"] = cfg.pop("plugins")
    assert epp_config_problems(cfg, epp_schema)


def test_kubernetes_version_matters() -> None:
    """The decode pod's native sidecar (initContainers[].restartPolicy) is unknown to the 1.27 schema."""
    docs = [d for d in emitted("llm-d") if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode")]
    old = [p for p in validate_docs(docs, [], k8s_version="1.27") if "restartPolicy" in p]
    assert old and "'restartPolicy' was unexpected" in old[0]
    assert not [p for p in validate_docs(docs, [], k8s_version=K8S_VERSION) if "restartPolicy" in p]
