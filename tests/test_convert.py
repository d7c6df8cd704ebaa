"""hybridpd.convert.run on real safetensors files: layouts, TP split/merge, recognition, errors, safety."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_convert_support import (
    DTYPES,
    GRANITE,
    NEMOH,
    bits,
    conv_ds,
    data_crc,
    data_sha,
    data_xxh3,
    file_sha,
    geo,
    header,
    load,
    meta,
    rand,
    reference_shard,
    reference_ssm,
    same_bits,
    save,
)

from hybridpd.convert.files import AtomicFile, Writer
from hybridpd.convert.header import read_header
from hybridpd.convert.run import ConvertOptions, check, convert
from hybridpd.errors import ExternalToolError, HybridPDError, UsageError

# TP1 conv dim of the tiny models: 256 x channels + 2 * n_groups * 16 (B, C); state_len 3.
NEMOH_DIM, GRANITE_DIM, L = 256 + 2 * 2 * 16, 256 + 2 * 16, 3


def state_file(path: Path, *, dim: int = NEMOH_DIM, layout: str = "SD", dtype: torch.dtype = torch.bfloat16,
               meta_: dict[str, str] | None = None, heads: int = 8) -> dict[str, torch.Tensor]:
    """A snapshot as an engine might dump it: batched and per-layer conv states, an SSM state, bookkeeping."""
    def conv(lead: tuple[int, ...], seed: int) -> torch.Tensor:
        shape = (*lead, L, dim) if layout == "SD" else (*lead, dim, L)
        return rand(shape, dtype, seed)

    t = {"model.layers.0.mixer.conv_state": conv((6,), 1),  # (blocks, ...) batched
         "model.layers.2.mixer.conv_state": conv((), 2),  # one layer, one request
         "stacked_conv_states": conv((2, 3), 3),  # (layers, blocks, ...)
         "model.layers.0.mixer.ssm_state": rand((6, heads, 32, 16), torch.float32, 4),
         "block_ids": torch.arange(6, dtype=torch.int64)}
    save(path, t, meta_ if meta_ is not None else {"engine": "vllm", "step": "17"})
    return t


# --- safetensors I/O ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [*DTYPES, torch.int64, torch.uint8, torch.bool, torch.float64])
def test_writer_output_loads_with_safetensors(tmp_path: Path, dtype: torch.dtype) -> None:
    t = rand((3, 5, 7), dtype) if dtype != torch.bool else torch.rand(3, 5, 7) > 0.5
    dt = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float64: "F64"}[dtype]
    nb = t.numel() * t.element_size()
    w = Writer(AtomicFile(tmp_path / "w.safetensors", force=False), [("a", dt, t.shape, nb), ("b", "U8", (0,), 0)],
               {"k": "v"}, checksum="sha256")
    w.begin("a")
    w.write(memoryview(bits(t).numpy()))
    w.begin("b")
    w.finish({})
    got = load_file(str(tmp_path / "w.safetensors"))
    assert same_bits(got["a"], t) and got["b"].numel() == 0
    assert meta(tmp_path / "w.safetensors") == {"k": "v"}
    (n,) = struct.unpack("<Q", (tmp_path / "w.safetensors").read_bytes()[:8])
    assert (8 + n) % 8 == 0  # data section aligned like safetensors' own writer


@pytest.mark.parametrize("mode", ["direct-small-stage", "buffered", "einval-fallback"])
def test_output_paths_write_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """O_DIRECT staging (flushed many times), plain buffered writes and the fallback all agree."""
    src = tmp_path / "a.safetensors"
    state_file(src, dim=GRANITE_DIM)
    convert(src, tmp_path / "ref", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    monkeypatch.setattr(AtomicFile, "STAGE", 8192)
    if mode == "buffered":
        monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)
        monkeypatch.delattr(os, "O_DIRECT")
    if mode == "einval-fallback":
        real = os.pwrite
        direct_fds: set[int] = set()
        refused: list[int] = []

        def pwrite(fd: int, data: object, offset: int) -> int:
            if fd in direct_fds:
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data, offset)  # type: ignore[arg-type]

        real_open = os.open

        def open_(path: object, flags: int, *a: object) -> int:
            fd = real_open(path, flags, *a)  # type: ignore[arg-type]
            if flags & getattr(os, "O_DIRECT", 0):
                direct_fds.add(fd)
            return fd

        real_close = os.close

        def close(fd: int) -> None:
            direct_fds.discard(fd)
            real_close(fd)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "close", close)
    convert(src, tmp_path / "out", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    for r in range(2):
        name = f"a.rank{r}-of-2.safetensors"
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    convert(tmp_path / "out", tmp_path / "m.safetensors", ConvertOptions(to="SD", tp_merge=True))
    assert data_sha(tmp_path / "m.safetensors") == data_sha(src)
    if mode == "einval-fallback":
        assert refused  # O_DIRECT was tried, refused, and the writer fell back


def test_disk_full_is_a_clean_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)

    def full(*a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(HybridPDError, match="No space left") as e:
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert e.value.exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no output, no temporary


def test_disk_full_on_a_later_shard_says_which_shards_were_written(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd.convert.files import Writer

    src = tmp_path / "a.safetensors"
    state_file(src, dim=GRANITE_DIM)
    real = Writer.finish
    calls = []

    def finish(self: Writer, patch: dict[str, str]) -> str | None:
        calls.append(self)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, patch)

    monkeypatch.setattr(Writer, "finish", finish)
    with pytest.raises(HybridPDError, match="No space left") as e:
        convert(src, tmp_path / "out", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    written = sorted(p for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))
    assert len(written) == 1 and str(written[0]) in str(e.value) and "nothing else was written" in str(e.value)
    assert "nothing was written under OUTPUT" not in str(e.value)
    assert not list((tmp_path / "out").glob(".hybridpd-*"))


def test_tp_split_into_an_uncreatable_directory_is_a_usage_error(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # as root a read-only parent does not refuse mkdir, so the refusal is simulated where it happens
    src = tmp_path / "a.safetensors"
    state_file(src, dim=GRANITE_DIM)

    def refuse(self: Path, *a: object, **kw: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(UsageError, match="cannot create directory .*Permission denied") as e:
        convert(src, tmp_path / "ro" / "out", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    assert e.value.exit_code == 2 and "nothing was written" in str(e.value)


def test_read_header_rejects_corrupt_files(tmp_path: Path) -> None:
    good = tmp_path / "g.safetensors"
    save(good, {"a": torch.zeros(4, 4)})
    raw = good.read_bytes()
    for name, data, what in [("short", raw[:5], "bytes long"), ("trunc", raw[:-3], "truncated"),
                             ("json", struct.pack("<Q", 4) + b"{no}" + raw[8:], "not JSON")]:
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(UsageError, match=what):
            read_header(p)


# --- SD <-> DS ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_sd_to_ds_with_model(tmp_path: Path, dtype: torch.dtype) -> None:
    src = tmp_path / "sd.safetensors"
    t = state_file(src, dtype=dtype)
    before = file_sha(src)
    s = convert(src, tmp_path / "ds.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert file_sha(src) == before  # input untouched
    out = load(tmp_path / "ds.safetensors")
    for k in ("model.layers.0.mixer.conv_state", "model.layers.2.mixer.conv_state", "stacked_conv_states"):
        assert same_bits(out[k], t[k].transpose(-1, -2).contiguous()), k
    for k in ("model.layers.0.mixer.ssm_state", "block_ids"):
        assert same_bits(out[k], t[k]), k
    m = meta(tmp_path / "ds.safetensors")
    assert m["engine"] == "vllm" and m["step"] == "17"  # metadata preserved
    assert m["hybridpd.conv_layout"] == "DS" and m["hybridpd.tp_size"] == "1" and m["hybridpd.state_len"] == "3"
    assert json.loads(m["hybridpd.conv_tensors"]) == ["model.layers.0.mixer.conv_state",
                                                      "model.layers.2.mixer.conv_state", "stacked_conv_states"]
    assert json.loads(m["hybridpd.ssm_tensors"]) == ["model.layers.0.mixer.ssm_state"]
    assert m["hybridpd.source_checksum"] == "xxh3:" + data_xxh3(src)  # the default checksum
    d = s.to_dict()
    assert d["tensors_converted"] == 3 and d["conv_tensors"] == 3 and d["ssm_tensors"] == 1
    assert d["layout_before"] == ["SD"] and d["layout_after"] == "DS"
    assert d["checksums"] == {str(src): "xxh3:" + data_xxh3(src),
                              str(tmp_path / "ds.safetensors"): "xxh3:" + data_xxh3(tmp_path / "ds.safetensors")}
    assert d["bytes_read"] == read_header(src).data_bytes


@pytest.mark.parametrize("algo", ["xxh3", "crc32", "sha256", "none"])
def test_checksum_algorithms(tmp_path: Path, algo: str) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    out = tmp_path / "o.safetensors"
    d = convert(src, out, ConvertOptions(to="DS", geometry=geo(NEMOH), checksum=algo)).to_dict()
    want = {"crc32": lambda p: "crc32:" + data_crc(p), "sha256": lambda p: "sha256:" + data_sha(p),
            "xxh3": lambda p: "xxh3:" + data_xxh3(p)}.get(algo)
    if want is None:
        assert d["checksums"] == {} and "hybridpd.source_checksum" not in meta(out)
    else:
        assert d["checksums"] == {str(src): want(src), str(out): want(out)}
        assert meta(out)["hybridpd.source_checksum"] == want(src)
    with pytest.raises(UsageError, match="xxh3, crc32, sha256 or none"):
        convert(src, tmp_path / "x.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH), checksum="md5"))


def test_round_trip_is_bit_identical_and_reuses_recorded_metadata(tmp_path: Path) -> None:
    src = tmp_path / "sd.safetensors"
    t = state_file(src, meta_={})
    convert(src, tmp_path / "ds.safetensors", ConvertOptions(to="DS", from_layout="SD"))  # no model: --from
    convert(tmp_path / "ds.safetensors", tmp_path / "back.safetensors", ConvertOptions(to="SD"))  # metadata says DS
    back = load(tmp_path / "back.safetensors")
    assert all(same_bits(back[k], t[k]) for k in t)
    assert data_sha(tmp_path / "back.safetensors") == data_sha(src)


def test_already_in_target_layout_is_copied(tmp_path: Path) -> None:
    src = tmp_path / "ds.safetensors"
    state_file(src, layout="DS")
    s = convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH))).to_dict()
    assert s["tensors_converted"] == 0
    assert {t["action"] for t in s["tensors"] if t["kind"] == "conv"} == {"unchanged"}
    assert data_sha(tmp_path / "o.safetensors") == data_sha(src)


def test_without_model_the_layout_must_be_told(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    save(src, {"conv": rand((4, 3, 40), torch.float16)})
    with pytest.raises(UsageError, match=r"SD .* or DS") as e:
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS"))
    assert e.value.exit_code == 2 and "--from" in str(e.value)
    assert not (tmp_path / "o.safetensors").exists()
    convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", from_layout="sd"))
    assert load(tmp_path / "o.safetensors")["conv"].shape == (4, 40, 3)


def test_square_states_are_refused_without_a_hint(tmp_path: Path) -> None:
    src = tmp_path / "sq.safetensors"
    x = rand((2, 5, 5), torch.bfloat16)
    save(src, {"conv_state": x})
    with pytest.raises(UsageError, match="square"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS"))
    with pytest.raises(UsageError, match="square"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", from_layout="SD"))  # told: fine
    assert same_bits(load(tmp_path / "o.safetensors")["conv_state"], x.transpose(1, 2).contiguous())


def test_dim_that_does_not_fit_the_model_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    save(src, {"conv_state": rand((3, NEMOH_DIM + 8), torch.bfloat16)})
    with pytest.raises(UsageError, match="does not match") as e:
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert "conv dim per rank 320 (TP 1), 160 (TP 2)" in str(e.value)


def test_speculative_tokens_change_state_len(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    save(src, {"conv_state": rand((5, NEMOH_DIM), torch.bfloat16)})  # K-1+2 = 5
    with pytest.raises(UsageError, match="--num-speculative-tokens 2"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH, num_spec=2)))
    assert meta(tmp_path / "o.safetensors")["hybridpd.state_len"] == "5"


def test_from_that_contradicts_the_shape_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    save(src, {"conv_state": rand((3, NEMOH_DIM), torch.bfloat16)})
    with pytest.raises(UsageError, match="lies SD"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="SD", from_layout="DS", geometry=geo(NEMOH)))


def test_model_recognises_conv_states_by_shape_and_pattern_selects(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    t = {"layer3.state_a": rand((2, L, NEMOH_DIM), torch.bfloat16), "other": rand((L, 7), torch.bfloat16)}
    save(src, t)
    s = convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH))).to_dict()
    rows = {r["name"]: r for r in s["tensors"]}
    assert rows["layer3.state_a"]["recognised_by"] == "shape" and rows["layer3.state_a"]["action"] == "transposed"
    assert rows["other"]["kind"] == "other"
    s = convert(src, tmp_path / "p.safetensors", ConvertOptions(to="DS", pattern=r"^other$", from_layout="SD"))
    assert {r["name"]: r["action"] for r in s.to_dict()["tensors"]} == {"layer3.state_a": "copied",
                                                                        "other": "transposed"}


def test_no_conv_state_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    save(src, {"weights": torch.zeros(3, 4), "conv_state_indices": torch.zeros(4, dtype=torch.int32)})
    with pytest.raises(UsageError, match="no conv"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", from_layout="SD"))


def test_refuses_to_overwrite_and_never_writes_its_input(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(UsageError, match="--force"):
        convert(src, out, ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert out.read_bytes() == b"precious"
    convert(src, out, ConvertOptions(to="DS", geometry=geo(NEMOH), force=True))
    assert meta(out)["hybridpd.conv_layout"] == "DS"
    for target in (src, tmp_path / "." / "a.safetensors"):
        with pytest.raises(UsageError, match="is the INPUT"):
            convert(src, target, ConvertOptions(to="DS", geometry=geo(NEMOH), force=True))
    assert not list(tmp_path.glob(".hybridpd-*"))


def test_stale_temporaries_of_dead_processes_are_swept(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    legacy = tmp_path / ".o.safetensors.999999999.0123abcd.hybridpd-tmp"  # the naming before fsutil's scheme
    stale = tmp_path / ".hybridpd-o.safetensors.999999999.0123abcd.tmp"
    live = tmp_path / f".hybridpd-o.safetensors.{os.getppid()}.0123abcd.tmp"  # a live writer's: kept
    other = tmp_path / ".hybridpd-p.safetensors.999999999.0123abcd.tmp"  # another target's: kept
    for p in (legacy, stale, live, other):
        p.write_bytes(b"partial")
    convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert not legacy.exists() and not stale.exists() and live.exists() and other.exists()


def test_an_output_name_near_name_max_converts_and_sweeps(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    out = tmp_path / ("é" * 115 + ".safetensors")  # 242 bytes: a temporary carrying all of it would not fit
    stale = tmp_path / f".hybridpd-{'é' * 80}.999999999.0123abcd.tmp"  # the first 160 bytes of the name
    stale.write_bytes(b"partial")
    convert(src, out, ConvertOptions(to="DS", geometry=geo(NEMOH)))
    assert meta(out)["hybridpd.conv_layout"] == "DS"
    assert not list(tmp_path.glob(".hybridpd-*"))


def test_directory_in_directory_out(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    a = state_file(tmp_path / "in" / "a.safetensors")
    state_file(tmp_path / "in" / "b.safetensors", layout="DS")
    s = convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to="DS", geometry=geo(NEMOH))).to_dict()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.safetensors", "b.safetensors"]
    assert s["layout_before"] == ["DS", "SD"] and len(s["outputs"]) == 2
    got = load(tmp_path / "out" / "a.safetensors")
    assert same_bits(got["stacked_conv_states"], a["stacked_conv_states"].transpose(-1, -2).contiguous())


def test_output_that_names_a_file_for_many_outputs_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    state_file(tmp_path / "in" / "a.safetensors")
    with pytest.raises(UsageError, match="names a file"):
        convert(tmp_path / "in", tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    with pytest.raises(UsageError, match="names one file"):
        convert(tmp_path / "in" / "a.safetensors", tmp_path / "o.safetensors",
                ConvertOptions(to="DS", geometry=geo(NEMOH), tp_split=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_small_chunks_stream_the_same_bytes(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src, dtype=torch.float8_e5m2)
    for chunk in (1, 999, 1 << 20):
        convert(src, tmp_path / f"o{chunk}.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH),
                                                                       chunk_bytes=chunk))
        convert(src, tmp_path / f"s{chunk}", ConvertOptions(to="DS", geometry=geo(NEMOH), tp_split=2,
                                                          chunk_bytes=chunk))
    assert len({data_sha(tmp_path / f"o{c}.safetensors") for c in (1, 999, 1 << 20)}) == 1
    assert len({data_sha(tmp_path / f"s{c}" / "a.rank1-of-2.safetensors") for c in (1, 999, 1 << 20)}) == 1
    convert(tmp_path / "s999", tmp_path / "m.safetensors", ConvertOptions(to="SD", tp_merge=True, chunk_bytes=777))
    assert data_sha(tmp_path / "m.safetensors") == data_sha(src)


# --- TP split / merge ---------------------------------------------------------------------------

@pytest.mark.parametrize(("dims", "dim", "tp"), [(NEMOH, NEMOH_DIM, 2), (GRANITE, GRANITE_DIM, 2),
                                                 (GRANITE, GRANITE_DIM, 4), (GRANITE, GRANITE_DIM, 8)])
@pytest.mark.parametrize("to", ["DS", "SD"])
def test_split_matches_vllm_sharding_and_merge_inverts_it(tmp_path: Path, dims: object, dim: int, tp: int,
                                                          to: str) -> None:
    src = tmp_path / "full.safetensors"
    t = state_file(src, dim=dim)
    opts = ConvertOptions(to=to, geometry=geo(dims), tp_split=tp)  # type: ignore[arg-type]
    s = convert(src, tmp_path / "shards", opts).to_dict()
    assert [o["tp_rank"] for o in s["outputs"]] == list(range(tp)) and {o["tp_size"] for o in s["outputs"]} == {tp}
    for r in range(tp):
        shard = load(tmp_path / "shards" / f"full.rank{r}-of-{tp}.safetensors")
        for k in ("model.layers.0.mixer.conv_state", "model.layers.2.mixer.conv_state", "stacked_conv_states"):
            want = reference_shard(conv_ds(t[k], "SD"), dims, tp, r)  # type: ignore[arg-type]
            assert same_bits(conv_ds(shard[k], to), want), (k, r)
        assert same_bits(shard["model.layers.0.mixer.ssm_state"], reference_ssm(t["model.layers.0.mixer.ssm_state"],
                                                                                tp, r))
        assert same_bits(shard["block_ids"], t["block_ids"])
        m = meta(tmp_path / "shards" / f"full.rank{r}-of-{tp}.safetensors")
        assert (m["hybridpd.tp_rank"], m["hybridpd.tp_size"], m["hybridpd.conv_layout"]) == (str(r), str(tp), to)
    # merge needs no --model: the shards record the dims
    convert(tmp_path / "shards", tmp_path / "merged.safetensors", ConvertOptions(to="SD", tp_merge=True))
    merged = load(tmp_path / "merged.safetensors")
    assert all(same_bits(merged[k], t[k]) for k in t)
    assert check(src, tmp_path / "shards", ConvertOptions()).ok


def test_granite_tp2_shard_is_x_half_plus_replicated_group(tmp_path: Path) -> None:
    """Spelled out: n_groups=1 at TP 2 -> rank r holds x[r*128:(r+1)*128] | B(group 0) | C(group 0)."""
    src = tmp_path / "full.safetensors"
    full = rand((L, GRANITE_DIM), torch.bfloat16)
    save(src, {"conv_state": full})
    convert(src, tmp_path / "s", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    ds = full.T
    for r in range(2):
        shard = load(tmp_path / "s" / f"full.rank{r}-of-2.safetensors")["conv_state"]
        assert shard.shape == (128 + 16 + 16, L)
        assert same_bits(shard, torch.cat([ds[r * 128:(r + 1) * 128], ds[256:272], ds[272:288]]))


def test_merge_refuses_replicas_that_disagree(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    state_file(src, dim=GRANITE_DIM)
    convert(src, tmp_path / "s", ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=2))
    p1 = tmp_path / "s" / "full.rank1-of-2.safetensors"
    t = load(p1)
    t["model.layers.2.mixer.conv_state"].view(torch.int16)[128 + 3, 1] ^= 1  # B channel 3 of the replicated group
    save(p1, t, meta(p1))
    with pytest.raises(UsageError, match="replicated B/C group"):
        convert(tmp_path / "s", tmp_path / "m.safetensors", ConvertOptions(to="SD", tp_merge=True))
    assert not (tmp_path / "m.safetensors").exists()
    assert not list(tmp_path.glob(".hybridpd-*"))


def test_merge_refuses_unrecognised_tensors_that_differ(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    state_file(src)
    convert(src, tmp_path / "s", ConvertOptions(to="DS", geometry=geo(NEMOH), tp_split=2))
    p1 = tmp_path / "s" / "full.rank1-of-2.safetensors"
    t = load(p1)
    t["block_ids"][2] = 99
    save(p1, t, meta(p1))
    with pytest.raises(UsageError, match="identical on every rank"):
        convert(tmp_path / "s", tmp_path / "m.safetensors", ConvertOptions(to="SD", tp_merge=True))


def test_split_needs_the_model_and_a_valid_tp(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    state_file(src)
    with pytest.raises(UsageError, match="--model"):
        convert(src, tmp_path / "s", ConvertOptions(to="DS", from_layout="SD", tp_split=2))
    with pytest.raises(UsageError, match="valid TP sizes: 2"):  # n_groups 2: TP 4 is not shardable
        convert(src, tmp_path / "s", ConvertOptions(to="DS", geometry=geo(NEMOH), tp_split=4))
    convert(src, tmp_path / "s", ConvertOptions(to="DS", geometry=geo(NEMOH), tp_split=2))
    with pytest.raises(UsageError, match="full \\(TP 1\\) state"):
        convert(tmp_path / "s" / "full.rank0-of-2.safetensors", tmp_path / "t", ConvertOptions(to="DS", tp_split=2))


def test_rank_templates(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    t = state_file(src)
    convert(src, str(tmp_path / "r{rank}of{tp}.safetensors"), ConvertOptions(to="DS", geometry=geo(NEMOH),
                                                                              tp_split=2))
    assert (tmp_path / "r1of2.safetensors").exists()
    for i, template in enumerate(("r{rank}of2.safetensors", "r{rank}of{tp}.safetensors")):
        convert(str(tmp_path / template), tmp_path / f"m{i}.safetensors", ConvertOptions(to="SD", tp_merge=True))
        assert all(same_bits(load(tmp_path / f"m{i}.safetensors")[k], t[k]) for k in t)
    with pytest.raises(UsageError, match="no complete shard set"):
        convert(str(tmp_path / "r{rank}of3.safetensors"), tmp_path / "x.safetensors",
                ConvertOptions(to="SD", tp_merge=True))


# --- check --------------------------------------------------------------------------------------

def test_check_reports_the_first_mismatch(tmp_path: Path) -> None:
    src = tmp_path / "sd.safetensors"
    state_file(src)
    ds = tmp_path / "ds.safetensors"
    convert(src, ds, ConvertOptions(to="DS", geometry=geo(NEMOH)))
    r = check(src, ds, ConvertOptions(to="DS"))
    assert r.ok and r.pairs[0]["layout_compared"] == ["DS"]
    assert check(ds, src, ConvertOptions()).ok  # either direction
    t = load(ds)
    t["stacked_conv_states"][1, 2, 77, 1] = 5.0
    save(ds, t, meta(ds))
    r = check(src, ds, ConvertOptions())
    assert not r.ok and r.mismatch is not None
    assert (r.mismatch["tensor"], r.mismatch["index"]) == ("stacked_conv_states", [1, 2, 77, 1])
    assert r.mismatch["actual"] == 5.0
    r = check(src, ds, ConvertOptions(to="SD"))
    assert not r.ok and "--to asks for SD" in r.mismatch["reason"]  # type: ignore[index]


def test_check_shards_and_structure(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    state_file(src, dim=GRANITE_DIM)
    convert(src, tmp_path / "s", ConvertOptions(to="SD", geometry=geo(GRANITE), tp_split=4))
    assert check(src, tmp_path / "s", ConvertOptions()).ok
    assert check(tmp_path / "s", src, ConvertOptions()).ok
    p2 = tmp_path / "s" / "full.rank2-of-4.safetensors"
    t = load(p2)
    t["model.layers.0.mixer.ssm_state"][0, 1, 2, 3] = 1.5
    save(p2, t, meta(p2))
    r = check(src, tmp_path / "s", ConvertOptions())
    assert r.mismatch is not None and r.mismatch["file"] == str(p2)
    assert (r.mismatch["tensor"], r.mismatch["index"]) == ("model.layers.0.mixer.ssm_state", [0, 1, 2, 3])
    del t["block_ids"]
    save(p2, t, meta(p2))
    r = check(src, tmp_path / "s", ConvertOptions())
    assert r.mismatch is not None and r.mismatch["reason"] == "missing from the compared file"


def test_header_order_follows_the_input(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH)))
    h_in, h_out = header(src), header(tmp_path / "o.safetensors")
    offsets = {k: v["data_offsets"] for k, v in h_in.items() if k != "__metadata__"}
    assert offsets == {k: v["data_offsets"] for k, v in h_out.items() if k != "__metadata__"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src)
    with pytest.raises(ExternalToolError, match="no CUDA device"):
        convert(src, tmp_path / "o.safetensors", ConvertOptions(to="DS", geometry=geo(NEMOH), device="cuda"))
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_cuda_gives_the_cpu_bytes(tmp_path: Path) -> None:
    src = tmp_path / "a.safetensors"
    state_file(src, dim=GRANITE_DIM)
    for dev in ("cpu", "cuda"):
        convert(src, tmp_path / dev, ConvertOptions(to="DS", geometry=geo(GRANITE), tp_split=4, device=dev))
        convert(tmp_path / dev, tmp_path / f"{dev}.safetensors", ConvertOptions(to="SD", tp_merge=True, device=dev))
    for r in range(4):
        name = f"a.rank{r}-of-4.safetensors"
        assert data_sha(tmp_path / "cpu" / name) == data_sha(tmp_path / "cuda" / name)
    assert data_sha(tmp_path / "cuda.safetensors") == data_sha(src)


def test_os_environ_untouched() -> None:
    assert "HYBRIDPD_TEST_SLOW_WRITE" not in os.environ
