"""Hostile inputs for `hybridpd plan` / `serve -o` (#15): malformed configs built from the bundled ones, flag sets,
calibration files and output paths, with an outcome classifier.

Used in-process by tests/test_hostile_input.py and in forked, time- and memory-limited children by
bench/fuzz_inputs.py.  The expectations here are written from the Hugging Face config classes and the CLI's
documented contract (exit 2 + one line naming the field; JSON without NaN/Infinity), not from hybridpd's code:
``FAMILY_KEYS`` lists the keys each architecture's config class defines and vLLM reads for the cache layout.
"""

from __future__ import annotations

import json
import os
import random
import re
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent.parent / "hybridpd" / "data" / "configs"

# model_type -> config keys that decide the layout (from transformers' NemotronHConfig, GraniteMoeHybridConfig,
# FalconH1Config, Zamba2Config, JambaConfig, Qwen3NextConfig, LlamaConfig/Qwen3Config and mamba_ssm's config).
_COMMON = {"model_type", "architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "hidden_size", "max_position_embeddings", "torch_dtype", "dtype"}
FAMILY_KEYS: dict[str, set[str]] = {
    "nemotron_h": _COMMON | {"hybrid_override_pattern", "layers_block_type", "mamba_num_heads", "mamba_head_dim",
                             "n_groups", "ssm_state_size", "conv_kernel", "head_dim", "chunk_size",
                             "mamba_ssm_cache_dtype"},
    "granitemoehybrid": _COMMON | {"layer_types", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                                   "mamba_d_conv", "mamba_expand", "mamba_chunk_size"},
    "falcon_h1": _COMMON | {"mamba_d_ssm", "mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                            "mamba_d_state", "mamba_d_conv", "head_dim", "mamba_chunk_size"},
    "zamba2": _COMMON | {"layers_block_type", "n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state",
                         "mamba_d_conv", "mamba_expand", "attention_head_dim", "chunk_size"},
    "jamba": _COMMON | {"attn_layer_offset", "attn_layer_period", "mamba_expand", "mamba_d_state", "mamba_d_conv"},
    "qwen3_next": _COMMON | {"layer_types", "full_attention_interval", "head_dim", "linear_num_key_heads",
                             "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                             "linear_conv_kernel_dim"},
    "mamba2": {"d_model", "n_layer", "ssm_cfg", "attn_layer_idx", "model_type", "ssm_cfg.layer", "ssm_cfg.expand",
               "ssm_cfg.headdim", "ssm_cfg.ngroups", "ssm_cfg.d_state", "ssm_cfg.d_conv"},
    "dense": _COMMON | {"head_dim"},
}
# keys whose every value is read (a bad value must be refused); the others are read only in some configs
_ALWAYS: dict[str, set[str]] = {
    "nemotron_h": {"mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                   "hybrid_override_pattern", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "max_position_embeddings", "chunk_size", "head_dim"},
    "granitemoehybrid": {"layer_types", "num_hidden_layers", "hidden_size", "mamba_n_heads", "mamba_d_head",
                         "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand", "num_attention_heads",
                         "num_key_value_heads", "max_position_embeddings", "mamba_chunk_size"},
    "falcon_h1": {"num_hidden_layers", "hidden_size", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                  "mamba_d_state", "mamba_d_conv", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings", "mamba_chunk_size"},
    "zamba2": {"layers_block_type", "num_hidden_layers", "hidden_size", "n_mamba_heads", "mamba_headdim",
               "mamba_ngroups", "mamba_d_state", "mamba_d_conv", "mamba_expand", "num_attention_heads",
               "num_key_value_heads", "attention_head_dim", "max_position_embeddings", "chunk_size"},
    "jamba": {"num_hidden_layers", "attn_layer_period", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "hidden_size", "mamba_expand", "mamba_d_state", "mamba_d_conv"},
    "qwen3_next": {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "max_position_embeddings", "full_attention_interval", "linear_num_key_heads",
                   "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"},
    "mamba2": {"d_model", "n_layer"},
    "dense": {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings"},
}
_CONV = {"conv_kernel", "mamba_d_conv", "d_conv", "linear_conv_kernel_dim"}
ALL_KEYS = set().union(*FAMILY_KEYS.values())
DENSE_TYPES = {"llama", "qwen3", "qwen2", "mistral"}

# (name, JSON text, invalid for a key that is always read). Raw text so that 5,001-digit integers, NaN and
# 1e999 reach the parser as a file would carry them.
VALUES: list[tuple[str, str, bool]] = [
    ("zero", "0", True), ("neg", "-1", True), ("one", "1", False), ("two", "2", False), ("str", '"8"', True),
    ("float", "8.5", True), ("float-int", "8.0", True), ("bool", "true", True), ("list", "[1]", True),
    ("dict", "{}", True), ("empty-list", "[]", True), ("null", "null", False), ("e30", "1" + "0" * 30, True),
    ("digits5001", "9" * 5001, True), ("e100", "1e100", True), ("e999", "1e999", True), ("nan", "NaN", True),
    ("inf", "-Infinity", True), ("million", "1000000", False), ("i64", "9223372036854775808", True),
    ("deep-list", "[" * 5000 + "]" * 5000, True), ("deep-dict", '{"a":' * 3000 + "1" + "}" * 3000, True),
    ("long-str", json.dumps("M" * 1_000_000), True),
]


@dataclass
class Case:
    id: str
    kind: str  # config | flags | file
    argv: list[str]
    family: str | None = None
    key: str | None = None
    must_fail: bool = False
    content: bytes | Callable[[], bytes] | None = None  # config.json bytes (or their maker), to <work>/m/config.json
    special: str | None = None  # fifo | devzero | dir | devnull | dangling | huge (replaces content)
    files: dict[str, Any] = field(default_factory=dict)  # extra files: name -> bytes | "fifo" | "dir" | ("link", to)
    ext: str = ""  # file cases: the suffix every name of the case carries


def family_of(cfg: dict[str, Any]) -> str:
    mt = cfg.get("model_type")
    if mt is None and "d_model" in cfg:
        return "mamba2"
    return "dense" if mt in DENSE_TYPES else str(mt)


def bundled() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for p in sorted(CONFIG_DIR.glob("*__*.json")):
        cfg = json.loads(p.read_text())
        out.append((p.stem, {k: v for k, v in cfg.items() if not k.startswith("_")}))
    return out


def _with_raw(cfg: dict[str, Any], key: str, raw: str | None) -> bytes:
    """cfg as JSON with ``key`` set to the raw JSON text ``raw`` (None: key removed)."""
    marker = "\u0000MARK\u0000"
    c = dict(cfg)
    if raw is None:
        c.pop(key, None)
        return json.dumps(c, indent=1).encode()
    c[key] = marker
    return json.dumps(c, indent=1).replace(json.dumps(marker), raw).encode()


def _list_mutations(cfg: dict[str, Any], key: str) -> list[tuple[str, str, bool]]:
    val = cfg[key]
    out: list[tuple[str, str, bool]] = []
    if isinstance(val, list) and val:
        out += [("dicts", json.dumps([{}] * len(val)), True), ("ints", json.dumps([1] * len(val)), True),
                ("short", json.dumps(val[:-1]), True), ("unknown", json.dumps(["nope"] * len(val)), True),
                ("nested", json.dumps([[v] for v in val]), True), ("100k", json.dumps([val[0]] * 100_000), True)]
    if isinstance(val, str) and key == "hybrid_override_pattern":
        out += [("empty", '""', True), ("bad-symbol", json.dumps("X" * len(val)), True),
                ("short", json.dumps(val[:-1]), True), ("1M", json.dumps("M" * 1_000_000), True)]
    if isinstance(val, dict) and key == "ssm_cfg":
        for k, raw in (("d_conv", "1"), ("d_conv", "0"), ("headdim", "0"), ("headdim", '"64"'), ("expand", "1e9"),
                       ("ngroups", "7"), ("layer", "5"), ("d_state", "-1"), ("headdim", "9" * 5001)):
            sub = json.dumps({**val, k: "\u0000M\u0000"}).replace(json.dumps("\u0000M\u0000"), raw)
            out.append((f"ssm_cfg.{k}={raw[:8]}", sub, True))
    return out


def config_cases(seed: int = 0, per_config: int | None = None) -> list[Case]:
    """Key mutations of every bundled config (all for keys the family reads, a sample of the others),
    whole-file mutations, and special files. ``per_config`` caps the key mutations of one config."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for name, cfg in bundled():
        fam = family_of(cfg)
        always = _ALWAYS.get(fam, set())
        mine: list[Case] = []
        for key in sorted(cfg):
            relevant = key in FAMILY_KEYS.get(fam, set())
            vals = VALUES + _list_mutations(cfg, key)
            if not relevant:
                vals = rng.sample(VALUES, 3)
            for vname, raw, bad in vals:
                must = relevant and key in always and (bad or (vname == "one" and key in _CONV))
                mine.append(Case(id=f"{name}:{key}={vname}", kind="config", argv=[], family=fam, key=key,
                                 must_fail=must, content=partial(_with_raw, cfg, key, raw)))
            if relevant:
                mine.append(Case(id=f"{name}:{key}=deleted", kind="config", argv=[], family=fam, key=key,
                                 content=partial(_with_raw, cfg, key, None)))
        if per_config is not None and len(mine) > per_config:
            mine = rng.sample(mine, per_config)
        cases += mine
        text = json.dumps(cfg, indent=1).encode()
        cut = rng.randrange(1, len(text) - 1)
        bad_utf8 = text.replace(b'"', b'"\xff', 1)
        for wname, content, must in (("truncated", text[:cut], True), ("bad-utf8", bad_utf8, True),
                                     ("bom", b"\xef\xbb\xbf" + text, False), ("array", b"[" + text + b"]", True),
                                     ("garbage", text + b"}", True), ("empty", b"", True),
                                     ("latin1", text.replace(b'"', "\"\u00e9".encode("latin-1"), 1), True)):
            cases.append(Case(id=f"{name}:file={wname}", kind="config", argv=[], family=fam, key="MODEL",
                              must_fail=must, content=content))
    fam = "nemotron_h"
    for special in ("fifo", "devzero", "dir", "devnull", "dangling", "huge"):
        cases.append(Case(id=f"special:{special}", kind="config", argv=[], family=fam, key="MODEL", must_fail=True,
                          special=special))
    return cases


_GOOD_CAL = {"schema": "hybridpd-calibration/1", "entries": [
    {"name": "x", "transport": "cuda_ipc/cuda", "memory": "VRAM", "per_descriptor_us": 5.0, "bandwidth_gbps": 400.0,
     "hardware": "h", "software": "s", "measured": "m", "command": "c"}]}


def _cal(**kw: Any) -> bytes:
    e = {**_GOOD_CAL["entries"][0], **kw}  # type: ignore[index]
    return json.dumps({**_GOOD_CAL, "entries": [e]}).encode()


# flag -> [(value, bad)]; "bad" = a value the CLI must refuse with exit 2
FLAG_VALUES: dict[str, list[tuple[str, bool]]] = {
    "--ptp": [("1", False), ("2", False), ("4", False), ("0", True), ("-1", True), ("1025", True), ("65536", True),
              ("9" * 40, True), ("1.5", True), ("x", True)],
    "--dtp": [("1", False), ("2", False), ("8", False), ("1024", False), ("0", True), ("65536", True),
              ("1e3", True), ("9" * 5001, True)],
    "--isl": [("1k,8k", False), ("1000", False), ("1.5k", False), ("infk", True), ("1e99k", True), ("0", True),
              ("-1", True), ("1,,2", True), ("k", True), ("nan", True), ("0.3k", True), ("9" * 30, True),
              (",".join(["8k"] * 100), True), ("99999999999", True), ("1_000", True)],
    "--gpu-memory": [("141GB", False), ("80GiB", False), ("1e999", True), ("141", True), ("1e999GB", True),
                     ("nanGB", True), ("infGB", True), ("-1GB", True), ("", True), ("1,5GB", True), ("0x10GB", True),
                     ("99999999PB", True), ("1e-320GB", False), ("141 GB", False)],
    "--kv-cache-memory": [("10GiB", False), ("10", True), ("1e400B", True)],
    "--weights-memory": [("60GB", False), ("1e999", True)],
    "--block-size": [("16", False), ("128", False), ("0", True), ("-16", True), ("99999999999999", True)],
    "--num-blocks": [("1000", False), ("0", True), ("1000000000000", True)],
    "--max-model-len": [("8192", False), ("0", True), ("1" + "0" * 20, True)],
    "--num-speculative-tokens": [("0", False), ("2", False), ("-1", True), ("1000000000", True)],
    "--gpu-memory-utilization": [("0.9", False), ("nan", True), ("inf", True), ("0", True), ("1.5", True)],
    "--vllm-version": [("0.20", False), ("0.32", False), ("1e99", True), ("x", True), ("", False),
                       ("9" * 5001, True), ("0.32.0.0.0.0", False), ("-1", True)],
    "--calibration": [("CAL:good", False), ("CAL:bw-tiny", True), ("CAL:c-huge", True), ("CAL:nan", True),
                      ("CAL:fifo", True), ("CAL:devzero", True), ("CAL:dir", True), ("CAL:deep", True)],
}
_CAL_FILES: dict[str, Any] = {
    "good": _cal(), "bw-tiny": _cal(bandwidth_gbps=1e-320), "c-huge": _cal(per_descriptor_us=1e308),
    "nan": _cal().replace(b"400.0", b"NaN"), "fifo": "fifo", "devzero": ("link", "/dev/zero"), "dir": "dir",
    "deep": b"[" * 100_000 + b"]" * 100_000,
}
_FLAG_MODELS = ["nano", "granite-tiny", "falcon-h1-0.5b", "llama-3.1-8b", "zamba2-2.7b", "super-fp8"]


def flag_cases(n: int = 600, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    # every bad value once on its own, then random combinations
    singles = [(f, v, b) for f, vals in FLAG_VALUES.items() for v, b in vals]
    combos: list[list[tuple[str, str, bool]]] = [[s] for s in singles]
    while len(combos) < n:
        flags = rng.sample(sorted(FLAG_VALUES), rng.randint(1, 4))
        combos.append([(f, *rng.choice(FLAG_VALUES[f])) for f in flags])
    for i, combo in enumerate(combos[:max(n, len(singles))]):
        argv = ["plan", rng.choice(_FLAG_MODELS), "--json"]
        files: dict[str, Any] = {}
        for f, v, _ in combo:
            if v.startswith("CAL:"):
                files["cal.json"] = _CAL_FILES[v[4:]]
                v = "cal.json"
            argv += [f, v] if not v.startswith("-") else [f"{f}={v}"]
        bad = [f"{f}={v[:12]}" for f, v, b in combo if b]
        cases.append(Case(id=f"flags{i}:{' '.join(argv[1:])[:120]}", kind="flags", argv=argv, must_fail=bool(bad),
                          key=combo[0][0] if bad else None, files=files))
    return cases


def file_cases() -> list[Case]:
    """--plot and serve -o into hostile paths. Checked by ``check_files`` after the run."""
    out = []
    for cmd, flag, ext in ((["plan", "nano", "--json"], "--plot", ".png"),
                           (["serve", "nano", "--emit", "k8s"], "-o", "")):
        def n(name: str, ext: str = ext) -> str:
            return name + ext

        for target, files, must in (("new", {}, False), ("link", {n("real"): b"keep", n("link"): ("link", n("real"))}, False),
                                    ("dev-link", {n("dev"): "chardev", n("dev-link"): ("link", n("dev"))}, True),
                                    ("dangling", {n("dangling"): ("link", n("missing"))}, True),
                                    ("adir", {n("adir"): "dir"}, True), ("nodir/x", {}, True),
                                    ("afifo", {n("afifo"): "fifo"}, True), ("dev", {n("dev"): "chardev"}, True)):
            if cmd[0] == "serve" and target == "adir":
                must = False  # serve -o DIR writes a kustomize directory into an empty directory (by design)
            out.append(Case(id=f"file:{cmd[0]}:{flag}={n(target)}", kind="file", argv=[*cmd, flag, n(target)],
                            must_fail=must, key=flag, files=files, ext=ext))
    return out


def materialize(case: Case, work: Path) -> list[str]:
    """Write the case's files under ``work`` (a fresh directory); returns argv with MODEL resolved."""
    for name, spec in case.files.items():
        p = work / name
        if isinstance(spec, bytes):
            p.write_bytes(spec)
        elif spec == "fifo":
            os.mkfifo(p)
        elif spec == "dir":
            p.mkdir()
        elif spec == "chardev":  # a private null device (never /dev/null: an old build replaced it as root)
            try:
                os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))
            except PermissionError:
                os.mkfifo(p)
        elif isinstance(spec, tuple):
            os.symlink(spec[1], p)
    if case.kind != "config":
        return list(case.argv)
    m = work / "m"
    m.mkdir()
    cfgp = m / "config.json"
    if case.special == "fifo":
        os.mkfifo(cfgp)
    elif case.special == "devzero":
        os.symlink("/dev/zero", cfgp)
    elif case.special == "devnull":
        os.symlink("/dev/null", cfgp)
    elif case.special == "dir":
        cfgp.mkdir()
    elif case.special == "dangling":
        os.symlink(str(work / "nothere.json"), cfgp)
    elif case.special == "huge":
        with open(cfgp, "wb") as f:
            f.write(b'{"model_type": "nemotron_h", "pad": "')
            f.truncate(64 << 20)  # sparse: 64 MiB of NULs inside a string
    else:
        assert case.content is not None
        cfgp.write_bytes(case.content() if callable(case.content) else case.content)
    return ["plan", str(m), "--json", "--ptp", "1", "--dtp", "2"]


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def strict_json(text: str) -> bool:
    def bad(name: str) -> Any:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=bad)
    except ValueError:
        return False
    return True


def classify(case: Case, code: int | None, out: str, err: str, *, exc: str | None = None,
             seconds: float = 0.0, limit_s: float = 2.0) -> str:
    """One outcome: ok | refused | traceback | hang | memory | bad-json | accepted-bad | wrong-field | not-one-line."""
    if exc == "timeout" or seconds > limit_s:
        return "hang"
    if exc is not None:
        return "memory" if "MemoryError" in exc else "traceback"
    if "Traceback" in err:
        return "traceback"
    if code in (0, 1):  # ran (plan exits 1 for a combination vLLM refuses)
        if (case.kind == "config" or "--json" in case.argv) and out.strip() and not strict_json(out):
            return "bad-json"
        return "accepted-bad" if case.must_fail else "ok"
    if code != 2:
        return f"exit-{code}"
    if case.kind == "file" and not case.must_fail:
        return "refused-good"  # a new file, a link to a regular file, an empty directory for serve: must be written
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("Error:")]
    if len(lines) != 1:
        return "not-one-line"
    msg = lines[0]
    if case.kind == "config" and case.key != "MODEL":
        fam_keys = FAMILY_KEYS.get(case.family or "", set())
        words = {w.rstrip(".") for w in _WORD.findall(msg)}
        foreign = (words & ALL_KEYS) - fam_keys - {"MODEL", case.key}
        if foreign:
            return "wrong-field"
        if case.key not in words and not (words & fam_keys):
            return "wrong-field"
    elif case.kind == "config":
        if "MODEL" not in msg:
            return "wrong-field"
    return "refused"


def check_files(case: Case, work: Path, code: int | None) -> str | None:
    """Side effects of a file case: None when clean, else what went wrong."""
    left = [p.name for p in work.rglob(".hybridpd-*")]
    if left:
        return f"temp files left: {left}"
    target = case.argv[-1].removesuffix(case.ext) if case.ext else case.argv[-1]

    def p(name: str) -> Path:
        return work / (name + case.ext)

    if target == "link":
        if not p("link").is_symlink():
            return "symlink replaced"
        if code in (0, 1) and p("real").read_bytes() == b"keep":
            return "symlink target not written"
    if target == "dev-link" and not p("dev-link").is_symlink():
        return "symlink replaced"
    if p("dev").name in case.files and stat.S_ISREG(os.lstat(p("dev")).st_mode):
        return "device replaced"
    if target == "afifo" and not stat.S_ISFIFO(os.lstat(p("afifo")).st_mode):
        return "fifo replaced"
    if target == "adir" and not p("adir").is_dir() and case.argv[0] != "serve":
        return "directory replaced"
    if target == "dangling" and p("missing").exists():
        return "wrote through a dangling link"
    if target == "new" and code in (0, 1):
        mode = stat.S_IMODE(os.stat(p("new")).st_mode)
        mask = os.umask(0)
        os.umask(mask)
        if mode != 0o666 & ~mask:
            return f"mode {oct(mode)} is not 0666 & ~umask"
    if not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        return "/dev/null replaced"
    return None


def summarize(outcomes: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: (-kv[1], kv[0])))


class CaseTimeout(BaseException):
    """Raised by the interval timer inside a case (BaseException: no `except Exception` in the code swallows it)."""


def run_inprocess(argv: list[str], *, limit_s: float | None = None) -> tuple[int | None, str, str, str | None]:
    """Run the CLI in this process: (exit code, stdout, stderr, traceback text or 'timeout' or None)."""
    import contextlib
    import io
    import signal
    import traceback

    from hybridpd_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code: int | None = 0
    exc: str | None = None

    def _alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, _alarm) if limit_s else None
    try:
        if limit_s:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except CaseTimeout:
        exc = "timeout"
    except BaseException:  # noqa: BLE001 - every escape is a finding
        exc = traceback.format_exc()
    finally:
        if limit_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return code, out.getvalue(), err.getvalue(), exc
