"""`hybridpd serve --emit k8s`: Kubernetes manifests from the same LaunchPlan as a local launch.

Three targets (``K8sOptions.target``):

- ``plain``: a prefill and a decode Deployment + Service, and the hybridpd proxy (image built from the
  repository's ``Dockerfile``) as the entry Service.
- ``llm-d``: what llm-d's P/D guide deploys (``guides/pd-disaggregation/modelserver/gpu/vllm/base``):
  Deployments with ``llm-d.ai/role``, the decode pod's ``routing-proxy`` native sidecar, an
  InferencePool and the endpoint picker (EPP) with the P/D plugins (:mod:`hybridpd.launch.k8s.llmd`).
- ``lws``: the same routing, with the pods in one LWS ``DisaggregatedSet`` instead of Deployments.

What hybridpd adds to the guides: the hybrid settings the plan decided (DS conv layout, HMA kept on,
one ``--block-size``, dtype flags, prefix caching) on both sides, images pinned to the exact vLLM
release the plan targets, and the NIXL compatibility factors as pod labels, so that pods of different
releases or settings never share a pool (one InferencePool per compatibility key).

Pure except :func:`write_output`. YAML comes from PyYAML (imported lazily).
"""

from __future__ import annotations

import os
from typing import Any

from hybridpd.core.findings import Finding
from hybridpd.errors import UsageError
from hybridpd.launch.commands import LaunchPlan
from hybridpd.launch.k8s.base import (  # noqa: F401  (re-exported: hybridpd.launch.k8s.manifests is the public entry point)
    LABEL_PREFIX,
    PLAIN_PORT,
    SHM_VOLUME,
    VLLM_IMAGE_REPO,
    Ctx,
    K8sOptions,
    ManifestRefused,
    Manifests,
    check_image,
    compat_factors,
    compat_finding,
    compat_key,
    deployment,
    image_release,
    pairing_factors,
    resolve_release,
    served_model,
    server_container,
    service,
    to_yaml,
)


def build_manifests(lp: LaunchPlan, opts: K8sOptions) -> Manifests:
    """All objects of one target, from the launch plan. Raises ManifestRefused on a compat mismatch."""
    if lp.plan is None:
        raise UsageError("the launch plan carries no layout plan", field="--emit")
    if not lp.by_role("prefill") or not lp.by_role("decode"):
        raise UsageError("manifests need both sides", field="--role", fix="use --role all with --emit k8s")
    notes: list[str] = []
    if lp.platform != "cuda" and opts.image is None:
        raise UsageError(f"{VLLM_IMAGE_REPO} is a CUDA image; the plan is for {lp.platform}", field="--image",
                         fix="pass --image with a vLLM image for that platform")
    prof = lp.plan.profile
    release, note = resolve_release(opts.vllm_version, lp.entry.version, prof.checked)
    if (img := image_release(opts.image)) is not None and img != release:
        planned = f"{release} ({lp.plan.profile.name} profile)"
        raise UsageError(f"the image {opts.image} is vLLM {img}, but the plan is for vLLM {planned}", field="--image",
                         fix=f"plan for {img} (--vllm-version {img}, or drop it: serve follows --image's tag)")
    if note and opts.image is None:
        notes.append(note)
    image = opts.image or f"{VLLM_IMAGE_REPO}:v{release}"
    model = served_model(lp, opts.model)
    fp = compat_factors(lp, "prefill", release=release, model=model)
    fd = compat_factors(lp, "decode", release=release, model=model)
    findings: list[Finding] = []
    bad = compat_finding(fp, fd)
    if bad is not None:
        findings.append(bad)
        if not opts.allow_errors:
            raise ManifestRefused(f"[{bad.code}] {bad.message}", fix=bad.fix + ", or --force to emit anyway")
        notes.append("emitting despite a compatibility-key mismatch (--force): P and D land in separate pools")
    pair = pairing_factors(lp)
    ctx = Ctx(lp=lp, opts=opts, image=image, model=model,
              keys={"prefill": compat_key(fp, pair), "decode": compat_key(fd, pair)},
              factors={"prefill": fp, "decode": fd}, pairing=pair)
    if opts.target == "plain":
        docs = _plain(ctx)
    else:
        from hybridpd.launch.k8s import llmd as k8s_llmd  # llm-d builds on k8s_base only: no circle

        docs = k8s_llmd.build(ctx)
    return Manifests(docs=tuple(docs), target=opts.target, image=image, compat_key=ctx.key, factors=fp,
                     findings=tuple(findings), notes=tuple(notes))


def _plain(ctx: Ctx) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    urls: dict[str, str] = {}
    for role in ("prefill", "decode"):
        procs = ctx.lp.by_role(role)
        c = server_container(procs[0], ctx.lp, image=ctx.image, model=ctx.model, port=PLAIN_PORT, keep_alive=False)
        dep = deployment(ctx, role, len(procs), {"containers": [c], "volumes": [SHM_VOLUME]}, procs[0])
        docs.append(dep)
        svc = f"{ctx.base}-{role}"
        docs.append(service(ctx, svc, dep["spec"]["selector"]["matchLabels"], [("http", PLAIN_PORT)]))
        urls[role] = f"http://{svc}:{PLAIN_PORT}"
    px = ctx.lp.proxy
    policy = "round_robin"
    if px is not None and "--policy" in px.argv:
        policy = px.argv[px.argv.index("--policy") + 1]
    name = f"{ctx.opts.name}-proxy"
    labels = {"app.kubernetes.io/name": name}
    proxy = {
        "name": "proxy", "image": ctx.opts.proxy_image, "command": ["python", "-m", "hybridpd_cli", "proxy"],
        "args": ["--host", "0.0.0.0", "--port", str(PLAIN_PORT), "--policy", policy,
                 "--prefill", urls["prefill"], "--decode", urls["decode"]],
        "ports": [{"name": "http", "containerPort": PLAIN_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
    }
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(name, labels),
                 "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": {**ctx.common_labels(), **labels},
                                                    "annotations": {f"{LABEL_PREFIX}/compat": ctx.key}},
                                       "spec": {"containers": [proxy]}}}})
    docs.append(service(ctx, name, labels, [("http", PLAIN_PORT)]))
    return docs


# ------------------------------------------------------------------------------------------- YAML


def write_output(m: Manifests, path: str) -> list[str]:
    """Write one YAML file, or a kustomize-style directory when PATH ends with '/' or is a directory.

    The file goes through ``fsutil.write_atomic`` (a temporary file renamed over PATH; a symlink the user
    named is followed to its regular file, anything else refused). A directory must not exist yet, or
    be empty: it is filled in a temporary sibling and renamed into place, so a reader never sees half of
    it and no file the user did not name is overwritten.
    """
    import shutil
    import tempfile

    from hybridpd.fsutil import nothing_written, write_atomic

    fld = "-o/--output"
    if not (path.endswith(os.sep) or os.path.isdir(path)):
        write_atomic(path, to_yaml(m.docs), field=fld)
        return [path]
    target = path.rstrip(os.sep) or path
    if os.path.islink(target):
        raise UsageError(f"{target} is a symlink", field=fld, fix="name a real directory")
    if os.path.isdir(target) and os.listdir(target):
        raise UsageError(f"{target} is not empty", field=fld,
                         fix="name a new or empty directory (hybridpd never replaces files it was not given)")
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        raise UsageError(f"directory {parent} does not exist", field=fld, fix="create it first")
    files = m.files()
    try:
        tmp = tempfile.mkdtemp(prefix=".hybridpd-", dir=parent)
    except OSError as e:
        raise nothing_written(target, e, field=fld) from None
    try:
        for fname, text in files.items():
            write_atomic(os.path.join(tmp, fname), text, field=fld)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        os.replace(tmp, target)  # an empty directory is replaced atomically; a non-empty one is not
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise nothing_written(target, e, field=fld) from None
        raise
    return [os.path.join(target, f) for f in files]
