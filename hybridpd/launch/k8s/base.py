"""The pieces every Kubernetes target is built from: ports, labels, compatibility keys, the vLLM
container, Deployments, Services and YAML output. ``k8s`` (plain, lws) and ``k8s_llmd`` (llm-d) both build on it."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from hybridpd.core.findings import ERROR, Finding
from hybridpd.errors import HybridPDError, UsageError
from hybridpd.launch.commands import LaunchPlan, ProcessSpec

TARGETS = ("plain", "llm-d", "lws")
VLLM_IMAGE_REPO = "vllm/vllm-openai"
# The image the repository's Dockerfile builds (``docker build -t hybridpd:0.1.0 .``); push it to your
# registry and pass --proxy-image there.
PROXY_IMAGE = "hybridpd:0.1.0"
PREFILL_PORT = 8000  # vLLM on prefill pods (llm-d: the InferencePool target port)
DECODE_PORT = 8200  # vLLM on decode pods behind the routing sidecar (llm-d guide)
SIDECAR_PORT = 8000
PLAIN_PORT = 8000  # vLLM on every pod of the plain target
NIXL_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT (+ DP index), named `nixl` as in llm-d's guide
LABEL_PREFIX = "hybridpd.io"
# Environment that only makes sense on the machine that ran `serve`.
_HOST_ONLY_ENV = ("CUDA_VISIBLE_DEVICES", "UCX_NET_DEVICES", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_HOST_IP")


class ManifestRefused(HybridPDError):
    """The manifests would deploy P and D that cannot hand over KV (different compatibility keys)."""


@dataclass(frozen=True, kw_only=True)
class K8sOptions:
    target: str = "plain"
    name: str = "hybridpd"
    namespace: str | None = None
    image: str | None = None  # None: vllm/vllm-openai:v<release the plan targets>
    proxy_image: str = PROXY_IMAGE
    sidecar_image: str | None = None  # None: k8s_llmd.SIDECAR_IMAGE
    epp_image: str | None = None  # None: k8s_llmd.EPP_IMAGE
    model: str | None = None  # the model as pods see it; None: the plan's Hugging Face id
    gateway: str = "inference-gateway"  # the Gateway the llm-d/lws HTTPRoute attaches to
    vllm_version: str | None = None  # what the user asked for (X.Y or X.Y.Z)
    allow_errors: bool = False  # emit despite a compatibility-key mismatch

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise UsageError(f"unknown target {self.target!r}", field="--target", fix=f"use one of {', '.join(TARGETS)}")
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,28}[a-z0-9])?", self.name):
            raise UsageError(f"{self.name!r} is not a DNS label of at most 30 characters starting with a letter",
                             field="--k8s-name",
                             fix="use lower-case letters, digits and '-', e.g. nano-pd")
        if self.namespace is not None and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace):
            raise UsageError(f"{self.namespace!r} is not a valid namespace", field="--namespace")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", self.gateway):
            raise UsageError(f"{self.gateway!r} is not a valid Gateway name", field="--gateway")
        for fname, img in (("--image", self.image), ("--proxy-image", self.proxy_image),
                           ("--sidecar-image", self.sidecar_image), ("--epp-image", self.epp_image)):
            if img is not None:
                check_image(img, field=fname)


@dataclass(frozen=True)
class Manifests:
    docs: tuple[dict[str, Any], ...]
    target: str
    image: str
    compat_key: str
    factors: dict[str, Any] = field(compare=False)
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()

    def files(self) -> dict[str, str]:
        """Kustomize-style directory: one file per object plus kustomization.yaml (name -> text)."""
        out: dict[str, str] = {}
        for d in self.docs:
            fname = f"{d['kind'].lower()}-{d['metadata']['name']}.yaml"
            out[fname] = to_yaml([d])
        kust: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
        if self.docs and "namespace" in self.docs[0]["metadata"]:
            kust["namespace"] = self.docs[0]["metadata"]["namespace"]
        kust["resources"] = list(out)
        out["kustomization.yaml"] = to_yaml([kust])
        return out


# -------------------------------------------------------------------------------------- validation


def check_image(image: str, *, field: str) -> None:
    """An image reference pinned to a tag other than `latest`, or to a digest."""
    last = image.rsplit("/", 1)[-1]
    if "@sha256:" in image:
        return
    if ":" not in last:
        raise UsageError(f"{image!r} has no tag (Kubernetes pulls :latest)", field=field,
                         fix=f"pin a release, e.g. {image}:v0.32.0")
    if last.endswith(":latest"):
        raise UsageError(f"{image!r} is not pinned: P and D must run one exact release", field=field,
                         fix="use a release tag (vX.Y.Z) or a digest")


def image_release(image: str | None) -> str | None:
    """The vLLM release X.Y.Z an image tag names (vllm/vllm-openai:v0.24.0, registry/vllm:v0.32.0-cu13), else None
    (a digest, or a tag that is no release)."""
    if not image or "@" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    m = re.fullmatch(r"[^:]+:v?(\d+)\.(\d+)\.(\d+)(?:[-+._].*)?", last)
    return f"{m.group(1)}.{m.group(2)}.{m.group(3)}" if m else None


def release_for_image(image: str | None, vllm_version: str | None) -> str | None:
    """The release to plan for, given --image and --vllm-version: the image's release when its tag names one
    (refused when --vllm-version says another), else --vllm-version."""
    rel = image_release(image)
    if rel is None:
        return vllm_version
    if vllm_version:
        given = vllm_version.strip().removeprefix("v").split(".")
        if given != rel.split(".")[:len(given)]:
            raise UsageError(f"the image {image} is vLLM {rel}, but --vllm-version is {vllm_version}", field="--image",
                             fix=f"drop --vllm-version (the plan follows the image), or use an image of {vllm_version}")
    return rel


def resolve_release(version: str | None, entry_version: str | None, checked: tuple[int, int, int]) -> tuple[str, str | None]:
    """The exact vLLM release X.Y.Z the image is pinned to, and a note when hybridpd had to choose it.

    An explicit X.Y.Z (--vllm-version, else the vLLM the entry reports) is used as given; otherwise the
    release hybridpd checked the plan's profile against (``VllmProfile.checked``).
    """
    for text in (version, entry_version):
        if text:
            m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)", text.strip())
            if m:
                return f"{m.group(1)}.{m.group(2)}.{m.group(3)}", None
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:[.+\-~a-z].*)?", (version or "").strip())
    if m and (int(m.group(1)), int(m.group(2))) != checked[:2]:
        rel = f"{m.group(1)}.{m.group(2)}.0"  # a release newer than every profile: its own X.Y.0, not the profile's
        return rel, (f"image pinned to {VLLM_IMAGE_REPO}:v{rel}; pass --vllm-version X.Y.Z or --image if your "
                     "release differs")
    rel = ".".join(map(str, checked))
    return rel, (f"image pinned to {VLLM_IMAGE_REPO}:v{rel}, the release hybridpd checked this profile against; "
                 "pass --vllm-version X.Y.Z or --image for another")


def _vt(text: str) -> tuple[int, int, int]:
    a, b, c = (int(x) for x in text.split("."))
    return a, b, c


# ---------------------------------------------------------------------------------- compatibility


def compat_factors(lp: LaunchPlan, side: str, *, release: str, model: str) -> dict[str, Any]:
    """The NIXL compatibility-hash inputs of one side, as its pod will run it.

    ``plan.compat_hash_inputs`` (the one place that knows which factors each release hashes) for the
    pinned release and the model string the pods get. The plan's settings already hold what the pass-through
    arguments set (``commands.settings_with_args``); the one launch fact outside them is the connector a
    pass-through ``--kv-transfer-config`` names (the last one wins, as in vLLM's parser).
    """
    from dataclasses import replace

    from hybridpd.core.plan import compat_hash_inputs

    if lp.plan is None:
        raise UsageError("the launch plan has no layout plan", field="--emit")
    lay = lp.plan.prefill if side == "prefill" else lp.plan.decode
    f = compat_hash_inputs(lay, replace(lp.plan.target, version=_vt(release)), model)
    if isinstance(f.get("attn_backend_name"), str):
        f["attn_backend_name"] = f["attn_backend_name"].lower()
    if "transfer_mode" in f and (kvt := _argv_value(lp.by_role(side)[0].argv, "--kv-transfer-config")):
        f["transfer_mode"] = "push" if json.loads(kvt).get("kv_connector") == "NixlPushConnector" else "pull"
    return f


def pairing_factors(lp: LaunchPlan) -> dict[str, Any]:
    """What P and D of one deployment must agree on beyond NIXL's own hash, per side: TP, attention and
    kernel block, KV/conv/SSM dtypes, conv layout, prefix-caching mode, speculative tokens. Two plans that
    differ in any of these (granite-small TP 1/1 vs 2/2) must never share a pool: the EPP would pair old P
    with new D."""
    if lp.plan is None:
        raise UsageError("the launch plan has no layout plan", field="--emit")
    out: dict[str, Any] = {}
    for role, lay in (("prefill", lp.plan.prefill), ("decode", lp.plan.decode)):
        out[role] = {"tp": lay.tp, "block_size": lay.block_size, "kernel_block_size": lay.kernel_block_size,
                     "kv_dtype": lay.dtypes.kv, "conv_dtype": lay.dtypes.conv, "ssm_dtype": lay.dtypes.ssm,
                     "conv_layout": lay.conv_layout, "prefix_caching": lay.prefix_caching,
                     "mamba_cache_mode": lay.mamba_cache_mode,
                     "num_speculative_tokens": lay.settings.num_speculative_tokens}
    return out


def _argv_value(argv: tuple[str, ...] | list[str], flag: str) -> str | None:
    """The value of the last `--flag V` / `--flag=V` in argv, else None."""
    val = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def compat_key(factors: dict[str, Any], pairing: dict[str, Any] | None = None) -> str:
    """12 hex digits of sha256 over the canonical JSON of the NIXL factors (and the pair's pairing factors)."""
    doc: dict[str, Any] = factors if pairing is None else {"nixl": factors, "pair": pairing}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def compat_finding(p: dict[str, Any], d: dict[str, Any]) -> Finding | None:
    diff = sorted(k for k in set(p) | set(d) if p.get(k) != d.get(k))
    if not diff:
        return None
    text = ", ".join(f"{k} (P {p.get(k)!r}, D {d.get(k)!r})" for k in diff)
    return Finding(severity=ERROR, code="compat-hash-mismatch",
                   message=f"P and D would get different NIXL compatibility hashes: {text}; D rejects P's handshake",
                   fix="give both sides the same value for " + ", ".join(diff))


def label_value(text: str) -> str:
    """A Kubernetes label value (<= 63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    v = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].rstrip("-._")
    return v or "unknown"


# ------------------------------------------------------------------------------------ model server


def served_model(lp: LaunchPlan, override: str | None) -> str:
    if override:
        return override
    if lp.plan is not None and not os.path.isabs(lp.model) and not os.path.exists(lp.model):
        return lp.model
    mid = lp.plan.model.model_id if lp.plan is not None else lp.model
    if mid and not os.path.isabs(mid) and not os.path.exists(mid) and "/" in mid:
        return mid
    raise UsageError(f"the model is a local path ({lp.model}) that pods cannot see", field="--k8s-model",
                     fix="pass --k8s-model with a Hugging Face id or a path inside the image or a mounted volume")


def vllm_flags(p: ProcessSpec, lp: LaunchPlan, *, port: int) -> list[str]:
    """P/D's vLLM flags without the model, the host and the local port, then --port PORT."""
    rest = list(p.argv[len(lp.entry.prefix) + 2:])  # after "serve MODEL" (cli) / "--model MODEL" (api_server)
    out: list[str] = []
    i = 0
    while i < len(rest):
        if rest[i] in ("--host", "--port"):
            i += 2
            continue
        out.append(rest[i])
        i += 1
    lay = None if lp.plan is None else lp.plan.prefill if p.role == "prefill" else lp.plan.decode
    if lay is not None and lay.model.has_mamba and not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(out):
        # pin what the plan assumed, so an image with another default cannot change the layout
        out.append("--enable-prefix-caching" if lay.prefix_caching else "--no-enable-prefix-caching")
    return [*out, f"--port={port}"]


def server_env(p: ProcessSpec, *, keep_alive: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN", "optional": True}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_PORT)},
    ]
    for k, v in p.env:
        if k in _HOST_ONLY_ENV or k.startswith("VLLM_NIXL_SIDE_CHANNEL_"):
            continue
        env.append({"name": k, "value": v})
    if keep_alive:
        # llm-d's DisaggregatedSet: vLLM's 5 s keep-alive is shorter than the sidecar's 90 s idle timeout.
        env.append({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "120"})
    return env


def server_container(p: ProcessSpec, lp: LaunchPlan, *, image: str, model: str, port: int,
                     keep_alive: bool) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": "modelserver", "image": image, "command": ["vllm", "serve"],
        "args": [model, *vllm_flags(p, lp, port=port)],
        "env": server_env(p, keep_alive=keep_alive),
        "ports": [{"name": "modelserver", "containerPort": port, "protocol": "TCP"},
                  {"name": "nixl", "containerPort": NIXL_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": "/health", "port": "modelserver"}, "initialDelaySeconds": 15,
                         "periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "modelserver"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "modelserver"}, "periodSeconds": 5,
                           "timeoutSeconds": 2, "failureThreshold": 3},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    if lp.platform == "cuda":
        gpus = str(p.tp)
        c["resources"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    return c


SHM_VOLUME = {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "20Gi"}}


# ------------------------------------------------------------------------------------------ build


@dataclass(frozen=True)
class Ctx:
    """What every target's builder needs, derived once."""

    lp: LaunchPlan
    opts: K8sOptions
    image: str
    model: str
    keys: dict[str, str]  # role -> compatibility key (equal unless --force over a mismatch)
    factors: dict[str, dict[str, Any]]  # role -> compatibility factors
    pairing: dict[str, Any] = field(default_factory=dict)  # pairing_factors: role -> TP, blocks, dtypes, ...

    @property
    def key(self) -> str:
        return self.keys["prefill"]

    @property
    def base(self) -> str:
        """Name stem of every object of one compatibility key: a new key (upgrade) gets new objects."""
        return f"{self.opts.name}-{self.key[:8]}"

    def pools(self) -> list[tuple[str, str]]:
        """(pool name, key) per distinct compatibility key: llm-d's one InferencePool per upgrade."""
        out = [(self.base, self.key)]
        if self.keys["decode"] != self.key:
            out.append((f"{self.opts.name}-{self.keys['decode'][:8]}", self.keys["decode"]))
        return out

    def meta(self, name: str, labels: dict[str, str] | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name}
        if self.opts.namespace:
            m["namespace"] = self.opts.namespace
        m["labels"] = {**self.common_labels(), **(labels or {})}
        if annotations:
            m["annotations"] = annotations
        return m

    def common_labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/part-of": self.opts.name, "app.kubernetes.io/managed-by": "hybridpd"}

    def pod_labels(self, role: str) -> dict[str, str]:
        """Labels of P/D pods: llm-d's role and pool labels, and the compatibility factors."""
        f = self.factors[role]
        llmd = {} if self.opts.target == "plain" else {
            "llm-d.ai/inference-serving": "true",
            "llm-d.ai/role": role,
            "llm-d.ai/model": label_value(self.model.rsplit("/", 1)[-1]),
            "inference.networking.k8s.io/engine-type": "vllm",
        }
        return {
            **self.common_labels(),
            "app.kubernetes.io/name": f"{self.base}-{role}",
            **llmd,
            f"{LABEL_PREFIX}/role": role,
            f"{LABEL_PREFIX}/compat": self.keys[role],
            f"{LABEL_PREFIX}/vllm-version": label_value(f["vllm_version"]),
            f"{LABEL_PREFIX}/attention-backend": label_value(str(f.get("attn_backend_name"))),
            f"{LABEL_PREFIX}/cache-dtype": label_value(str(f.get("cache_dtype"))),
            f"{LABEL_PREFIX}/hma": "on" if f.get("is_hma_enabled") else "off",
        }

    def pod_annotations(self, role: str, p: ProcessSpec) -> dict[str, str]:
        return {f"{LABEL_PREFIX}/compat-factors": json.dumps(self.factors[role], sort_keys=True),
                f"{LABEL_PREFIX}/pairing-factors": json.dumps(self.pairing, sort_keys=True),
                f"{LABEL_PREFIX}/vllm-profile": self.lp.vllm_profile,
                f"{LABEL_PREFIX}/tp": str(p.tp)}

    def pool_selector(self, key: str) -> dict[str, str]:
        return {"app.kubernetes.io/part-of": self.opts.name, f"{LABEL_PREFIX}/compat": key}


def deployment(ctx: Ctx, role: str, replicas: int, pod_spec: dict[str, Any], p: ProcessSpec) -> dict[str, Any]:
    labels = ctx.pod_labels(role)
    sel = {"app.kubernetes.io/name": labels["app.kubernetes.io/name"], f"{LABEL_PREFIX}/compat": ctx.keys[role]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(f"{ctx.base}-{role}", labels),
            "spec": {"replicas": replicas, "selector": {"matchLabels": sel},
                     "template": {"metadata": {"labels": labels, "annotations": ctx.pod_annotations(role, p)},
                                  "spec": pod_spec}}}


def service(ctx: Ctx, name: str, selector: dict[str, str], ports: list[tuple[str, int]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name),
            "spec": {"selector": selector,
                     "ports": [{"name": n, "port": port, "targetPort": port, "protocol": "TCP"} for n, port in ports]}}


def to_yaml(docs: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> str:
    """Multi-document YAML (PyYAML, block style, keys in insertion order)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)

    _Dumper.add_representer(str, _str)
    return yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         explicit_start=True, width=120)
