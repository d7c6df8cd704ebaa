"""llm-d objects for `serve --emit k8s --target llm-d|lws`: decode routing sidecar, InferencePool, EPP.

Facts, each from the file named (read, not copied):

- model-server pods, the ``routing-proxy`` native sidecar (``--port=8000 --kv-connector=nixlv2``,
  vLLM on 8200), ``VLLM_NIXL_SIDE_CHANNEL_HOST`` from ``status.podIP``, port ``nixl`` 5600,
  ``--no-disable-hybrid-kv-cache-manager``: llm-d/llm-d ``guides/pd-disaggregation/modelserver/gpu/
  vllm/base/{patch-decode,patch-prefill,disaggregatedset}.yaml`` and ``guides/recipes/modelserver/
  base/single-host/pd/vllm/patch-sidecar.yaml``;
- the sidecar's flags at the pinned release (``--vllm-port``, ``--secure-proxy``): llm-d/
  llm-d-inference-scheduler v0.8.0 ``pkg/sidecar/proxy/options.go`` (its default vLLM port is 8001,
  so 8200 is passed explicitly);
- the EPP Deployment/Service/RBAC and its P/D config: llm-d-inference-scheduler v0.8.0
  ``deploy/components/inference-gateway/*.yaml`` and ``deploy/config/pd-epp-config.yaml``. At v0.8.0
  the ``x-prefiller-host-port`` header is set by the ``disagg-headers-handler`` plugin and the
  profile handler disaggregates only when ``deciders.prefill`` names a decider (without it: decode
  only, silently); the config apiVersion is the Gateway API Inference Extension v1.5.0 one;
- InferencePool ``inference.networking.k8s.io/v1`` (selector, targetPorts, endpointPickerRef,
  ``failureMode: FailOpen`` as in llm-d's router base values);
- DisaggregatedSet ``disaggregatedset.x-k8s.io/v1``: kubernetes-sigs/lws CRD, roles prefill/decode;
- HTTPRoute from the Gateway to the pool: ``guides/pd-disaggregation/httproute.gke.yaml``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridpd.launch.k8s.base import Ctx

SIDECAR_IMAGE = "ghcr.io/llm-d/llm-d-routing-sidecar:v0.8.0"
EPP_IMAGE = "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0"
EPP_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"  # what the v0.8.0 EPP decodes
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_FILE = "epp-config.yaml"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def epp_config() -> dict[str, Any]:
    """The EndpointPickerConfig: always disaggregate, P and D picked by role label and queue depth."""
    return {
        "apiVersion": EPP_CONFIG_API,
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "disagg-headers-handler"},
            {"type": "always-disagg-pd-decider"},
            {"type": "disagg-profile-handler", "parameters": {"deciders": {"prefill": "always-disagg-pd-decider"}}},
            {"type": "prefill-filter"},
            {"type": "decode-filter"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "queue-scorer", "weight": 1},
                                            {"pluginRef": "max-score-picker"}]},
            {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}, {"pluginRef": "queue-scorer", "weight": 1},
                                           {"pluginRef": "max-score-picker"}]},
        ],
    }


def sidecar(image: str) -> dict[str, Any]:
    from hybridpd.launch.k8s.base import DECODE_PORT, SIDECAR_PORT

    return {
        "name": "routing-proxy", "image": image, "imagePullPolicy": "IfNotPresent",
        "args": [f"--port={SIDECAR_PORT}", f"--vllm-port={DECODE_PORT}", "--kv-connector=nixlv2",
                 "--secure-proxy=false", "--zap-log-level=1"],
        "ports": [{"name": "sidecar", "containerPort": SIDECAR_PORT, "protocol": "TCP"}],
        "resources": {},
        "restartPolicy": "Always",  # native sidecar: starts before vLLM, lives as long as the pod
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True},
    }


def pod_spec(ctx: Ctx, role: str) -> dict[str, Any]:
    from hybridpd.launch.k8s.base import DECODE_PORT, PREFILL_PORT, SHM_VOLUME, server_container

    p = ctx.lp.by_role(role)[0]
    port = DECODE_PORT if role == "decode" else PREFILL_PORT
    spec: dict[str, Any] = {}
    if role == "decode":
        spec["initContainers"] = [sidecar(ctx.opts.sidecar_image or SIDECAR_IMAGE)]
    spec["containers"] = [server_container(p, ctx.lp, image=ctx.image, model=ctx.model, port=port, keep_alive=True)]
    spec["terminationGracePeriodSeconds"] = 90
    spec["volumes"] = [SHM_VOLUME]
    return spec


def inference_pool(ctx: Ctx, name: str, key: str) -> dict[str, Any]:
    from hybridpd.launch.k8s.base import PREFILL_PORT

    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": ctx.meta(name),
            "spec": {"selector": {"matchLabels": ctx.pool_selector(key)},
                     "targetPorts": [{"number": PREFILL_PORT}],
                     "endpointPickerRef": {"name": f"{name}-epp", "kind": "Service",
                                           "port": {"number": EPP_GRPC_PORT}, "failureMode": "FailOpen"}}}


def epp_objects(ctx: Ctx, pool: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, ConfigMap, Deployment and Service of one pool's EPP."""
    from hybridpd.launch.k8s.base import to_yaml

    name = f"{pool}-epp"
    labels = {"app.kubernetes.io/name": name}
    rules = [
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
         "verbs": ["get", "watch", "list"]},
        {"apiGroups": ["inference.networking.x-k8s.io"],
         "resources": ["inferencepools", "inferenceobjectives", "inferencemodelrewrites"],
         "verbs": ["get", "watch", "list"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]},
    ]  # tokenreviews are cluster-scoped (a Role cannot grant them): metrics auth is off, as in the v0.8.0 dev deploy
    cfg_text = to_yaml([epp_config()]).removeprefix("---\n")
    container = {
        "name": "epp", "image": ctx.opts.epp_image or EPP_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--pool-name", pool, "--pool-namespace", "$(NAMESPACE)", "--config-file",
                 f"/etc/epp/{EPP_CONFIG_FILE}", "--grpc-port", str(EPP_GRPC_PORT), "--grpc-health-port",
                 str(EPP_HEALTH_PORT), "--metrics-port", str(EPP_METRICS_PORT), "--metrics-endpoint-auth=false",
                 "--v", "2"],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"}],
        "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": EXT_PROC_SERVICE},
                          "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": EXT_PROC_SERVICE},
                           "initialDelaySeconds": 5, "periodSeconds": 10},
        "volumeMounts": [{"name": "epp-config", "mountPath": "/etc/epp", "readOnly": True}],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ctx.meta(name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": ctx.meta(name), "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": ctx.meta(name),
         "subjects": [{"kind": "ServiceAccount", "name": name}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": ctx.meta(f"{name}-config"),
         "data": {EPP_CONFIG_FILE: cfg_text}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(name, labels),
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": {**ctx.common_labels(), **labels}},
                               "spec": {"serviceAccountName": name, "terminationGracePeriodSeconds": 130,
                                        "containers": [container],
                                        "volumes": [{"name": "epp-config",
                                                     "configMap": {"name": f"{name}-config"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name),
         "spec": {"selector": labels, "type": "ClusterIP",
                  "ports": [{"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": EPP_GRPC_PORT,
                             "protocol": "TCP", "appProtocol": "http2"},
                            {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": EPP_METRICS_PORT,
                             "protocol": "TCP"}]}},
    ]


def disaggregated_set(ctx: Ctx) -> dict[str, Any]:
    roles = []
    for role in ("prefill", "decode"):
        p = ctx.lp.by_role(role)[0]
        surge = {"maxSurge": 1, "maxUnavailable": 0} if role == "decode" else {"maxSurge": 0, "maxUnavailable": 1}
        roles.append({"name": role, "spec": {
            "replicas": len(ctx.lp.by_role(role)),
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": surge},
            "leaderWorkerTemplate": {"size": 1, "workerTemplate": {
                "metadata": {"labels": ctx.pod_labels(role), "annotations": ctx.pod_annotations(role, p)},
                "spec": pod_spec(ctx, role)}}}})
    return {"apiVersion": "disaggregatedset.x-k8s.io/v1", "kind": "DisaggregatedSet",
            "metadata": ctx.meta(ctx.base, {"llm-d.ai/inference-serving": "true"}),
            "spec": {"slices": 1, "roles": roles}}


def http_route(ctx: Ctx, pool: str) -> dict[str, Any]:
    """The route from the user's Gateway to the pool (guides/pd-disaggregation/httproute.*.yaml).

    Its name has no compatibility key: applying the output of an upgrade moves this route to the new
    pool, while the old pool and its pods keep serving until deleted.
    """
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": ctx.meta(ctx.opts.name),
            "spec": {"parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": ctx.opts.gateway}],
                     "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": pool, "weight": 1}]}]}}


def build(ctx: Ctx) -> list[dict[str, Any]]:
    from hybridpd.launch.k8s.base import deployment

    docs: list[dict[str, Any]] = []
    if ctx.opts.target == "lws":
        docs.append(disaggregated_set(ctx))
    else:
        for role in ("prefill", "decode"):
            procs = ctx.lp.by_role(role)
            docs.append(deployment(ctx, role, len(procs), pod_spec(ctx, role), procs[0]))
    for pool, key in ctx.pools():
        docs.append(inference_pool(ctx, pool, key))
        docs += epp_objects(ctx, pool)
    docs.append(http_route(ctx, ctx.pools()[0][0]))
    return docs
