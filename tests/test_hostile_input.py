"""#15: every input gets an answer. Each example of the issue, then a bounded fuzz over every bundled config,
flag sets and output paths (tests/fuzz_cases.py; the full, forked and memory-limited run is bench/fuzz_inputs.py).

An answer is: exit 0/1 with strict JSON, or exit 2 with one `Error:` line naming the key as that family's
config spells it. Never a traceback, never a hang, never a file the user did not name.
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fuzz_cases as fc  # noqa: E402

from hybridpd.errors import ConfigError, HybridPDError, UsageError  # noqa: E402

CONFIGS = dict(fc.bundled())
NANO = CONFIGS["nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"]
GRANITE = CONFIGS["ibm-granite__granite-4.0-h-tiny"]
FALCON = CONFIGS["tiiuae__Falcon-H1-0.5B-Instruct"]
ZAMBA = CONFIGS["Zyphra__Zamba2-2.7B"]
MAMBA2 = CONFIGS["state-spaces__mamba2-2.7b"]


def cli(argv: list[str], cwd: Path | None = None, limit_s: float = 20.0) -> tuple[int | None, str, str]:
    """In-process run of the real entry point; an escaping exception or a hang fails the test."""
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        code, out, err, exc = fc.run_inprocess(argv, limit_s=limit_s)
    finally:
        os.chdir(old)
    assert exc is None, exc
    return code, out, err


def refused(argv: list[str], *names: str, cwd: Path | None = None, absent: tuple[str, ...] = ()) -> str:
    code, out, err = cli(argv, cwd=cwd)
    lines = err.strip().splitlines()
    assert code == 2, (code, out[:300], err)
    assert "Traceback" not in err and lines and lines[-1].startswith("Error:"), err
    msg = lines[-1]
    for n in names:
        assert n in msg, (n, msg)
    for n in absent:
        assert n not in msg, (n, msg)
    return msg


def model_dir(tmp_path: Path, cfg: dict[str, Any] | None = None, raw: bytes | None = None) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(raw if raw is not None else json.dumps(cfg).encode())
    return d


def with_raw(cfg: dict[str, Any], key: str, raw: str) -> bytes:
    return fc._with_raw(cfg, key, raw)


def plan(d: Path, *extra: str) -> list[str]:
    return ["plan", str(d), "--json", *extra]


# ---- config.json: the examples ------------------------------------------------------------------------

def test_deep_nesting_is_a_clean_error_naming_the_key(tmp_path: Path) -> None:
    d = model_dir(tmp_path, raw=with_raw(NANO, "ssm_state_size", "[" * 5000 + "]" * 5000))
    refused(plan(d), "MODEL", "ssm_state_size", "deeper than 64")
    d = model_dir(tmp_path, raw=with_raw(NANO, "rope_theta", "[" * 100 + "]" * 100))  # under the recursion limit
    refused(plan(d), "rope_theta", "deeper than 64")


def test_5001_digit_integer_names_its_key(tmp_path: Path) -> None:
    refused(plan(model_dir(tmp_path, raw=with_raw(NANO, "mamba_num_heads", "9" * 5001))), "mamba_num_heads",
            "5001 digits")


def test_nan_infinity_and_1e999_name_their_key(tmp_path: Path) -> None:
    for raw in ("NaN", "-Infinity", "1e999"):
        refused(plan(model_dir(tmp_path, raw=with_raw(FALCON, "mamba_d_state", raw))), "mamba_d_state", raw)


def test_invalid_utf8_is_a_clean_error(tmp_path: Path) -> None:
    raw = json.dumps(NANO).encode().replace(b'"model_type"', b'"model_\xfftype"')
    refused(plan(model_dir(tmp_path, raw=raw)), "MODEL", "not UTF-8")


def test_ssm_cfg_list_is_a_clean_error(tmp_path: Path) -> None:
    refused(plan(model_dir(tmp_path, {**MAMBA2, "ssm_cfg": [1]})), "ssm_cfg", "object")
    refused(plan(model_dir(tmp_path, {**MAMBA2, "ssm_cfg": {**MAMBA2["ssm_cfg"], "d_conv": 1}})), "ssm_cfg.d_conv")


def test_granite_layer_types_of_dicts_is_a_clean_error(tmp_path: Path) -> None:
    refused(plan(model_dir(tmp_path, {**GRANITE, "layer_types": [{}] * GRANITE["num_hidden_layers"]})),
            "layer_types[0]", "mamba")


@pytest.mark.parametrize("special", ["fifo", "devzero", "devnull", "dir"])
def test_special_files_are_refused_without_blocking(tmp_path: Path, special: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    p = d / "config.json"
    {"fifo": lambda: os.mkfifo(p), "devzero": lambda: p.symlink_to("/dev/zero"),
     "devnull": lambda: p.symlink_to("/dev/null"), "dir": lambda: p.mkdir()}[special]()

    def limit() -> None:  # on the old code /dev/zero grew until MemoryError; keep a regression from eating the box
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "plan", str(d)], capture_output=True, text=True,
                       timeout=30, preexec_fn=limit)
    assert r.returncode == 2 and time.monotonic() - t0 < 20, r.stderr
    assert "not a regular file" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_oversized_config_is_refused_before_reading(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    with open(p, "wb") as f:
        f.write(b'{"model_type": "nemotron_h", "x": "')
        f.truncate(64 << 20)
    refused(["plan", str(p)], "MODEL", "byte limit")


@pytest.mark.parametrize("cfg,raw,needle", [
    (FALCON, "1" + "0" * 100, "101 digits"),  # the old code: OverflowError building 10**100 layers
    (FALCON, "1000000", "1000000"),  # the old code: 5.4 s and 517 MB, then exit 0
    (GRANITE, "1e100", "1e+100"), (GRANITE, "0", "0"), (NANO, "true", "True")])
def test_num_hidden_layers_out_of_range(tmp_path: Path, cfg: dict[str, Any], raw: str, needle: str) -> None:
    t0 = time.monotonic()
    refused(plan(model_dir(tmp_path, raw=with_raw(cfg, "num_hidden_layers", raw))), "num_hidden_layers", needle)
    assert time.monotonic() - t0 < 5  # the old code spent 5.4 s and 517 MB on 1e6 layers (a bound, not a benchmark)


@pytest.mark.parametrize("cfg,key", [(NANO, "conv_kernel"), (GRANITE, "mamba_d_conv"), (FALCON, "mamba_d_conv"),
                                     (ZAMBA, "mamba_d_conv")])
def test_conv_kernel_1_is_refused_with_the_reason(tmp_path: Path, cfg: dict[str, Any], key: str) -> None:
    msg = refused(plan(model_dir(tmp_path, {**cfg, key: 1})), key, "leaves the state empty")
    assert "conv_kernel" not in msg or key == "conv_kernel", msg


def test_falcon_missing_d_ssm_is_named(tmp_path: Path) -> None:
    cfg = {k: v for k, v in FALCON.items() if k != "mamba_d_ssm"}
    cfg["mamba_expand"] = 3  # 3 * hidden_size != mamba_n_heads * mamba_d_head
    refused(plan(model_dir(tmp_path, cfg)), "mamba_d_ssm", "mamba_n_heads", absent=("mamba_num_heads",))


@pytest.mark.parametrize("cfg,key,val", [(GRANITE, "mamba_n_heads", 7), (GRANITE, "mamba_expand", 3),
                                         (ZAMBA, "n_mamba_heads", 7), (FALCON, "mamba_d_head", 7),
                                         (GRANITE, "mamba_n_groups", 5), (ZAMBA, "mamba_ngroups", 3)])
def test_mamba_errors_use_the_familys_own_keys(tmp_path: Path, cfg: dict[str, Any], key: str, val: int) -> None:
    fam = fc.family_of(cfg)
    msg = refused(plan(model_dir(tmp_path, {**cfg, key: val})), key)
    foreign = {w.rstrip(".") for w in fc._WORD.findall(msg)} & fc.ALL_KEYS - fc.FAMILY_KEYS[fam]
    assert not foreign, (foreign, msg)


def test_bundled_configs_still_load() -> None:
    from hybridpd.core import families, models

    for hf_id in models.bundled_ids():
        families.model_spec(models.load_bundled(hf_id))


def test_input_is_never_modified(tmp_path: Path) -> None:
    d = model_dir(tmp_path, NANO)
    before = (d / "config.json").read_bytes(), os.stat(d / "config.json").st_mtime_ns
    cli(plan(d, "--plot", str(tmp_path / "p.png")))
    assert ((d / "config.json").read_bytes(), os.stat(d / "config.json").st_mtime_ns) == before


# ---- flags -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value,needle", [
    ("--isl", "infk", "not a token count"), ("--isl", "1e99k", "not a token count"),
    ("--isl", "99999999999", "outside 1..16,777,216"), ("--isl", "0.3k", "not a whole number"),
    ("--gpu-memory", "1e999", "no unit"), ("--gpu-memory", "141", "141GB"), ("--gpu-memory", "1e999GB", "1 PiB"),
    ("--gpu-memory", "nanGB", "cannot parse"), ("--dtp", "65536", "1<=x<=1024"), ("--ptp", "9" * 5001, "1<=x<=1024"),
    ("--gpu-memory-utilization", "nan", "finite"), ("--num-blocks", "1000000000000", "x<="),
])
def test_bad_flags_exit_2(flag: str, value: str, needle: str) -> None:
    t0 = time.monotonic()
    refused(["plan", "nano", "--json", flag, value], flag, needle)
    assert time.monotonic() - t0 < 5  # --dtp 65536 ran for ever (a bound on a hang, not a benchmark)


def test_sizes_and_isls_parse_to_exact_bytes() -> None:
    from hybridpd_cli._options import parse_byte_size, parse_isls

    assert parse_byte_size("141GB") == 141 * 10**9
    assert parse_byte_size("80GiB") == 80 * 2**30
    assert parse_byte_size("1.5e9B") == 1_500_000_000
    assert parse_byte_size("512 MiB") == 512 * 2**20
    assert parse_isls("1k, 8k,1.5k,1000") == (1024, 8192, 1536, 1000)
    for bad in ("141", "1e999", "GB", "-1GB", "0x10GB", "1,5GB"):
        with pytest.raises(UsageError):
            parse_byte_size(bad)


def _cal(tmp_path: Path, **kw: Any) -> str:
    p = tmp_path / "cal.json"
    p.write_bytes(fc._cal(**kw))
    return str(p)


@pytest.mark.parametrize("kw,key", [({"bandwidth_gbps": 1e-320}, "bandwidth_gbps"),
                                    ({"per_descriptor_us": 1e308}, "per_descriptor_us")])
def test_calibration_that_would_print_infinity_is_refused(tmp_path: Path, kw: dict[str, float], key: str) -> None:
    refused(["plan", "nano", "--json", "--calibration", _cal(tmp_path, **kw)], "--calibration", key)


def test_calibration_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.json")
    refused(["plan", "nano", "--json", "--calibration", str(tmp_path / "fifo.json")], "--calibration", "FIFO")


def test_json_output_is_strict(tmp_path: Path) -> None:
    code, out, _ = cli(["plan", "nano", "--json", "--calibration", _cal(tmp_path, bandwidth_gbps=1e-6)])
    assert code == 0 and fc.strict_json(out)


# ---- output files ------------------------------------------------------------------------------------------------

OUTPUTS = [(["plan", "nano", "--json", "--plot"], "png"), (["serve", "nano", "--emit", "k8s", "-o"], "yaml")]


@pytest.mark.parametrize("cmd,ext", OUTPUTS)
def test_output_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path, cmd: list[str], ext: str) -> None:
    (tmp_path / f"real.{ext}").write_bytes(b"old")
    (tmp_path / f"link.{ext}").symlink_to(f"real.{ext}")
    code, _, err = cli([*cmd, f"link.{ext}"], cwd=tmp_path)
    assert code in (0, 1), err
    assert (tmp_path / f"link.{ext}").is_symlink() and (tmp_path / f"real.{ext}").read_bytes() != b"old"
    assert not list(tmp_path.glob(".hybridpd-*"))


@pytest.mark.parametrize("cmd,ext", OUTPUTS)
def test_output_mode_follows_the_umask(tmp_path: Path, cmd: list[str], ext: str) -> None:
    old = os.umask(0o027)
    try:
        code, _, err = cli([*cmd, f"out.{ext}"], cwd=tmp_path)
    finally:
        os.umask(old)
    assert code in (0, 1), err
    assert stat.S_IMODE(os.stat(tmp_path / f"out.{ext}").st_mode) == 0o640  # the old code made 0600


@pytest.mark.parametrize("cmd,ext", OUTPUTS)
@pytest.mark.parametrize("what", ["dev-link", "dangling", "fifo", "missing-dir", "chardev"])
def test_outputs_never_replace_what_the_user_did_not_mean(tmp_path: Path, cmd: list[str], ext: str, what: str) -> None:
    out = tmp_path / f"out.{ext}"
    target = out.name
    if what == "dev-link":  # to a private device: never /dev/null (an old build replaced it when run as root)
        try:
            os.mknod(tmp_path / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            os.mkfifo(tmp_path / "dev")
        out.symlink_to("dev")
    elif what == "dangling":
        out.symlink_to("nowhere")
    elif what == "fifo":
        os.mkfifo(out)
    elif what == "missing-dir":
        target = f"nodir/out.{ext}"
    elif what == "chardev":
        try:
            os.mknod(out, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a private /dev/null
        except PermissionError:
            pytest.skip("mknod needs root")
    before = os.lstat(out).st_mode if what != "missing-dir" else None
    why = {"dev-link": "symlink to a character device", "dangling": "does not exist", "fifo": "FIFO",
           "missing-dir": "does not exist", "chardev": "character device"}[what]
    if what == "dev-link" and not stat.S_ISCHR(os.stat(out).st_mode):
        why = "symlink to a FIFO"
    refused([*cmd, target], "--plot" if ext == "png" else "output", why, cwd=tmp_path)
    if before is not None:
        assert os.lstat(out).st_mode == before
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "nodir").exists()
    assert not list(tmp_path.glob(".hybridpd-*"))


def test_write_atomic_parents_only_when_asked(tmp_path: Path) -> None:
    from hybridpd.fsutil import output_target, write_atomic

    with pytest.raises(UsageError, match="does not exist"):
        write_atomic(str(tmp_path / "a" / "b.txt"), "x")
    write_atomic(str(tmp_path / "a" / "b.txt"), "x", parents=True)
    assert (tmp_path / "a" / "b.txt").read_text() == "x"
    with pytest.raises(UsageError, match="directory"):
        output_target(str(tmp_path / "a"))


def test_write_failure_says_nothing_was_written(tmp_path: Path) -> None:
    from hybridpd.errors import OutputError
    from hybridpd.fsutil import atomic_target

    (tmp_path / "t").write_text("old")
    with pytest.raises(OutputError, match="nothing was written"), atomic_target(str(tmp_path / "t")) as tmp:
        raise OSError(28, "No space left on device", tmp)
    assert (tmp_path / "t").read_text() == "old" and not list(tmp_path.glob(".hybridpd-*"))


def test_write_atomic_to_a_name_near_name_max(tmp_path: Path) -> None:
    from hybridpd.fsutil import write_atomic

    out = tmp_path / ("k" * 250 + ".yaml")  # 255 bytes: the temporary keeps only a part of the name
    write_atomic(str(out), "x")
    assert out.read_text() == "x" and not list(tmp_path.glob(".hybridpd-*"))


def test_read_bounded_and_json_limits(tmp_path: Path) -> None:
    from hybridpd.fsutil import NotANumber, parse_json_bytes, read_bounded

    p = tmp_path / "x.json"
    p.write_bytes(b"x" * 101)
    with pytest.raises(ConfigError, match="limit"):
        read_bounded(p, field="F", limit=100)
    assert read_bounded(p, field="F", limit=101) == b"x" * 101
    data = parse_json_bytes(b'{"a": NaN, "b": 1e999, "c": ' + b"1" * 40 + b', "d": 12}', where="w", field="F")
    assert all(isinstance(data[k], NotANumber) for k in "abc") and data["d"] == 12
    assert json.dumps(data, allow_nan=False)  # never NaN/Infinity when written back


# ---- fuzz ----------------------------------------------------------------------------------------------------------

FUZZ_CONFIGS = int(os.environ.get("HYBRIDPD_FUZZ_CONFIGS", "5000"))
FUZZ_FLAGS = int(os.environ.get("HYBRIDPD_FUZZ_FLAGS", "500"))
LIMIT_S = 2.0


def _run_cases(cases: list[fc.Case], tmp_path: Path, limit_s: float = LIMIT_S) -> tuple[Counter[str], list[str]]:
    counts: Counter[str] = Counter()
    bad: list[str] = []
    for i, case in enumerate(cases):
        work = tmp_path / str(i)
        work.mkdir()
        argv = fc.materialize(case, work)
        old = os.getcwd()
        os.chdir(work)
        t0 = time.monotonic()
        try:
            code, out, err, exc = fc.run_inprocess(argv, limit_s=limit_s)
        finally:
            os.chdir(old)
        outcome = fc.classify(case, code, out, err, exc=exc, seconds=time.monotonic() - t0, limit_s=limit_s)
        if outcome in ("ok", "refused") and case.kind == "file":
            side = fc.check_files(case, work, code)
            outcome = "files" if side else outcome
            err = side or err
        counts[outcome] += 1
        if outcome not in ("ok", "refused"):
            bad.append(f"{outcome}: {case.id[:150]} -> {(exc or err).strip()[-300:]}")
    return counts, bad


def test_fuzz_configs(tmp_path: Path) -> None:
    """A seeded sample of mutations of every bundled config: 0 tracebacks, 0 runs over 2 s, 0 bad values accepted,
    every error naming a key of that family."""
    import random

    cases = fc.config_cases(seed=1)
    cases = [c for c in cases if c.special is None] + [c for c in cases if c.special in ("fifo", "devzero", "dir")]
    sample = random.Random(1).sample(cases, min(FUZZ_CONFIGS, len(cases)))
    counts, bad = _run_cases(sample, tmp_path)
    assert not bad, f"{fc.summarize(counts)}\n" + "\n".join(bad[:30])
    assert counts["refused"] > len(sample) // 2  # the mutations mostly are invalid: the sample really tests refusals


def test_fuzz_flags(tmp_path: Path) -> None:
    cases = fc.flag_cases(FUZZ_FLAGS, seed=1)
    counts, bad = _run_cases(cases, tmp_path)
    assert not bad, f"{fc.summarize(counts)}\n" + "\n".join(bad[:30])
    assert counts["refused"] and counts["ok"]


def test_fuzz_output_paths(tmp_path: Path) -> None:
    counts, bad = _run_cases(fc.file_cases(), tmp_path, limit_s=60.0)  # a PNG render takes ~1 s on a busy box
    assert not bad, f"{fc.summarize(counts)}\n" + "\n".join(bad)


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) |
                     st.text(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c,
                                                                                              max_size=3), max_leaves=8)
_KEYED = [(name, key) for name, cfg in CONFIGS.items() for key in sorted(cfg)
          if key in fc.FAMILY_KEYS.get(fc.family_of(cfg), set())]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_KEYED), _json, st.sampled_from([(1, 1), (1, 2), (2, 1), (4, 4)]))
def test_any_value_for_any_read_key_is_typed(target: tuple[str, str], value: Any, tps: tuple[int, int]) -> None:
    from hybridpd.core.families import model_spec
    from hybridpd.core.models import RawModel
    from hybridpd.core.plan import build_plan
    from hybridpd.core.settings import EngineSettings as E

    name, key = target
    cfg = {**CONFIGS[name], key: value}
    fam = fc.family_of(CONFIGS[name])
    try:
        spec = model_spec(RawModel(model_id="fuzz", source="path", location="x", config=cfg))
        build_plan(spec, prefill=E(tp=tps[0]), decode=E(tp=tps[1]))
    except ConfigError as e:
        assert e.field is not None and (e.field.split("[")[0] in fc.FAMILY_KEYS[fam] or e.field == key), (e.field, e)
    except HybridPDError:
        pass


# ---- convert: safetensors headers --------------------------------------------------------------------------------

def _safetensors(header: bytes, data: bytes = b"\0" * 24) -> bytes:
    import struct

    return struct.pack("<Q", len(header)) + header + data


_GOOD_HEADER = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {"k": "v"}}
_HEADER_VALUES = [v for _, v, _ in fc.VALUES] + ["[0.0, 24.0]", "[0, 24.5]", "[true, 24]", '["0", "24"]', "[24, 0]",
                                                  "[-24, 0]", "[0, " + "9" * 5001 + "]", "[2.0, 3]", "[[2], 3]"]


def _header_cases() -> list[tuple[str, bytes]]:
    out = []
    for path in (("a",), ("a", "dtype"), ("a", "shape"), ("a", "data_offsets"), ("__metadata__",),
                 ("__metadata__", "k")):
        for raw in _HEADER_VALUES:
            marker = "\u0000M\u0000"
            h = json.loads(json.dumps(_GOOD_HEADER))
            node = h
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = marker
            out.append((f"{'.'.join(path)}={raw[:12]}", json.dumps(h).replace(json.dumps(marker), raw).encode()))
    out += [("deep", b"[" * 5000 + b"]" * 5000), ("bad-utf8", b'{"\xff": 1}'), ("array", b"[1]"), ("nan", b"NaN")]
    return out


@pytest.mark.parametrize("name,header", _header_cases(), ids=[n for n, _ in _header_cases()])
def test_hostile_safetensors_header_is_a_clean_error(tmp_path: Path, name: str, header: bytes) -> None:
    from hybridpd.convert.header import read_header

    p = tmp_path / "x.safetensors"
    p.write_bytes(_safetensors(header))
    try:
        h = read_header(p)
    except UsageError as e:
        assert "not a valid safetensors file" in str(e) and "\n" not in str(e), e
    else:  # accepted: then it really is a well-formed header
        assert all(type(t.begin) is int and type(t.end) is int for t in h.tensors)
        assert all(type(s) is int for t in h.tensors for s in t.shape)


def test_safetensors_fifo_input_is_refused(tmp_path: Path) -> None:
    from hybridpd.convert.header import read_header

    os.mkfifo(tmp_path / "x.safetensors")
    with pytest.raises(UsageError, match="not a regular file"):
        read_header(tmp_path / "x.safetensors")
