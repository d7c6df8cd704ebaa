"""The P/D proxy against hostile or broken clients and backends (issue 13), and the proxy-side parts of issue 12
(/health after a backend dies, timeouts from the CLI, expired KV leases). Each test failed on the proxy before
these fixes; the comment on each says how."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from proxy_fakes import (
    FakeDecode,
    FakePrefill,
    Harness,
    KVLedger,
    eventually,
    harness,
    parse_sse,
    proxy_cli,
    run,
    start_server,
    unused_port,
)

from hybridpd.launch.proxy import (
    ProxyError,
    SSEFramer,
    decode_request,
    fields_to_restore,
    prefill_request,
    validate_client_request,
)
from hybridpd.launch.proxy.guard import GUARD_SUPPORTED
from hybridpd.launch.proxy.protocol import SSEError

COMPLETION: dict[str, Any] = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 5}


def error_of(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    return err


async def raw_post(h: Harness, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with h.client.post(h.url + "/v1/completions", data=data,
                             headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.read()


async def open_raw(h: Harness) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(h.url)
    assert parts.hostname is not None and parts.port is not None
    return await asyncio.open_connection(parts.hostname, parts.port)


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded: a hang fails the test)."""
    data = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), timeout):
            data += chunk
    except ConnectionResetError:
        pass
    return data


# ----------------------------------------------------------------------------- client input never yields 5xx


@pytest.mark.parametrize(
    ("name", "data", "headers", "code"),
    [
        # old: UnicodeEncodeError while re-encoding the body for P -> 500 with a traceback in the log
        ("lone surrogate", b'{"model": "m", "prompt": "\\ud800", "max_tokens": 2}', {}, "invalid_unicode"),
        # old: RecursionError in json.loads -> 500
        ("deep array", b"[" * 100_000 + b"]" * 100_000, {}, "invalid_json"),
        ("deep field", b'{"model": "m", "prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", {},
         "invalid_json"),
        ("non-finite number", b'{"model": "m", "prompt": "x", "max_tokens": Infinity}', {}, "invalid_type"),
        # old: ContentEncodingError from aiohttp's decompressor -> 500
        ("gzip header on a plain body", b'{"model": "m", "prompt": "x"}', {"Content-Encoding": "gzip"},
         "invalid_body_encoding"),
    ],
)
def test_malformed_client_input_is_400_without_a_traceback(
    name: str, data: bytes, headers: dict[str, str], code: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        async with harness() as h:
            status, raw = await raw_post(h, data, headers)
            assert status == 400, (name, raw)
            assert error_of(raw)["code"] == code
            assert h.p.received == [] and h.d.received == []
            # a real gzip body is still fine
            status, raw = await raw_post(h, gzip.compress(json.dumps(COMPLETION).encode()),
                                         {"Content-Encoding": "gzip"})
            assert status == 200, raw

    with caplog.at_level(logging.ERROR, logger="hybridpd.launch.proxy"):
        run(go())
    assert not [r for r in caplog.records if r.exc_info], "a client input logged a traceback"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "five"}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 2.5}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "min_tokens": 9}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {**COMPLETION, "stream": True, "stream_options": "yes"}, "stream_options"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": -1, "max_tokens": 4}, "max_completion_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_decode_would_refuse_is_refused_before_prefill(path: str, body: dict[str, Any], param: str) -> None:
    """Old: P prefilled (and pinned KV blocks for) requests whose decode-only fields D then rejected."""

    async def go() -> None:
        async with harness() as h:
            status, _, raw = await h.post(path, body)
            assert status == 400 and error_of(raw)["param"] == param, raw
            assert h.p.received == [], "P was asked to prefill a request decode refuses"

    run(go())


def test_requests_decode_accepts_still_pass_validation() -> None:
    async def go() -> None:
        async with harness() as h:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for path, body in [
                ("/v1/completions", {**COMPLETION, "max_tokens": 5, "min_tokens": 5}),
                ("/v1/completions", {**COMPLETION, "max_tokens": 3.0}),
                ("/v1/completions", {**COMPLETION, "stream_options": None}),
                ("/v1/chat/completions", {**chat, "max_completion_tokens": 0, "max_tokens": 3}),  # vLLM: 0 or 3
            ]:
                status, _, raw = await h.post(path, body)
                assert status == 200, (body, raw)

    run(go())


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(), max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)
_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "min_completion_tokens", "stream", "stream_options",
           "n", "best_of", "use_beam_search", "echo", "prompt", "messages", "prompt_embeds")


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6) | _JSON,
       route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_any_json_body_is_accepted_or_refused_with_400_never_crashes(body: Any, route: str) -> None:
    """Whatever JSON arrives, the pure request path either builds both legs or refuses with a 400 ProxyError.
    (It found that a first version of the decode-only checks crashed on ``max_tokens: Infinity`` / ``NaN``,
    which Python's json accepts: OverflowError / ValueError -> 500.)"""
    try:
        checked = validate_client_request(body, route)
    except ProxyError as exc:
        assert exc.status == 400 and exc.code
        return
    prefill_request(checked)
    decode_request(checked, {"remote_block_ids": [[1]]}, fields_to_restore(checked))


# ----------------------------------------------------------------------------- connection-level limits


def test_slowloris_headers_are_cut_at_header_timeout() -> None:
    """Old: aiohttp's AppRunner keeps a connection trickling its request line for its keep-alive (3630 s)."""
    assert GUARD_SUPPORTED, "aiohttp's RequestHandler lost the fields the connection guard reads"

    async def go() -> None:
        async with harness(header_timeout_s=0.5, idle_timeout_s=30.0) as h:
            reader, writer = await open_raw(h)

            async def trickle() -> None:
                for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.05)

            task = asyncio.ensure_future(trickle())
            try:
                assert await closed_by_server(reader) == b""
            finally:
                task.cancel()
                writer.close()
            assert h.state.metrics.registry.get_sample_value(
                "hybridpd_proxy_client_connections_closed_total", {"reason": "header_timeout"}) == 1
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200

    run(go())


def test_declared_body_never_sent_is_408() -> None:
    """Old: the handler waited for the body forever (500 such connections held 1,004 tasks for 45 s)."""

    async def go() -> None:
        async with harness(body_timeout_s=0.5) as h:
            reader, writer = await open_raw(h)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")
            answer = await closed_by_server(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            assert error_of(answer.split(b"\r\n\r\n", 1)[1])["code"] == "body_timeout"

    run(go())


def test_idle_connections_are_closed_and_evicted_at_the_cap() -> None:
    """Old: no cap and no idle limit; past the fd limit, normal requests timed out behind idle sockets."""

    async def go() -> None:
        async with harness(idle_timeout_s=30.0, max_connections=4) as h:
            idle = [await open_raw(h) for _ in range(6)]  # more than the cap, none sends anything
            # the client session's request is one more connection: it evicts the longest-idle one, never waits
            status, _, _ = await h.post("/v1/completions", COMPLETION)
            assert status == 200
            guard_closed = h.state.metrics.registry.get_sample_value(
                "hybridpd_proxy_client_connections_closed_total", {"reason": "evicted"})
            assert guard_closed is not None and guard_closed >= 3
            for _, writer in idle:
                writer.close()
        async with harness(idle_timeout_s=0.3) as h:
            reader, writer = await open_raw(h)
            assert await closed_by_server(reader) == b""
            writer.close()

    run(go())


def test_busy_connections_at_the_cap_get_503_not_a_hang() -> None:
    async def go() -> None:
        async with harness(max_connections=2, decode_kw={"mode": "hold"}) as h:
            streams = [asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "stream": True}))
                       for _ in range(2)]
            await eventually(lambda: sum(b.outstanding for b in h.state.decode.backends) == 2)
            reader, writer = await open_raw(h)
            answer = await closed_by_server(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
            h.d.release.set()
            assert [s[0] for s in await asyncio.gather(*streams)] == [200, 200]

    run(go())


# ----------------------------------------------------------------------------- what decode sends back


def test_sse_framer_limits_event_size_and_stays_linear() -> None:
    framer = SSEFramer(max_event_bytes=64 * 1024)
    assert framer.feed(b"data: {}\n\ndata: {") == b"data: {}\n\n"
    with pytest.raises(SSEError, match="max_sse_event_bytes"):
        for _ in range(100):  # old framer: no limit, and a re-scan of the whole fragment per chunk
            framer.feed(b"x" * 1024)
    ok = SSEFramer()
    chunks = [b"data: {\"i\": %d}\n" % i + b"\n" for i in range(3)]
    stream = b"".join(chunks) + b"data: [DONE]\n\n"
    out = b"".join(ok.feed(stream[i:i + 1]) for i in range(len(stream)))  # one byte at a time
    assert out == stream and ok.saw_done and ok.pending == b""
    with pytest.raises(SSEError, match="not JSON"):
        SSEFramer().feed(b"data: <html>\n\n")


@pytest.mark.parametrize(("mode", "stream", "code"), [
    ("not_json", False, "decode_invalid_response"),  # old: 200 application/json with an HTML body
    ("not_json", True, "decode_invalid_response"),
])
def test_decode_answers_that_break_the_protocol_are_502(mode: str, stream: bool, code: str) -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": mode}) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert status == 502 and error_of(raw)["code"] == code
            assert b"<html>" not in raw

    run(go())


@pytest.mark.parametrize("mode", ["bad_event", "huge_event"])
def test_bad_or_oversized_sse_events_end_the_stream_with_an_error_event(mode: str) -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": mode, "huge_event_bytes": 1 << 20},
                           max_sse_event_bytes=64 * 1024) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            events = parse_sse(raw)
            assert status == 200 and events[-1] != "[DONE]"
            assert json.loads(events[-1])["error"]["message"] == "decode backend broke the SSE protocol"
            assert b"<html>" not in raw and b"xxxx" not in raw
            assert h.state.metrics.registry.get_sample_value(
                "hybridpd_proxy_upstream_errors_total", {"leg": "decode", "kind": "protocol"}) == 1

    run(go())


# ----------------------------------------------------------------------------- what clients learn


def test_client_errors_name_no_backend_unless_asked() -> None:
    async def go() -> None:
        async with harness(prefill_kw={"mode": "slow", "delay_s": 5}, prefill_timeout_s=0.2) as h:
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            assert status == 504 and "127.0.0.1" not in raw.decode()
            await h.d_servers[0].close()
            h.p.mode = "ok"
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 502 and "127.0.0.1" not in raw.decode(), raw

    run(go())


def test_metrics_behind_their_own_key() -> None:
    """Old: /metrics (which lists backend URLs) answered anyone."""

    async def go() -> None:
        async with harness(metrics_api_key="scrape-key", api_key="client-key") as h:
            assert (await h.get("/metrics"))[0] == 401
            assert (await h.get("/metrics", headers={"Authorization": "Bearer client-key"}))[0] == 401
            status, raw = await h.get("/metrics", headers={"Authorization": "Bearer scrape-key"})
            assert status == 200 and b"hybridpd_proxy_requests" in raw
            assert (await h.get("/health"))[0] == 200  # counts only: stays open

    run(go())


def test_tokenize_and_detokenize_are_passed_to_a_backend() -> None:
    """Old: 404, so ``vllm bench serve`` warned and skipped its prompt-length alignment."""

    async def go() -> None:
        async with harness(api_key="k") as h:
            auth = {"Authorization": "Bearer k"}
            assert (await h.post("/tokenize", {"model": "fake-model", "prompt": "abc"}))[0] == 401
            status, _, raw = await h.post("/tokenize", {"model": "fake-model", "prompt": "abc"}, headers=auth)
            assert status == 200 and json.loads(raw)["tokens"] == [97, 98, 99]
            assert json.loads(raw)["served_by"] == "decode"
            status, _, raw = await h.post("/detokenize", {"model": "fake-model", "tokens": [104, 105]}, headers=auth)
            assert status == 200 and json.loads(raw)["prompt"] == "hi"
            await h.d_servers[0].close()  # D gone: P serves the same tokenizer
            status, _, raw = await h.post("/tokenize", {"model": "fake-model", "prompt": "z"}, headers=auth)
            assert status == 200 and json.loads(raw)["served_by"] == "prefill"

    run(go())


# ----------------------------------------------------------------------------- issue 12: health, timeouts, leases


def test_health_reports_a_dead_backend_on_the_next_call() -> None:
    """Old: /health read the state of the last periodic probe (5 s period, 3 failures to eject): a dead decode
    was reported healthy for seconds (2.6 s measured)."""

    async def go() -> None:
        async with harness(unhealthy_after=3, health_max_age_s=0.05) as h:  # periodic probes: every 600 s
            assert (await h.get("/health"))[0] == 200
            await h.d_servers[0].close()
            await asyncio.sleep(0.1)  # past health_max_age_s: the next /health probes again
            status, raw = await h.get("/health")
            assert status == 503 and json.loads(raw)["decode"] == {"healthy": 0, "total": 1}

    run(go())


def test_timeouts_and_limits_are_settable_from_the_proxy_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
            "--prefill-timeout", "600", "--decode-timeout", "900", "--decode-first-byte-timeout", "700",
            "--decode-idle-timeout", "60", "--connect-timeout", "2", "--header-timeout", "7",
            "--body-timeout", "8", "--idle-timeout", "9", "--max-connections", "100",
            "--max-sse-event-bytes", "2048", "--expose-backend-errors", "--health-interval", "1"]
    code, served, err = proxy_cli(argv, monkeypatch)
    assert code == 0 and len(served) == 1, err
    c = served[0]
    assert (c.prefill_timeout_s, c.decode_timeout_s, c.decode_first_byte_timeout_s, c.decode_idle_timeout_s,
            c.connect_timeout_s, c.header_timeout_s, c.body_timeout_s, c.idle_timeout_s) == (
        600, 900, 700, 60, 2, 7, 8, 9)
    assert (c.max_connections, c.max_sse_event_bytes, c.expose_backend_errors, c.health_interval_s) == (
        100, 2048, True, 1)


def test_expired_kv_lease_on_prefill_is_a_metric_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Old: P logged "Potentially invalid KV blocks ... may have expired" and the client got 200; the proxy
    neither counted nor warned."""

    async def go() -> None:
        async with harness() as h:
            status, headers, _ = await h.post("/v1/completions", {**COMPLETION, "stream": True},
                                              headers={"X-Request-Id": "client-7"})
            assert status == 200
            h.p.kv_expired, h.p.reads_after_expiry = 1, 2  # as vLLM's counters after one late read by 2 D ranks
            with caplog.at_level(logging.WARNING, logger="hybridpd.launch.proxy"):
                await h.state.probe_all()
            url = h.state.prefill.backends[0].url
            get = h.state.metrics.registry.get_sample_value
            assert get("hybridpd_proxy_kv_lease_expired_total", {"backend": url, "kind": "expired"}) == 1
            assert get("hybridpd_proxy_kv_lease_expired_total", {"backend": url, "kind": "read_after_expiry"}) == 2
            warning = next(r.getMessage() for r in caplog.records if "KV lease expired" in r.getMessage())
            assert url in warning and headers["X-HybridPD-Pairing-Id"] in warning and "client-7" in warning
            await h.state.probe_all()  # no new expiry: no new count
            assert get("hybridpd_proxy_kv_lease_expired_total", {"backend": url, "kind": "expired"}) == 1
            assert get("hybridpd_proxy_kv_handover_seconds_count", {"backend": url}) == 1

    run(go())


def test_idle_flood_past_the_open_file_limit_does_not_lock_out_clients(tmp_path: Path) -> None:
    """Old: at a 1,024-fd limit, 1,100 idle connections made normal requests time out and asyncio logged
    'Too many open files' tens of thousands of times. Here: a proxy process with a 256-fd limit (automatic
    connection cap (256 - 100) // 2 = 78) and 400 idle connections; a normal request still gets its answer."""

    async def go() -> None:
        ledger = KVLedger()
        ps, ds = await start_server(FakePrefill(ledger).make_app()), await start_server(FakeDecode(ledger).make_app())
        port = unused_port()
        code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
                "from hybridpd_cli.main import main; sys.exit(main(['proxy', *sys.argv[1:]]))")
        log = open(tmp_path / "proxy.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, "--prefill", ps.url, "--decode", ds.url, "--port", str(port),
            stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        writers = []
        try:
            async with aiohttp.ClientSession() as client:
                async def up() -> bool:
                    try:
                        async with client.get(f"http://127.0.0.1:{port}/health") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectionError:
                        return False

                await eventually(up, timeout=30, step=0.1)
                for _ in range(400):
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    writers.append(w)
                await asyncio.sleep(0.5)  # let the proxy accept what it will
                async with aiohttp.ClientSession() as fresh:
                    async with fresh.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION,
                                          timeout=aiohttp.ClientTimeout(total=20)) as r:
                        assert r.status == 200
        finally:
            for w in writers:
                w.close()
            proc.terminate()
            await proc.wait()
            log.close()
            await ps.close()
            await ds.close()
        text = (tmp_path / "proxy.log").read_text()
        assert "Too many open files" not in text, text[-2000:]

    run(go())


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["--prefill", "x", "--decode", "http://127.0.0.1:8200"], {}, "--prefill"),
    (["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8100/v1"], {}, "--decode"),
    (["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"], {"HYBRIDPD_PROXY_API_KEY": "a b"},
     "HYBRIDPD_PROXY_API_KEY"),
])
def test_proxy_cli_errors_name_the_flag_or_variable(argv: list[str], env: dict[str, str], named: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, served, err = proxy_cli(argv, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and served == [] and len(lines) == 1 and lines[0].startswith(f"Error: {named}: "), err
