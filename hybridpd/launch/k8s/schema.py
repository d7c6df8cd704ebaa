"""Validate emitted manifests before anyone applies them.

- core objects (apps/v1, v1, rbac/v1) against the Kubernetes OpenAPI schema of one Kubernetes version,
  strict (no unknown field), with the ``kubernetes-validate`` package;
- custom resources against the ``openAPIV3Schema`` of the CRD their project publishes, made strict
  the way ``kubeconform -strict`` does (an object with ``properties`` admits no other key unless the
  CRD says ``x-kubernetes-preserve-unknown-fields``);
- the EPP's EndpointPickerConfig (a file in a ConfigMap, not a resource) against a JSON schema;
- what the API server checks beyond OpenAPI (names, label syntax, port names) and what makes a P/D
  deployment work at all (selectors that select, the decode sidecar, EPP plugin references).

Needs ``jsonschema`` and ``kubernetes-validate`` (the ``test`` extra); imported lazily.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from typing import Any

DEFAULT_K8S_VERSION = "1.33"  # native sidecars (initContainers restartPolicy: Always) are GA from 1.33

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_IANA_SVC_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")


# ---------------------------------------------------------------------------------------- CRDs


def strict_crd_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """JSON Schema (2020-12) for one served version of a CRD, closed against unknown fields."""
    versions = [v for v in crd["spec"]["versions"] if v.get("served")]
    if version is not None:
        versions = [v for v in versions if v["name"] == version]
    if not versions:
        raise ValueError(f"CRD {crd['metadata']['name']} serves no version {version}")
    v = versions[0]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{group}/{v['name']}"}
    props["kind"] = {"const": kind}
    props["metadata"] = {"type": "object"}  # checked by object_meta_problems
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) for k, v in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
    for k in [k for k in node if k.startswith("x-kubernetes-")]:
        node.pop(k)
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False
    return node


def crd_key(crd: dict[str, Any]) -> list[tuple[str, str]]:
    """(apiVersion, kind) pairs a CRD serves."""
    g, k = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    return [(f"{g}/{v['name']}", k) for v in crd["spec"]["versions"] if v.get("served")]


# ---------------------------------------------------------------------------------- validation


def validate_docs(docs: Iterable[dict[str, Any]], crds: Iterable[dict[str, Any]], *,
                  k8s_version: str = DEFAULT_K8S_VERSION, epp_schema: dict[str, Any] | None = None) -> list[str]:
    """Every problem found, as 'Kind/name: path: message' lines; [] when all objects validate."""
    import jsonschema
    import kubernetes_validate

    docs = list(docs)
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for crd in crds:
        for api, kind in crd_key(crd):
            schemas[(api, kind)] = strict_crd_schema(crd, api.rsplit("/", 1)[1])
    problems: list[str] = []
    for d in docs:
        where = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        key = (d.get("apiVersion", ""), d.get("kind", ""))
        if key in schemas:
            validator = jsonschema.Draft202012Validator(schemas[key])
        else:
            try:
                validator = _core_validator(k8s_version, *key)
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{where}: no schema: {exc.message}")
                continue
        for err in sorted(validator.iter_errors(d), key=lambda e: list(e.absolute_path)):
            problems.append(f"{where}: {'/'.join(map(str, err.absolute_path)) or '.'}: {err.message}")
        problems += [f"{where}: {p}" for p in object_problems(d)]
        if epp_schema is not None and d.get("kind") == "ConfigMap":
            problems += [f"{where}: {p}" for p in epp_configmap_problems(d, epp_schema)]
    problems += deployment_problems(docs)
    return problems


@functools.lru_cache(maxsize=64)
def _core_validator(k8s_version: str, api_version: str, kind: str) -> Any:
    """kubernetes-validate's strict schema for one kind, loaded once (its validate() re-reads the files per call)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    version = [v for v in utils.all_versions() if utils.major_minor(v) <= utils.major_minor(k8s_version)][-1]
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    try:
        schema = utils.schema_contents(f"{folder}/{kind.lower()}-{api}.json", k8s_version)
    except FileNotFoundError:
        raise kubernetes_validate.SchemaNotFoundError(kind=kind, version=k8s_version, api_version=api_version) from None
    defs = utils.schema_contents(f"{folder}/_definitions.json", k8s_version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())  # type: ignore[operator]
    return jsonschema.Draft202012Validator(schema, registry=registry)


def object_problems(d: dict[str, Any]) -> list[str]:
    """What the API server validates beyond the OpenAPI schema, for the fields hybridpd emits."""
    out: list[str] = []
    meta = d.get("metadata", {})
    name = meta.get("name", "")
    rx = _DNS1035_LABEL if d.get("kind") == "Service" else _DNS1123_SUBDOMAIN
    limit = 63 if d.get("kind") == "Service" else 253
    if not rx.fullmatch(name) or len(name) > limit:
        out.append(f"metadata/name: {name!r} is not a valid {d.get('kind')} name")
    for path, labels in _label_maps(d):
        for k, v in labels.items():
            if not _label_key_ok(k):
                out.append(f"{path}: label key {k!r} is invalid")
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.fullmatch(v):
                out.append(f"{path}: label value {v!r} of {k} is invalid")
    for path, c in _containers(d):
        for p in c.get("ports", []):
            n = p.get("name")
            if n is not None and (len(n) > 15 or not _IANA_SVC_NAME.fullmatch(n) or not re.search("[a-z]", n)):
                out.append(f"{path}/ports: port name {n!r} is not an IANA service name (<= 15 chars)")
        image = c.get("image", "")
        if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            out.append(f"{path}: image {image!r} is not pinned to a release")
        mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
        for a in [*c.get("command", []), *c.get("args", [])]:
            for tok in re.findall(r"(?:^|[=\s])(/[^\s,;\"']+)", str(a)):
                if not any(tok.startswith(m) for m in mounts):
                    out.append(f"{path}: argument {a!r} names {tok}, a path outside the pod's volumes "
                               "(a path of the machine that ran serve?)")
    return out


def _label_key_ok(k: str) -> bool:
    prefix, _, name = k.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def _pod_templates(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if d.get("kind") == "Deployment":
        return [("spec/template", d["spec"]["template"])]
    if d.get("kind") == "DisaggregatedSet":
        return [(f"spec/roles/{r['name']}/workerTemplate", r["spec"]["leaderWorkerTemplate"]["workerTemplate"])
                for r in d["spec"]["roles"]]
    return []


def _label_maps(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("metadata/labels", d.get("metadata", {}).get("labels", {}))]
    out += [(f"{p}/metadata/labels", t.get("metadata", {}).get("labels", {})) for p, t in _pod_templates(d)]
    sel = d.get("spec", {}).get("selector")
    if isinstance(sel, dict):
        out.append(("spec/selector", sel.get("matchLabels", sel)))
    return out


def _containers(d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for p, t in _pod_templates(d):
        spec = t.get("spec", {})
        for kind in ("initContainers", "containers"):
            out += [(f"{p}/{kind}/{c.get('name')}", c) for c in spec.get(kind, [])]
    return out


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def deployment_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Cross-object checks: every selector selects, pools hold P and D, the decode pods route."""
    out: list[str] = []
    pods: list[tuple[str, dict[str, Any]]] = []  # (owner, pod template)
    for d in docs:
        for p, t in _pod_templates(d):
            pods.append((f"{d['kind']}/{d['metadata']['name']}:{p}", t))
        if d.get("kind") == "Deployment":
            sel = d["spec"]["selector"]["matchLabels"]
            if not _selects(sel, d["spec"]["template"]["metadata"]["labels"]):
                out.append(f"Deployment/{d['metadata']['name']}: selector does not match its pod template")
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d.get("kind") == "Service" and not any(_selects(d["spec"]["selector"], t["metadata"]["labels"])
                                                  for _, t in pods):
            out.append(f"{where}: selects no pod")
        if d.get("kind") == "InferencePool":
            if not isinstance(d.get("spec", {}).get("selector"), dict):
                continue  # the schema check reports it
            sel = d["spec"]["selector"].get("matchLabels", {})
            roles = {t["metadata"]["labels"].get("llm-d.ai/role") for _, t in pods
                     if _selects(sel, t["metadata"]["labels"])}
            if not roles:
                out.append(f"{where}: selects no pod")
            port = (d["spec"].get("targetPorts") or [{}])[0].get("number")
            for owner, t in pods:
                if not _selects(sel, t["metadata"]["labels"]):
                    continue
                spec = t["spec"]
                open_ports = {p["containerPort"] for c in [*spec.get("initContainers", []), *spec["containers"]]
                              for p in c.get("ports", [])}
                if port not in open_ports:
                    out.append(f"{where}: target port {port} is not open on {owner}")
                if t["metadata"]["labels"].get("llm-d.ai/role") == "decode" and not any(
                        c.get("name") == "routing-proxy" and c.get("restartPolicy") == "Always"
                        for c in spec.get("initContainers", [])):
                    out.append(f"{where}: decode pod {owner} has no routing-proxy native sidecar")
            ref = d["spec"].get("endpointPickerRef", {}).get("name")
            if not any(x.get("kind") == "Service" and x["metadata"]["name"] == ref for x in docs):
                out.append(f"{where}: endpointPickerRef names no Service {ref!r}")
    pools = [d["spec"]["selector"].get("matchLabels", {}) for d in docs
             if d.get("kind") == "InferencePool" and isinstance(d.get("spec", {}).get("selector"), dict)]
    for owner, t in pods:
        labels = t["metadata"]["labels"]
        if "llm-d.ai/role" in labels and not any(_selects(sel, labels) for sel in pools):
            out.append(f"{owner}: llm-d role {labels['llm-d.ai/role']!r} but no InferencePool selects the pod")
    if pools and not any(d.get("kind") == "ConfigMap" and "EndpointPickerConfig" in str(d.get("data"))
                         for d in docs):
        out.append("InferencePool without an EndpointPickerConfig for its EPP")
    return out


# ------------------------------------------------------------------------------------------ EPP


def epp_config_problems(cfg: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Schema of the EndpointPickerConfig, then what the EPP checks when it instantiates plugins."""
    import jsonschema

    out = [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message}"
           for e in jsonschema.Draft202012Validator(schema).iter_errors(cfg)]
    if out:
        return out
    names = {p.get("name") or p["type"]: p for p in cfg["plugins"]}
    for prof in cfg["schedulingProfiles"]:
        for ref in prof["plugins"]:
            if ref["pluginRef"] not in names:
                out.append(f"schedulingProfiles/{prof['name']}: pluginRef {ref['pluginRef']!r} names no plugin")
    for p in cfg["plugins"]:
        if p["type"] == "disagg-profile-handler":
            dec = (p.get("parameters") or {}).get("deciders", {}).get("prefill")
            if not dec:
                out.append("disagg-profile-handler has no deciders.prefill: the EPP would run decode only")
            elif dec not in names:
                out.append(f"disagg-profile-handler: deciders.prefill {dec!r} names no plugin")
            profiles = {s["name"] for s in cfg["schedulingProfiles"]}
            if not {"prefill", "decode"} <= profiles:
                out.append(f"disagg-profile-handler needs profiles prefill and decode, have {sorted(profiles)}")
    return out


def epp_configmap_problems(cm: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    import yaml

    out = []
    for fname, text in cm.get("data", {}).items():
        cfg = yaml.safe_load(text)
        if isinstance(cfg, dict) and cfg.get("kind") == "EndpointPickerConfig":
            out += [f"data/{fname}: {p}" for p in epp_config_problems(cfg, schema)]
    return out
