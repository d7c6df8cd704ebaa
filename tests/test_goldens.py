"""Golden outputs of `serve --dry-run` (human at 80 and 200 columns, and JSON), `verify --rehearse --json` and
`convert --json`, through the real entry point.  Volatile values (tmp paths, the Python path, seconds, UCX's
host-dependent transport names) are masked before comparing.  Regenerate with HYBRIDPD_REGEN_GOLDEN=1 after an
intended change and read the diff; `plan` goldens live in test_plan_cli.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from golden_files import check_golden, json_text, mask_json, mask_text, text_lines

REPO = Path(__file__).resolve().parents[1]
SERVE = ["serve", "nano", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.32", "--platform", "cuda",
         "--vllm-command", "vllm", "--dry-run"]


def run(args: list[str], width: int = 200, **env: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a clean environment: nothing from the caller's UCX_/VLLM_/HYBRIDPD_/CUDA settings leaks in."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("UCX_", "VLLM_", "HYBRIDPD_", "CUDA_", "XDG_STATE"))}
    e.update({"COLUMNS": str(width), "TERM": "dumb", **env})
    return subprocess.run([sys.executable, "-m", "hybridpd_cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, env=e, timeout=120)


# --------------------------------------------------------------------------------------------- serve --dry-run


@pytest.mark.parametrize("width", [80, 200])
def test_serve_dry_run_human(width: int) -> None:
    r = run(SERVE, width)
    assert r.returncode == 0, r.stderr
    got = f"$ hybridpd {' '.join(SERVE)}\n{text_lines(mask_text(r.stdout, {}))}[stderr]\n{text_lines(r.stderr)}"
    check_golden("serve", f"nano-2-2-dry-run-{width}.txt", got)
    assert "<python> -m hybridpd_cli proxy" in got  # the mask hit the proxy's interpreter, nothing else varies


def test_serve_dry_run_json() -> None:
    r = run([*SERVE, "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    check_golden("serve", "nano-2-2-dry-run.json", json_text(mask_json(d, {})))
    # by hand: BF16 Nano at TP2, no --block-size -> block 2096 (shared/reference/vllm-hybrid-pd.md §2.5 table,
    # "Nano bf16, none"); two GPUs per side in order, P on 0,1 and D on 2,3; the proxy gets none
    assert "P 2096, D 2096" in json.dumps(d["findings"])
    assert [p["env"].get("CUDA_VISIBLE_DEVICES") for p in d["processes"]] == ["0,1", "2,3", None]


# ---------------------------------------------------------------------------------------- verify --rehearse


@pytest.mark.integration
def test_verify_rehearse_json() -> None:
    """Starts NIXL agent processes (one per rank) over loopback UCX."""
    from hybridpd.verify.nixl_agent import nixl_available

    if not nixl_available():
        pytest.skip("nixl not installed")
    args = ["verify", "nano", "--ptp", "1", "--dtp", "2", "--vllm-version", "0.32", "--rehearse", "--json"]
    r = run(args, UCX_NET_DEVICES="lo")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    volatile = {"elapsed_s": "<s>", "first_elapsed_s": "<s>", "read_times_s": "<s>", "xfer_us": "<us>",
                "ucx": "<ucx>", "ucx_read_transports": "<ucx>", "ucx_read_operations": "<ucx>",
                "ucx_warnings": "<ucx>"}
    check_golden("verify", "nano-1-2-rehearse.json", json_text(mask_json(d, volatile)))
    # by hand (shared/reference/vllm-hybrid-pd.md §1, §2.5, §9.2): BF16 Nano, block 2096 at TP1 and TP2; 3143
    # tokens -> L = 2 blocks; per D rank FA 6 x 2 x 2096 x 512 B, and over 24 Mamba slots x = 2048 ch x 6 B,
    # B = C = 512 ch x 6 B, SSM = 32 x 64 x 128 x 4 B; descriptors 6 x 2 + 4 x 6 x 4 = 108
    want = {"FA": 6 * 2 * 2096 * 512, "x": 24 * 2048 * 6, "B": 24 * 512 * 6, "C": 24 * 512 * 6,
            "SSM": 24 * 32 * 64 * 128 * 4}
    for rank in d["per_rank"]:
        assert rank["moved_components"] == want and rank["moved_bytes"] == sum(want.values()) == 38_486_016
        assert rank["moved_descriptors"] == 108 and rank["ok"] is True


# ----------------------------------------------------------------------------------------------- convert --json


def test_convert_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    import torch
    from hybridpd_cli.main import main
    from test_convert_support import rand, save

    def convert(*args: str) -> dict[str, Any]:
        code = 0
        try:
            main(["convert", *args, "--device", "cpu", "--json"])
        except SystemExit as e:
            code = int(e.code or 0)
        out = capsys.readouterr()
        assert code == 0, out.err
        return cast(dict[str, Any], json.loads(out.out))

    state = save(tmp_path / "state.safetensors", {"model.layers.0.mixer.conv_state": rand((4, 3, 320), torch.bfloat16),
                                                "model.layers.0.mixer.ssm_state": rand((4, 8, 32, 16), torch.float32),
                                                "seq_lens": torch.arange(4)})
    volatile = {"seconds": "<s>", "bytes_per_second": "<B/s>"}
    reps = {str(tmp_path): "<tmp>"}
    d = convert(str(state), str(tmp_path / "ds.safetensors"), "--to", "DS", "--model", str(tiny_models["nemoh"]))
    check_golden("convert", "nemoh-sd-to-ds.json", json_text(mask_json(d, volatile, reps)))
    d = convert(str(tmp_path / "ds.safetensors"), str(tmp_path / "shards"), "--to", "DS", "--tp-split", "2")
    check_golden("convert", "nemoh-tp-split-2.json", json_text(mask_json(d, volatile, reps)))
    # by hand: rank r of TP2 keeps 160 of 320 conv channels (x 128 + B 16 + C 16) and 4 of 8 heads
    out = {t["name"].rsplit(".", 1)[-1]: t["shape_out"] for t in d["tensors"]}
    assert out["conv_state"] == [[4, 160, 3]] * 2 and out["ssm_state"] == [[4, 4, 32, 16]] * 2
    # the output records the model by its folder name, never by the absolute path it was given (which would make
    # the header, and so the byte counts above, depend on where the test runs)
    from hybridpd.convert.header import read_header
    meta = read_header(tmp_path / "ds.safetensors").metadata
    assert meta["hybridpd.model"] == tiny_models["nemoh"].name and str(tmp_path) not in json.dumps(meta)
