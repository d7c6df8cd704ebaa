"""Issue #28's defects, each reproduced as an operator would hit it (`serve --emit k8s` through the CLI) and
refused or fixed: per-side arguments that bypass the plan, GPU requests that ignore the TP passed, a compat key
that ignores TP, an image tag of another release. Each of these tests fails on the code before issue #28
(checked against main at df94344: the block-size pair was emitted with exit 0, the decode pod asked for 2 GPUs,
granite-small TP 1/1 and 2/2 got identical object names, the 0.24 image kept the 0.32 plan's key).

Expected values come from `hybridpd plan` on the same pair (its refusal) and from the arguments themselves
(the TP passed is the GPU count a pod needs), never from the code under test."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.test_k8s import ACCEPTANCE, pod_templates, run_main


def _emit(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict[str, Any]], str]:
    code, out, err = run_main(args, capsys)
    return code, (list(yaml.safe_load_all(out)) if code == 0 else []), err


def test_per_side_block_size_is_planned_and_refused_like_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["plan", "nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32.0",
                               "--d-block-size", "8352"], capsys)
    assert "block-not-divisible" in out + err  # what plan says of this pair
    for arg in ("--decode-arg=--block-size=8352", "--decode-arg=--block-size"):
        extra = [arg] if "=" in arg[13:] else [arg, "--decode-arg=8352"]
        code, docs, err = _emit([*ACCEPTANCE, "--target", "llm-d", *extra], capsys)
        assert code == 1 and not docs, err
        assert "launch refused" in err and "block-not-divisible" in err


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_gpu_requests_follow_the_tp_passed(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, docs, err = _emit([*ACCEPTANCE, "--target", target, "--decode-arg=--tensor-parallel-size=4",
                             "--auto-block-size"], capsys)
    assert code == 0, err
    pods = pod_templates(docs)
    gpus = {r: t["spec"]["containers"][-1]["resources"]["requests"]["nvidia.com/gpu"] for r, t in pods.items()}
    assert gpus == {"prefill": "2", "decode": "4"}
    args = pods["decode"]["spec"]["containers"][-1]["args"]
    assert args.count("--tensor-parallel-size") == 1 and args[args.index("--tensor-parallel-size") + 1] == "4"
    assert "sets TP to 4" in err  # the note says which argument changed the plan


def test_vllm_short_tp_flag_and_env_layout_are_planned(capsys: pytest.CaptureFixture[str]) -> None:
    code, docs, err = _emit([*ACCEPTANCE, "--target", "plain", "--auto-block-size", "--", "-tp", "1"], capsys)
    assert code == 0, err
    gpus = {t["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] for t in pod_templates(docs).values()}
    assert gpus == {"1"}
    code, docs, err = _emit([*ACCEPTANCE, "--target", "plain", "--env", "VLLM_SSM_CONV_STATE_LAYOUT=XY"], capsys)
    assert code == 2 and "VLLM_SSM_CONV_STATE_LAYOUT" in err


def _names_selectors_pools(docs: list[dict[str, Any]]) -> tuple[set[tuple[str, str]], list[dict[str, str]], set[str]]:
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    sels = [d["spec"]["selector"].get("matchLabels", d["spec"]["selector"]) for d in docs
            if d["kind"] in ("Deployment", "Service", "InferencePool")]
    pools = {d["metadata"]["name"] for d in docs if d["kind"] == "InferencePool"}
    return names, sels, pools


@pytest.mark.parametrize("target", ["plain", "llm-d", "lws"])
def test_plans_that_cannot_pair_never_share_names_selectors_or_pools(target: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # granite-small P TP1 with D TP2 is the conv-state-corruption pair plan refuses: the two deployments must not mix
    code, out, err = run_main(["plan", "granite-small", "--ptp", "1", "--dtp", "2", "--vllm-version", "0.32.0"], capsys)
    assert "conv-state-corruption" in out + err
    base = ["serve", "granite-small", "--vllm-version", "0.32.0", "--emit", "k8s", "--target", target,
            "--auto-block-size"]
    c1, a, e1 = _emit([*base, "--ptp", "1", "--dtp", "1"], capsys)
    c2, b, e2 = _emit([*base, "--ptp", "2", "--dtp", "2"], capsys)
    assert c1 == c2 == 0, e1 + e2
    na, sa, pa = _names_selectors_pools(a)
    nb, sb, pb = _names_selectors_pools(b)
    shared = na & nb
    assert shared <= {("HTTPRoute", "hybridpd"), ("Deployment", "hybridpd-proxy"), ("Service", "hybridpd-proxy")}
    assert not pa & pb
    pods_b = pod_templates(b)
    for sel in sa:  # no selector of the TP 1/1 output selects a P or D pod of the TP 2/2 one
        assert not any(all(t["metadata"]["labels"].get(k) == v for k, v in sel.items()) for t in pods_b.values())


def test_image_tag_of_another_release_is_planned_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["serve", "nano", "--ptp", "2", "--dtp", "2", "--emit", "k8s", "--target", "llm-d", "--auto-block-size"]
    code, docs, err = _emit([*base, "--image", "vllm/vllm-openai:v0.24.0"], capsys)
    assert code == 0, err
    for t in pod_templates(docs).values():
        assert t["metadata"]["labels"]["hybridpd.io/vllm-version"] == "0.24.0"
        assert t["metadata"]["annotations"]["hybridpd.io/vllm-profile"] == "0.24"
        assert t["spec"]["containers"][-1]["image"] == "vllm/vllm-openai:v0.24.0"
    code, docs, err = _emit([*base, "--image", "vllm/vllm-openai:v0.24.0", "--vllm-version", "0.33"], capsys)
    assert code == 2 and not docs and "--image" in err and "0.24.0" in err and "0.33" in err
    code, docs, err = _emit([*base, "--image", "vllm/vllm-openai:v0.24.0", "--vllm-version", "0.24"], capsys)
    assert code == 0, err


def test_owned_flags_are_refused_in_pass_through_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main([*ACCEPTANCE, "--decode-arg=--port=9000"], capsys)
    assert code == 2 and "--decode-arg" in err and "--port" in err
