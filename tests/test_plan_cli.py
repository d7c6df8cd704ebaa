"""`hybridpd plan` through its real entry point: exit codes, stdout JSON, stderr errors, imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden_files import check_golden, text_lines
from pty_support import read_pty

REQUIRED_SIDE_KEYS = {"tp", "attention_block_size", "kernel_block_size", "physical_per_logical", "page_size_bytes",
                      "mamba_page_bytes", "padding_bytes", "conv_state_shape", "ssm_state_shape", "conv_state_bytes",
                      "ssm_state_bytes", "num_kv_heads", "groups", "num_shared_tensors"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "hybridpd_cli.main", *args], capture_output=True, text=True,
                          env=e, timeout=60)


def test_json_schema_and_values() -> None:
    r = run("plan", "nano-nvfp4", "--ptp", "2", "--dtp", "2", "--vllm-version", "0.20", "--isl", "1000", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for side in ("prefill", "decode"):
        assert REQUIRED_SIDE_KEYS <= set(d[side])
        assert all(set(g) >= {"kind", "layers"} for g in d[side]["groups"])
    t = d["transfer"][0]
    assert set(t) >= {"isl", "bytes", "naive_bytes", "descriptors", "per_rank"}
    assert set(t["per_rank"][0]) >= {"rank", "bytes", "naive_bytes", "descriptors"}
    # By hand (shared/reference/vllm-hybrid-pd.md §2.5, §3.3-3.4): Nano TP2 fp8, block 4176, L = cdiv(999, 4176) = 1;
    # per D rank FA 6 slots x 4176 x 256 B = 6,414,336; Mamba 6 slots x 4 groups x (18432 + 1048576) = 25,608,192
    # (padding never moves; full pages would add 24 x 2048 = 49,152); 2 D ranks.
    assert (t["fa_bytes"], t["mamba_bytes"], t["bytes"]) == (12_828_672, 51_216_384, 64_045_056)
    assert t["naive_bytes"] == 64_045_056 + 2 * 24 * 2048
    assert t["descriptors"] == 2 * (2 * 6 * 1 * 261 + 4 * 6 * 4)  # 0.20: K, V separate, kernel 16 (261 per block)
    # NVFP4 checkpoint: hf_quant_config kv_cache_quant_algo FP8 -> fp8 KV (reference §2.2) -> block 4176
    assert d["prefill"]["kv_cache_dtype"] == "fp8"
    assert d["prefill"]["attention_block_size"] == 4176
    assert t["per_rank"][0]["bytes"] == 32_022_528
    assert all(set(f) == {"severity", "code", "message", "fix"} for f in d["findings"])
    assert isinstance(d["conv_offsets"], list) and d["conv_offsets"][0]["rank"] == 0


def test_human_output_has_sections() -> None:
    r = run("plan", "granite-tiny", "--ptp", "1", "--dtp", "2", "--fmt", "plain")
    assert r.returncode == 1, r.stderr  # refused combination (conv-state-corruption): exit 1, report printed
    for title in ("Per-side layout", "HMA groups", "NIXL descriptors", "Per request", "Findings"):
        assert title in r.stdout
    assert "conv-state-corruption" in r.stdout


def test_markdown_format() -> None:
    r = run("plan", "nano", "--fmt", "markdown")
    assert r.returncode == 0 and "| " in r.stdout and "### Findings" in r.stdout


def test_refused_combination_exits_1_and_strict_fails_on_warnings() -> None:
    r = run("plan", "granite-tiny", "--ptp", "1", "--dtp", "2", "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["ok"] is False
    # accepted with a warning (prefix caching on by default): 0, but 1 under --strict
    ok = run("plan", "nano", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    assert json.loads(ok.stdout)["verdict"]["warnings"] >= 1
    assert run("plan", "nano", "--strict", "--json").returncode == 1
    assert run("plan", "nano", "--no-enable-prefix-caching", "--strict", "--json").returncode == 0


@pytest.mark.parametrize("args,needle", [
    (("plan", "no-such-model"), "MODEL"),
    (("plan", "nano", "--ptp", "0"), "--ptp"),
    (("plan", "nano", "--gpu-memory", "lots"), "--gpu-memory"),
    (("plan", "nano", "--vllm-version", "0.19"), "--vllm-version"),
    (("plan", "nano", "--isl", "abc"), "--isl"),
])
def test_usage_errors_exit_2_one_line(args: tuple[str, ...], needle: str) -> None:
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert needle in r.stderr
    assert lines[-1].startswith("Error")


def test_plan_does_not_import_heavy_modules() -> None:
    code = ("import sys; from hybridpd_cli.main import main\n"
            "try:\n    main(['plan','nano','--json'])\nexcept SystemExit:\n    pass\n"
            "bad=[m for m in ('torch','vllm','nixl','numpy','safetensors') if m in sys.modules]\n"
            "print('HEAVY', bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr


def test_help_does_not_import_library_layout() -> None:
    code = ("import sys; from hybridpd_cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', [m for m in ('hybridpd.core.layout','torch','rich') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LOADED []" in r.stdout, r.stdout[-300:]


def test_model_from_directory_and_config_path(tiny_models: dict[str, Path]) -> None:
    for arg in (tiny_models["nemoh"], tiny_models["nemoh"] / "config.json"):
        r = run("plan", str(arg), "--platform", "cpu", "--no-enable-prefix-caching", "--isl", "97", "--json",
                "--vllm-version", "0.32")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["transfer"][0]["bytes"] == 102144


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig.png"
    r = run("plan", "nano", "--plot", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- issue #16: what an operator sees ----------------------------------------------------------------

BOX = set("┏┓┗┛┃━┡┩│─└┘┌┐╇╈┳┻")
NANO_FP8 = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8"


def test_verdict_is_the_first_line_and_names_the_fp8_fix() -> None:
    """Item 1: the headline example starts with its verdict and a fix right for the FP8 KV cache."""
    r = run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4", "--vllm-version", "0.32")
    assert r.returncode == 1
    first = r.stdout.splitlines()[0]
    assert first.startswith("REFUSED: 1 error"), first
    assert "block-not-divisible" in first and "--block-size 4176" in first
    # the fix is checked against the other plausible KV dtype (bf16: P 2096 / D 1056, so 4176 holds too)
    assert "also right for KV bfloat16" in first
    assert "2096 to both" not in r.stdout
    # what the bundled config could not say is stated at the top, before any table
    top = r.stdout.split("\n\n")[0]
    assert "Assumed (bundled config)" in top and "KV cache assumed FP8" in top and "SSM state assumed float32" in top


@pytest.mark.parametrize("tp,block", [(1, 4176), (2, 4176), (4, 2096), (8, 1056)])
def test_fp8_checkpoint_plans_an_fp8_kv_cache(tp: int, block: int) -> None:
    """Item 1: Nano-FP8's KV cache is FP8 by default (NVIDIA's recipe); blocks from the reference table.

    Hand check TP1: Mamba page 3*6144*2 + 64*64*128*4 = 2,134,016 B; fp8 KV 2 heads*128*2*1 = 512 B/token;
    16 * ceil(2,134,016 / (16*512)) = 16 * 261 = 4176.  TP4: (3*1536*2 + 16*64*128*4) = 533,504 B over
    256 B/token -> 16 * ceil(533,504 / 4096) = 16 * 131 = 2096.
    """
    d = json.loads(run("plan", "nano-fp8", "--ptp", str(tp), "--dtp", str(tp), "--json").stdout)
    assert d["prefill"]["kv_cache_dtype"] == "fp8"
    assert d["prefill"]["ssm_dtype"] == "float32"
    assert d["prefill"]["attention_block_size"] == block


def test_super_fp8_plans_fp8_kv_and_fp16_ssm_state() -> None:
    """Super-FP8 (docs.nvidia.com super3 quantization: FP8 KV cache, Mamba state FP16). Hand check at TP4:
    conv (3, (128*64 + 2*8*128)/4 = 2560) bf16 = 15,360 B; SSM 32*64*128*2 = 524,288 B -> 539,648 B;
    KV 1 head*128*2*1 = 256 B/token -> 16 * ceil(539,648 / 4096) = 16 * 132 = 2112."""
    d = json.loads(run("plan", "super-fp8", "--ptp", "4", "--dtp", "4", "--json").stdout)
    assert (d["prefill"]["kv_cache_dtype"], d["prefill"]["ssm_dtype"]) == ("fp8", "float16")
    assert d["prefill"]["mamba_page_bytes"] == 539_648
    assert d["prefill"]["attention_block_size"] == 2112


def test_printed_block_fix_is_accepted_with_fp8_kv() -> None:
    """Item 1: applying the printed fix gives an accepted plan where both sides keep 4176 (D page
    4176*256 = 1,069,056 B >= its Mamba page 533,504 B)."""
    d = json.loads(run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4", "--json").stdout)
    assert d["recommended_block_size"] == 4176
    fixed = run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4", "--block-size", "4176", "--json")
    f = json.loads(fixed.stdout)
    assert not [x for x in f["findings"] if x["severity"] == "error"], f["findings"]
    assert f["prefill"]["attention_block_size"] == f["decode"]["attention_block_size"] == 4176
    assert f["decode"]["page_size_bytes"] == 1_069_056


@pytest.mark.parametrize("kv,before,after,pad", [
    # 0.9 * 141e9 = 126.9e9 B; D page * 6 shared tensors: bf16 540,672 (1056 tokens) -> 1,073,152 (2096)
    ("bfloat16", "39,117", "19,708", "101%"),
    # fp8: 536,576 (2096 tokens) -> 1,069,056 (4176); 126.9e9 // 3,219,456 = 39,416; // 6,414,336 = 19,783
    ("fp8", "39,416", "19,783", "100%"),
])
def test_capacity_finding_when_the_block_fix_costs_blocks(kv: str, before: str, after: str, pad: str) -> None:
    """Item 4: the recommended --block-size halves decode's blocks; a warning says so, and no info row
    beside the ERROR says 'nothing to do'."""
    d = json.loads(run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4", "--kv-cache-dtype", kv, "--gpu-memory",
                       "141GB", "--json").stdout)
    cap = [f for f in d["findings"] if f["code"] == "block-size-capacity"]
    assert len(cap) == 1 and cap[0]["severity"] == "warning"
    assert f"decode {before} -> {after} blocks" in cap[0]["message"]
    assert f"-> {pad})" in cap[0]["message"]
    assert not [f for f in d["findings"] if "nothing to do" in f["fix"]]


def test_no_capacity_finding_without_a_block_fix() -> None:
    d = json.loads(run("plan", "nano-fp8", "--ptp", "2", "--dtp", "2", "--gpu-memory", "141GB", "--json").stdout)
    assert not [f for f in d["findings"] if f["code"] == "block-size-capacity"]


def _human(width: int, *args: str) -> str:
    r = run("plan", *args, "--fmt", "rich", env={"COLUMNS": str(width), "TERM": "dumb"})
    assert r.returncode in (0, 1), r.stderr
    return r.stdout


def _plan_cells(*args: str) -> list[str]:
    """Every cell the human report holds, via the renderer's own data (the check below is structural)."""
    from hybridpd_cli.plan import render

    d = json.loads(run("plan", *args, "--json").stdout)
    rep = render(d)
    from hybridpd_cli._output import _cell

    return [_cell(c) for t in rep.tables for r in t.rows for c in r]


# values computed by hand for nano-fp8 1->4 (fp8 KV): P page 4176*512, D page 2096*256, B's offset in P's
# conv state = 4096 x-channels * 3 rows * 2 B, B's length on D = 256 channels * 3 * 2 B, D rank 2's FA
# offset = 2 * 4176*256 / 2 (KV head 1 of P's 2) ... = 1,069,056, SSM of rank 3 = 36,864 + 3 * 524,288
HAND = ["2,138,112", "536,576", "24576+1536", "1069056+536576", "1609728+524288", "36,864 + 2,097,152",
        "9,216 + 524,288", NANO_FP8]


@pytest.mark.parametrize("width", [200, 80, 60])
def test_no_number_or_id_split_at_any_width(width: int) -> None:
    """Item 2: at 200, 80 and 60 columns every number and model id stays on one line."""
    args = ("nano-fp8", "--ptp", "1", "--dtp", "4", "--vllm-version", "0.32")
    out = _human(width, *args)
    lines = out.splitlines()
    for v in HAND:
        assert any(v in ln for ln in lines), (v, width)
    from hybridpd_cli._output import atomic

    for cell in _plan_cells(*args):
        pieces = [cell] if atomic(cell) else cell.split()
        for piece in pieces:
            assert any(piece in ln for ln in lines), (repr(piece), width)
    too_long = [ln for ln in lines if len(ln.rstrip()) > width and " " in ln.strip()]
    assert not too_long, too_long[:3]


def test_models_table_keeps_ids_whole_at_80_columns() -> None:
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "models", "--fmt", "rich"], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "80", "TERM": "dumb"}, timeout=60)
    assert r.returncode == 0, r.stderr
    for mid in (NANO_FP8, "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4", "ibm-granite/granite-4.0-h-tiny"):
        assert any(mid in ln for ln in r.stdout.splitlines()), mid


def _pty_run(*args: str, cols: int = 80) -> tuple[int, str]:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["TERM"] = "xterm-256color"
    env.pop("NO_COLOR", None)
    p = subprocess.Popen([sys.executable, "-m", "hybridpd_cli.main", *args], stdout=slave, stderr=subprocess.PIPE,
                         env=env)
    os.close(slave)
    out = read_pty(master)
    return p.wait(timeout=60), out.decode()


def test_terminal_gets_boxes_and_colour_pipe_gets_plain_text() -> None:
    """Item 3: rich boxes and a coloured verdict on a terminal; no box characters when piped."""
    code, tty_out = _pty_run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4")
    assert code == 1
    assert BOX & set(tty_out)
    assert "\x1b[" in tty_out.splitlines()[0]  # the verdict is coloured
    piped = run("plan", "nano-fp8", "--ptp", "1", "--dtp", "4")
    assert not (BOX & set(piped.stdout)), sorted(BOX & set(piped.stdout))
    assert "\x1b[" not in piped.stdout
    assert piped.stdout.startswith("REFUSED")


def test_tables_say_warning_like_the_json() -> None:
    """Item 8: one word for a warning."""
    out = run("plan", "nano", "--fmt", "plain").stdout
    assert "warning" in out and " warn " not in out


def test_descriptor_range_is_explained() -> None:
    """Item 11: a cell such as '216 (180 if coalesced)' instead of an unexplained '180-216'."""
    d = json.loads(run("plan", "falcon-h1-0.5b", "--isl", "1k", "--json").stdout)
    t = d["transfer"][0]
    assert t["descriptors_min"] < t["descriptors"]
    out = run("plan", "falcon-h1-0.5b", "--isl", "1k", "--fmt", "plain").stdout
    assert f"{t['descriptors']:,} ({t['descriptors_min']:,} if coalesced)" in out
    assert f"{t['descriptors_min']:,}-{t['descriptors']:,}" not in out


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("width", [80, 200])
def test_golden_human_output(width: int) -> None:
    """The acceptance goldens: `plan nano-fp8 --ptp 1 --dtp 4` as a terminal of WIDTH columns shows it.
    Regenerate with HYBRIDPD_REGEN_GOLDEN=1 after an intended change (and read the diff)."""
    args = ["plan", "nano-fp8", "--ptp", "1", "--dtp", "4", "--vllm-version", "0.32", "--calibration",
            "tests/golden/plan/calibration.json", "--fmt", "rich"]
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "COLUMNS": str(width), "TERM": "dumb"}, timeout=60)
    assert r.returncode == 1, r.stderr
    got = text_lines(r.stdout)
    check_golden("plan", f"nano-fp8-1-4-{width}.txt", got)
    assert max(len(ln) for ln in got.splitlines()) <= width
    for v in HAND:
        assert v in got


def test_invalid_side_gets_no_spurious_block_finding() -> None:
    """Item 11: `plan nano --ptp 3` (32 heads, n_groups 8, Mamba 4096 channels: none divisible by 3) reports
    the TP errors only, no block-size-mismatch computed from a side vLLM would never build."""
    d = json.loads(run("plan", "nano", "--ptp", "3", "--json").stdout)
    codes = {f["code"] for f in d["findings"]}
    assert {"tp-heads", "n-groups-tp"} <= codes
    assert not codes & {"block-size-mismatch", "block-not-divisible", "block-size-capacity"}


def test_n_groups_tp_is_a_finding_for_every_model() -> None:
    """Item 11: Falcon-H1-34B (n_groups 2) at D TP 4 is the n-groups-tp finding (exit 1, a report), not a
    bare `Error:` line."""
    r = run("plan", "falcon-h1-34b", "--ptp", "2", "--dtp", "4", "--json")
    assert r.returncode == 1, r.stderr
    d = json.loads(r.stdout)
    assert any(f["code"] == "n-groups-tp" and "TP 4" in f["message"] for f in d["findings"])


def test_fix_says_what_it_assumes_when_the_ssm_dtype_is_uncertain() -> None:
    """Super-FP8's SSM state is float16 per NVIDIA's quantization page, float32 per its deployment guide.
    Hand check, P TP 1: conv 3*(8192 + 2*8*128)*2 = 61,440 B; SSM fp16 128*64*128*2 = 2,097,152 B ->
    2,158,592 B over fp8 KV 512 B/token -> 16*ceil(2,158,592/8192) = 4224; SSM fp32 4,194,304 B ->
    4,255,744 B -> 16*ceil(4,255,744/8192) = 8320 (D TP 4 then needs 4160 <= 8320, so 8320 covers both)."""
    r = run("plan", "super-fp8", "--ptp", "1", "--dtp", "4", "--json")
    v = json.loads(r.stdout)["verdict"]
    chk = v["block_fix_check"]
    assert chk["block_size"] == 4224 and "SSM float16" in chk["assumes"]
    assert {"dtype": "SSM float32", "block_size": 8320} in chk["fails_for"]
    assert chk["holds_for_all"] == 8320
    first = run("plan", "super-fp8", "--ptp", "1", "--dtp", "4").stdout.splitlines()[0]
    assert "--block-size 4224" in first and "with SSM float32 use --block-size 8320" in first


def test_renderer_width_rules() -> None:
    """The renderer's unit rules: numeric cells are atomic, columns never narrower than their widest
    token, and a table that cannot fit unbroken folds into key/value lines that never break a token."""
    from hybridpd_cli._output import Table, atomic, column_widths, key_value_lines

    assert atomic("12,288 B (0.58%)") and atomic("36,864 + 2,097,152") and atomic("24576+1536")
    assert atomic("697.1 µs") and atomic("3x6144 / 6144x3")
    assert not atomic("bfloat16 / float32") and not atomic("pass --block-size 4176 to both")
    # two columns: widest tokens 9 ("2,146,304") and 10; overhead 3*2+1 = 7 -> needs 26 columns
    rows = [["2,146,304", "short text"], ["1", "abcdefghij x"]]
    assert column_widths(["a", "b"], rows, 26) is not None
    assert column_widths(["a", "b"], rows, 25) is None
    t = Table(title="t", headers=["id", "value"], rows=[[NANO_FP8, "a long message " * 4]])
    lines = key_value_lines(t, 20)
    assert any(NANO_FP8 in ln for ln in lines)
    assert all(len(ln) <= 20 or NANO_FP8 in ln for ln in lines)
