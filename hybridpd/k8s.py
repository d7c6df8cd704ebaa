"""`hybridpd serve --emit k8s`: plain Deployments + Services from a LaunchPlan (no yaml dependency).

Each document is JSON, which is valid YAML; documents are separated by `---`. Written atomically.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .launch import LaunchPlan, ProcessSpec

DEFAULT_IMAGE = "vllm/vllm-openai:latest"
POD_IP_ENV = "POD_IP"


def _name(prefix: str, proc: ProcessSpec) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"{prefix}-{proc.name}".lower()).strip("-")[:63]


def _container_args(proc: ProcessSpec) -> list[str]:
    """The process argv with --host bound to all interfaces (pods are reached through Services)."""
    args = list(proc.argv)
    for i, a in enumerate(args[:-1]):
        if a == "--host":
            args[i + 1] = "0.0.0.0"
    return args


def manifests(lp: LaunchPlan, *, name: str = "hybridpd", image: str = DEFAULT_IMAGE,
              namespace: str | None = None, llm_d: bool = False) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    svc_url = {p.name: f"http://{_name(name, p)}:{p.port}" for p in lp.processes}
    for p in lp.processes:
        n = _name(name, p)
        labels = {"app.kubernetes.io/name": n, "app.kubernetes.io/part-of": name, "hybridpd/role": p.role}
        annotations: dict[str, str] = {}
        if llm_d and p.role in ("prefill", "decode"):
            labels["llm-d.ai/inferenceServing"] = "true"
            labels["llm-d.ai/role"] = p.role
            annotations["llm-d.ai/tp"] = str(p.tp)
        env: list[dict[str, Any]] = []
        if p.role in ("prefill", "decode"):
            env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        for k, v in p.env:
            if k == "CUDA_VISIBLE_DEVICES":
                continue  # the device plugin assigns GPUs
            if k == "VLLM_NIXL_SIDE_CHANNEL_HOST":
                v = f"$({POD_IP_ENV})"
            if k == "UCX_NET_DEVICES" and v == "lo":
                continue  # pods talk over the pod network
            env.append({"name": k, "value": v})
        args = _container_args(p)
        if p.role == "proxy":
            for i, a in enumerate(args):
                for proc in lp.servers:
                    if a == proc.url:
                        args[i] = svc_url[proc.name]
        ports = [{"name": "http", "containerPort": p.port}]
        if p.side_channel_port is not None:
            ports.append({"name": "nixl-side", "containerPort": p.side_channel_port})
        container: dict[str, Any] = {
            "name": p.role, "image": image, "command": args[:1], "args": args[1:], "env": env, "ports": ports,
            "readinessProbe": {"httpGet": {"path": "/health", "port": p.port}, "periodSeconds": 5,
                               "failureThreshold": 360},
        }
        if p.role in ("prefill", "decode") and lp.platform == "cuda":
            container["resources"] = {"limits": {"nvidia.com/gpu": p.tp}}
            container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        meta: dict[str, Any] = {"name": n, "labels": labels}
        if namespace:
            meta["namespace"] = namespace
        if annotations:
            meta["annotations"] = annotations
        pod_spec: dict[str, Any] = {"containers": [container]}
        if "volumeMounts" in container:
            pod_spec["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
        docs.append({
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": n}},
                     "template": {"metadata": {"labels": labels, **({"annotations": annotations}
                                                                    if annotations else {})},
                                  "spec": pod_spec}}})
        docs.append({
            "apiVersion": "v1", "kind": "Service", "metadata": {k: v for k, v in meta.items() if k != "annotations"},
            "spec": {"selector": {"app.kubernetes.io/name": n},
                     "ports": [{"name": pt["name"], "port": pt["containerPort"], "targetPort": pt["containerPort"]}
                               for pt in ports]}})
    return docs


def to_yaml(docs: list[dict[str, Any]]) -> str:
    return "".join(f"---\n{json.dumps(d, indent=2)}\n" for d in docs)
