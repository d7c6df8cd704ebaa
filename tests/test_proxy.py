"""The P/D proxy end to end, against fake P and D servers on 127.0.0.1 (see ``proxy_fakes``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_fakes import (
    FakeDecode,
    FakePrefill,
    Harness,
    KVLedger,
    eventually,
    expected_text,
    harness,
    parse_sse,
    run,
    start_server,
    stream_text,
    token_text,
    unused_port,
)

from hybridpd.launch.proxy import ProxyConfig, build_app, proxy_state

PROMPT = "The capital of France is"
COMPLETION: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}


def error_of(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    err: dict[str, Any] = body["error"]
    return err


def assert_paired(h: Harness) -> None:
    """Every D request carried exactly what some P issued for the same X-Request-Id, and nothing was left over."""
    assert all(not f.violations for f in (*h.prefills, *h.decodes)), [f.violations for f in (*h.prefills, *h.decodes)]


# ----------------------------------------------------------------------------- happy paths


def test_completion_non_streaming_follows_the_protocol() -> None:
    async def go() -> None:
        async with harness() as h:
            status, headers, raw = await h.post("/v1/completions", {**COMPLETION, "min_tokens": 3})
            assert status == 200, raw
            body = json.loads(raw)
            assert body["choices"][0]["text"] == expected_text(PROMPT, 5)
            assert_paired(h)
            (p_seen,), (d_seen,) = h.p.received, h.d.received
            rid = p_seen.headers["X-Request-Id"]
            assert str(uuid.UUID(rid)) == rid and d_seen.headers["X-Request-Id"] == rid == headers["X-Request-Id"]
            assert p_seen.body["max_tokens"] == 1 and "min_tokens" not in p_seen.body
            # D got the client's body back (max_tokens 5, min_tokens restored) plus P's params, unchanged
            assert d_seen.body["max_tokens"] == 5 and d_seen.body["min_tokens"] == 3
            assert d_seen.body["kv_transfer_params"]["remote_engine_id"] == h.p.engine_id
            assert body["fake"]["remote_request_id"] == d_seen.body["kv_transfer_params"]["remote_request_id"]
            assert h.ledger.issued_total == h.ledger.consumed_total == 1
            assert "Authorization" not in p_seen.headers and "Authorization" not in d_seen.headers

    run(go())


def test_completion_streaming_relays_every_event_and_done() -> None:
    async def go() -> None:
        async with harness() as h:
            body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            status, headers, raw = await h.post("/v1/completions", body)
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
            events = parse_sse(raw)
            assert events[-1] == "[DONE]" and len(events) == 5 + 2  # 5 tokens, usage, DONE
            assert stream_text(events) == expected_text(PROMPT, 5)
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 5
            assert "stream_options" not in h.p.received[0].body and h.p.received[0].body["stream"] is False
            assert h.d.received[0].body["stream"] is True and h.d.received[0].body["stream_options"]
            assert_paired(h)

    run(go())


def test_chat_streaming_and_max_completion_tokens() -> None:
    async def go() -> None:
        async with harness() as h:
            body = {**CHAT, "max_completion_tokens": 6, "stream": True, "min_completion_tokens": 2}
            status, _, raw = await h.post("/v1/chat/completions", body)
            assert status == 200
            events = parse_sse(raw)
            assert stream_text(events, chat=True) == expected_text("Hi there", 6) and events[-1] == "[DONE]"
            p_body, d_body = h.p.received[0].body, h.d.received[0].body
            assert p_body["max_completion_tokens"] == 1 and "min_completion_tokens" not in p_body
            assert d_body["max_completion_tokens"] == 6 and d_body["min_completion_tokens"] == 2
            assert h.p.received[0].path == h.d.received[0].path == "/v1/chat/completions"
            status, _, raw = await h.post("/v1/chat/completions", CHAT)
            assert status == 200
            assert json.loads(raw)["choices"][0]["message"]["content"] == expected_text("Hi there", 4)
            assert_paired(h)

    run(go())


def test_pairing_id_is_the_proxys_own_and_the_client_id_is_kept_for_correlation() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "hold"}) as h:
            # two requests in flight with the SAME client id: each must get its own P/D pairing id
            first = asyncio.ensure_future(h.post("/v1/completions", {**COMPLETION, "stream": True},
                                                 headers={"X-Request-Id": "client-42"}))
            await asyncio.wait_for(h.d.holding.wait(), 30)
            h.d.mode = "ok"
            status, headers, _ = await h.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "client-42"})
            h.d.release.set()
            status1, headers1, _ = await first
            assert status == status1 == 200
            assert headers["X-Request-Id"] == headers1["X-Request-Id"] == "client-42"
            pairing = [seen.headers["X-Request-Id"] for seen in h.p.received]
            assert len(set(pairing)) == 2 and "client-42" not in pairing
            assert all(str(uuid.UUID(rid)) == rid for rid in pairing)
            assert sorted(pairing) == sorted(seen.headers["X-Request-Id"] for seen in h.d.received)
            assert {headers["X-HybridPD-Pairing-Id"], headers1["X-HybridPD-Pairing-Id"]} == set(pairing)
            # an implausible client id is not echoed; the response carries the pairing id instead
            status, headers, _ = await h.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "has space"})
            assert status == 200 and headers["X-Request-Id"] == headers["X-HybridPD-Pairing-Id"]
            assert h.p.received[-1].headers["X-Request-Id"] == headers["X-Request-Id"]
            assert_paired(h)

    run(go())


def test_single_prompt_lists_are_served() -> None:
    async def go() -> None:
        async with harness() as h:
            for prompt in ([1, 2, 3], ["only one"]):
                status, _, raw = await h.post("/v1/completions", {**COMPLETION, "prompt": prompt})
                assert status == 200, raw
                assert json.loads(raw)["choices"][0]["text"] == expected_text(json.dumps(prompt), 5)
            assert_paired(h)

    run(go())


# ----------------------------------------------------------------------------- refused requests


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "n": 2}, "n"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3, 4]]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "n": 3, "stream": True}, "n"),
    ],
)
def test_n_and_multi_prompt_are_refused_before_any_backend_call(path: str, body: dict[str, Any], param: str) -> None:
    async def go() -> None:
        async with harness() as h:
            status, _, raw = await h.post(path, body)
            err = error_of(raw)
            assert status == 400 and err["param"] == param and err["code"] == "unsupported_parameter"
            assert param in err["message"]
            assert h.p.received == [] and h.d.received == []

    run(go())


def test_bad_json_and_non_object_bodies_are_400() -> None:
    async def go() -> None:
        async with harness() as h:
            async with h.client.post(h.url + "/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and error_of(await r.read())["code"] == "invalid_json"
            status, _, raw = await h.post("/v1/completions", [COMPLETION])
            assert status == 400 and error_of(raw)["code"] == "invalid_body"
            assert h.p.received == []

    run(go())


def test_body_over_the_size_limit_is_413_with_and_without_content_length() -> None:
    async def go() -> None:
        async with harness(max_request_bytes=4096) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "prompt": "x" * 8000})
            assert status == 413 and error_of(raw)["code"] == "request_too_large"

            async def chunked() -> AsyncIterator[bytes]:
                yield b'{"prompt": "'
                for _ in range(10):
                    yield b"y" * 1000
                yield b'"}'

            async with h.client.post(h.url + "/v1/completions", data=chunked()) as r:
                assert r.status == 413 and error_of(await r.read())["code"] == "request_too_large"
            status, _, _ = await h.post("/v1/completions", {**COMPLETION, "prompt": "x" * 1000})
            assert status == 200  # under the limit still works
            assert len(h.p.received) == 1

    run(go())


def test_api_key_required_and_never_forwarded() -> None:
    async def go() -> None:
        async with harness(api_key="client-secret") as h:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "client-secret"}):
                status, resp_headers, raw = await h.post("/v1/completions", COMPLETION, headers=headers)
                assert status == 401 and error_of(raw)["type"] == "authentication_error"
                assert resp_headers["WWW-Authenticate"] == "Bearer"
            status, _ = await h.get("/v1/models")
            assert status == 401
            assert h.p.received == []
            status, _, _ = await h.post("/v1/completions", COMPLETION,
                                        headers={"Authorization": "Bearer client-secret"})
            assert status == 200
            assert "Authorization" not in h.p.received[0].headers and "Authorization" not in h.d.received[0].headers
            assert (await h.get("/health"))[0] == 200
            assert (await h.get("/metrics"))[0] == 401  # it names the backends: behind the key
            assert (await h.get("/metrics", headers={"Authorization": "Bearer client-secret"}))[0] == 200

        async with harness(api_key="client-secret", backend_api_key="backend-secret") as h:
            status, _, _ = await h.post("/v1/completions", COMPLETION,
                                        headers={"Authorization": "Bearer client-secret"})
            assert status == 200
            assert h.p.received[0].headers["Authorization"] == "Bearer backend-secret"
            assert h.d.received[0].headers["Authorization"] == "Bearer backend-secret"

    run(go())


# ----------------------------------------------------------------------------- prefill faults


def test_prefill_down_at_start_is_503() -> None:
    async def go() -> None:
        dead = f"http://127.0.0.1:{unused_port()}"
        async with harness(n_prefill=0, extra_prefill_urls=(dead,)) as h:
            status, raw = await h.get("/health")
            assert status == 503 and json.loads(raw)["prefill"] == {"healthy": 0, "total": 1}
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            assert status == 503 and error_of(raw)["code"] == "no_healthy_prefill_backend"
            assert h.d.received == []
            assert h.metric("hybridpd_proxy_backend_ejections_total",
                            {"role": "prefill", "backend": dead, "reason": "health"}) == 1

    run(go())


def test_prefill_dying_is_502_then_503_once_ejected() -> None:
    async def go() -> None:
        async with harness() as h:
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            await h.p_servers[0].close()  # P goes away; the proxy has not probed since
            url = h.state.prefill.backends[0].url
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            err = error_of(raw)
            assert status == 502 and err["code"] == "prefill_unreachable" and url not in err["message"]
            assert not h.state.prefill.backends[0].healthy
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            assert status == 503 and error_of(raw)["code"] == "no_healthy_prefill_backend"
            assert (await h.get("/health"))[0] == 503
            assert len(h.d.received) == 1
            assert h.metric("hybridpd_proxy_backend_ejections_total",
                            {"role": "prefill", "backend": url, "reason": "connect"}) == 1

    run(go())


def test_refused_prefill_fails_over_to_the_next_and_is_readmitted_by_health_probe() -> None:
    async def go() -> None:
        async with harness(2, 1) as h:
            await h.p_servers[0].close()
            dead_backend = h.state.prefill.backends[0]
            for _ in range(3):
                status, _, raw = await h.post("/v1/completions", COMPLETION)
                assert status == 200, raw  # the first one was refused by P0, then served by P1
            assert not dead_backend.healthy and len(h.prefills[1].received) == 3
            # bring a P up on the dead port: the next probe round re-admits it and it gets traffic again
            revived = FakePrefill(h.ledger)
            server = await start_server(revived.make_app(), port=int(dead_backend.url.rsplit(":", 1)[1]))
            try:
                await h.state.probe_all()
                assert dead_backend.healthy
                for _ in range(2):
                    assert (await h.post("/v1/completions", COMPLETION))[0] == 200
                assert len(revived.received) == 1 and len(h.prefills[1].received) == 4  # round-robin again
                assert_paired(h)
            finally:
                await server.close()

    run(go())


def test_prefill_500_is_502_quoting_upstream_status_but_not_its_text() -> None:
    async def go() -> None:
        async with harness(prefill_kw={"mode": "error_500"}) as h:
            for body in (COMPLETION, {**COMPLETION, "stream": True}):
                status, _, raw = await h.post("/v1/completions", body)
                err = error_of(raw)
                assert status == 502 and err["code"] == "prefill_upstream_error"
                assert "HTTP 500" in err["message"] and "EngineCore died" not in err["message"]
                assert "127.0.0.1" not in raw.decode()
            assert h.d.received == [] and h.state.prefill.backends[0].healthy  # a 5xx is not an ejection
            assert h.metric("hybridpd_proxy_upstream_errors_total", {"leg": "prefill", "kind": "http_5xx"}) == 2
        async with harness(prefill_kw={"mode": "error_500"}, expose_backend_errors=True) as h:
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            message = error_of(raw)["message"]
            assert status == 502 and "EngineCore died" in message and h.state.prefill.backends[0].url in message

    run(go())


def test_prefill_4xx_is_passed_through() -> None:
    async def go() -> None:
        async with harness(prefill_kw={"mode": "error_404"}) as h:
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            assert status == 404 and "does not exist" in error_of(raw)["message"]
            assert h.d.received == []

    run(go())


def test_slow_prefill_is_504_and_the_p_request_is_abandoned() -> None:
    async def go() -> None:
        async with harness(prefill_kw={"mode": "slow", "delay_s": 30.0}, prefill_timeout_s=0.5) as h:
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            err = error_of(raw)
            assert status == 504 and err["code"] == "prefill_timeout" and "prefill_timeout_s=0.5" in err["message"]
            await asyncio.wait_for(h.p.cancelled.wait(), 30)  # the proxy closed the P connection
            assert h.d.received == [] and h.state.prefill.backends[0].outstanding == 0

    run(go())


@pytest.mark.parametrize(
    ("mode", "code"),
    [("bad_kv", "invalid_kv_transfer_params"), ("null_kv", "missing_kv_transfer_params"),
     ("not_json", "prefill_invalid_response")],
)
def test_unusable_prefill_answer_is_502_and_d_is_never_called(mode: str, code: str) -> None:
    async def go() -> None:
        async with harness(prefill_kw={"mode": mode}) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            err = error_of(raw)
            assert status == 502 and err["code"] == code, err
            assert h.d.received == []

    run(go())


# ----------------------------------------------------------------------------- decode faults


def test_decode_down_is_503_at_start_502_when_refused_and_fails_over() -> None:
    async def go() -> None:
        dead = f"http://127.0.0.1:{unused_port()}"
        async with harness(n_decode=0, extra_decode_urls=(dead,)) as h:
            assert (await h.get("/health"))[0] == 503
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 503 and error_of(raw)["code"] == "no_healthy_decode_backend"
            assert h.p.received == []  # no prefill work wasted when no D can take it
        async with harness() as h:
            await h.d_servers[0].close()
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            assert status == 502 and error_of(raw)["code"] == "decode_unreachable"
            assert (await h.get("/health"))[0] == 503
        async with harness(1, 2) as h:
            await h.d_servers[0].close()
            for _ in range(2):
                status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
                assert status == 200 and parse_sse(raw)[-1] == "[DONE]"
            assert not h.state.decode.backends[0].healthy and len(h.decodes[1].received) == 2
            assert_paired(h)

    run(go())


def test_decode_500_is_502() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "error_500"}) as h:
            for body in (COMPLETION, {**COMPLETION, "stream": True}):
                status, _, raw = await h.post("/v1/completions", body)
                err = error_of(raw)
                assert status == 502 and "HTTP 500" in err["message"] and "KV load failed" not in err["message"]

    run(go())


def test_decode_dropping_mid_stream_ends_client_stream_with_error_event() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "drop_mid_stream", "drop_after": 2}) as h:
            async with h.client.post(h.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert r.status == 200
                head = await r.content.readuntil(b"\n\n") + await r.content.readuntil(b"\n\n")
                h.d.release.set()  # D now writes half an event and drops the connection
                raw = head + await r.read()  # ends: the proxy does not hang
            events = parse_sse(raw)
            assert stream_text(events[:2]) == expected_text(PROMPT, 2)
            assert len(events) == 3 and "[DONE]" not in events
            err = json.loads(events[2])["error"]
            assert err["code"] == "stream_interrupted" and "connection lost mid-stream" in err["message"]
            assert b"truncated-ev" not in raw  # the half event D sent was not relayed
            await eventually(lambda: h.state.decode.backends[0].outstanding == 0)
            assert h.metric("hybridpd_proxy_upstream_errors_total", {"leg": "decode", "kind": "disconnect"}) == 1

    run(go())


def test_decode_stream_without_done_gets_an_error_event() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "no_done"}) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            events = parse_sse(raw)
            assert status == 200 and stream_text(events[:-1]) == expected_text(PROMPT, 5)
            assert "without 'data: [DONE]'" in json.loads(events[-1])["error"]["message"]

    run(go())


def test_non_sse_answer_to_a_stream_is_502() -> None:
    """A streaming request answered with something other than text/event-stream breaks the protocol: 502, and
    nothing of that body reaches the client (the old proxy relayed it raw with D's status)."""

    async def go() -> None:
        ledger = KVLedger()
        p = FakePrefill(ledger)

        async def ndjson(request: web.Request) -> web.StreamResponse:
            await request.json()
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            await resp.write(b'{"a": 1}\n')
            await resp.write_eof()
            return resp

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        d_app = web.Application()
        d_app.router.add_post("/v1/completions", ndjson)
        d_app.router.add_get("/health", health)
        ps, ds = await start_server(p.make_app()), await start_server(d_app)
        proxy = await start_server(build_app(ProxyConfig(prefill_urls=(ps.url,), decode_urls=(ds.url,))))
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(proxy.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                    raw = await r.read()
                    assert r.status == 502 and error_of(raw)["code"] == "decode_invalid_response"
                    assert b'"a"' not in raw
        finally:
            for server in (proxy, ps, ds):
                await server.close()

    run(go())


def test_decode_first_byte_timeout_is_504() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "slow_first_byte", "first_byte_delay_s": 30.0},
                           decode_first_byte_timeout_s=0.5) as h:
            status, _, raw = await h.post("/v1/completions", {**COMPLETION, "stream": True})
            err = error_of(raw)
            assert status == 504 and err["code"] == "decode_timeout" and "first_byte" in err["message"]
            await asyncio.wait_for(h.d.cancelled.wait(), 30)
            assert h.state.decode.backends[0].outstanding == 0

    run(go())


def test_client_disconnect_aborts_decode_and_leaks_nothing() -> None:
    async def go() -> None:
        async with harness(decode_kw={"mode": "hold"}) as h:
            # warm the keep-alive connections so the task baseline includes their server-side handlers
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            await eventually(lambda: h.metric("hybridpd_proxy_outstanding_requests") == 0)
            baseline = set(asyncio.all_tasks())

            resp = await h.client.post(h.url + "/v1/completions", json={**COMPLETION, "stream": True})
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert json.loads(first[len(b"data: "):])["choices"][0]["text"] == expected_text(PROMPT, 1)
            await asyncio.wait_for(h.d.holding.wait(), 30)
            assert h.metric("hybridpd_proxy_outstanding_requests") == 1
            resp.close()  # the client goes away mid-stream

            await asyncio.wait_for(h.d.cancelled.wait(), 30)  # D saw its request aborted
            await eventually(lambda: h.metric("hybridpd_proxy_outstanding_requests") == 0)
            assert all(b.outstanding == 0 for b in (*h.state.prefill.backends, *h.state.decode.backends))
            me = asyncio.current_task()
            await eventually(lambda: not (set(asyncio.all_tasks()) - baseline - {me}))
            names = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]  # type: ignore[union-attr]
            assert sum("ProxyState" in n or "HealthProbes" in n for n in names) == 1, names  # only the health loop
            assert h.metric("hybridpd_proxy_requests_total", {"route": "/v1/completions", "status": "499"}) == 1
            assert h.d.cancellations == 1

    run(go())


def test_client_disconnect_without_handler_cancellation_aborts_at_next_chunk() -> None:
    """Embedders running build_app() on a runner without handler_cancellation still free D, one chunk later."""

    async def go() -> None:
        # a long, slow answer: D is still writing when the proxy drops it (it cannot finish first)
        async with harness(decode_kw={"mode": "hold", "token_delay_s": 0.01}, proxy_handler_cancellation=False,
                           guarded=False) as h:
            body = {**COMPLETION, "stream": True, "max_tokens": 1000}
            resp = await h.client.post(h.url + "/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            resp.close()
            await asyncio.sleep(0.2)  # not a timing assertion: only gives the proxy a chance to (wrongly) finish
            assert h.metric("hybridpd_proxy_outstanding_requests") == 1  # nothing to notice until D writes again
            h.d.release.set()
            await eventually(lambda: h.metric("hybridpd_proxy_outstanding_requests") == 0)
            assert h.state.decode.backends[0].outstanding == 0
            await asyncio.wait_for(h.d.cancelled.wait(), 30)  # the proxy closed the D connection

    run(go())


# ----------------------------------------------------------------------------- selection and health


def test_round_robin_spreads_over_all_backends() -> None:
    async def go() -> None:
        async with harness(2, 2) as h:
            for i in range(8):
                status, _, raw = await h.post("/v1/completions", {**COMPLETION, "prompt": f"p{i}"})
                assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_text(f"p{i}", 5)
            assert [len(f.received) for f in (*h.prefills, *h.decodes)] == [4, 4, 4, 4]
            assert [s.body["prompt"] for s in h.prefills[0].received] == ["p0", "p2", "p4", "p6"]
            assert_paired(h)

    run(go())


@pytest.mark.parametrize(("policy", "held_gets"), [("least_outstanding", 0), ("round_robin", 2)])
def test_least_outstanding_avoids_the_busy_decode(policy: str, held_gets: int) -> None:
    async def go() -> None:
        async with harness(1, 2, decode_kw={"mode": "hold"}, policy=policy) as h:
            held = await h.client.post(h.url + "/v1/completions", json={**COMPLETION, "stream": True})
            await held.content.readuntil(b"\n\n")
            busy = next(f for f in h.decodes if f.holding.is_set())
            other = next(f for f in h.decodes if f is not busy)
            for i in range(4):  # non-streaming requests are not held
                assert (await h.post("/v1/completions", {**COMPLETION, "prompt": f"q{i}"}))[0] == 200
            assert len(busy.received) == 1 + held_gets and len(other.received) == 4 - held_gets
            busy.release.set()
            events = parse_sse(await held.read())
            held.close()
            rest = "".join(token_text(PROMPT, i) for i in range(1, 5))  # token 0 was read above
            assert events[-1] == "[DONE]" and stream_text(events[:-1]) == rest
            assert_paired(h)

    run(go())


def test_health_probes_eject_and_readmit() -> None:
    async def go() -> None:
        async with harness(2, 1, health_interval_s=0.05, unhealthy_after=2, healthy_after=2) as h:
            sick = h.prefills[0]
            sick.health_status = 503
            sick_backend = h.state.prefill.backends[0]
            await eventually(lambda: not sick_backend.healthy)
            assert (await h.get("/health"))[0] == 200  # the other P still serves
            for _ in range(4):
                assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            assert len(h.prefills[1].received) == 4 and sick.received == []
            h.prefills[1].health_status = 500
            await eventually(lambda: h.state.prefill.healthy_count == 0)
            status, raw = await h.get("/health")
            assert status == 503 and json.loads(raw)["prefill"] == {"healthy": 0, "total": 2}
            status, _, raw = await h.post("/v1/completions", COMPLETION)
            assert status == 503 and error_of(raw)["code"] == "no_healthy_prefill_backend"
            sick.health_status = 200
            await eventually(lambda: sick_backend.healthy)
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200 and len(sick.received) == 1
            text = (await h.get("/metrics"))[1].decode()
            assert f'hybridpd_proxy_backend_healthy{{backend="{sick_backend.url}",role="prefill"}} 1.0' in text
            assert h.metric("hybridpd_proxy_backend_ejections_total",
                            {"role": "prefill", "backend": sick_backend.url, "reason": "health"}) == 1

    run(go())


# ----------------------------------------------------------------------------- other endpoints


def test_models_from_decode_then_prefill() -> None:
    async def go() -> None:
        async with harness() as h:
            status, raw = await h.get("/v1/models")
            assert status == 200 and json.loads(raw)["data"][0]["owned_by"] == "fake-decode"
            h.state.decode.eject(h.state.decode.backends[0], "test")
            status, raw = await h.get("/v1/models")
            assert status == 200 and json.loads(raw)["data"][0]["owned_by"] == "fake-prefill"
            h.state.prefill.eject(h.state.prefill.backends[0], "test")
            status, raw = await h.get("/v1/models")
            assert status == 503 and error_of(raw)["code"] == "no_healthy_backend"

    run(go())


def test_unknown_route_and_method_are_json_errors() -> None:
    async def go() -> None:
        async with harness() as h:
            status, raw = await h.get("/v2/nothing")
            assert status == 404 and error_of(raw)["type"] == "not_found_error"
            async with h.client.get(h.url + "/v1/completions") as r:
                assert r.status == 405 and "POST" in r.headers["Allow"]
                assert error_of(await r.read())["code"] == "http_405"

    run(go())


def test_metrics_count_requests_and_legs_per_app_registry() -> None:
    async def go() -> None:
        async with harness() as h:
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            assert (await h.post("/v1/completions", {**COMPLETION, "stream": True}))[0] == 200
            assert (await h.post("/v1/completions", {**COMPLETION, "n": 2}))[0] == 400
            status, raw = await h.get("/metrics")
            text = raw.decode()
            assert status == 200
            assert 'hybridpd_proxy_requests_total{route="/v1/completions",status="200"} 2.0' in text
            assert 'hybridpd_proxy_requests_total{route="/v1/completions",status="400"} 1.0' in text
            p_url, d_url = h.state.prefill.backends[0].url, h.state.decode.backends[0].url
            assert h.metric("hybridpd_proxy_leg_duration_seconds_count", {"leg": "prefill", "backend": p_url}) == 2
            assert h.metric("hybridpd_proxy_leg_duration_seconds_count", {"leg": "decode", "backend": d_url}) == 2
            assert h.metric("hybridpd_proxy_leg_duration_seconds_count",
                            {"leg": "decode_first_byte", "backend": d_url}) == 1
            assert "hybridpd_proxy_outstanding_requests 0.0" in text
            assert f'hybridpd_proxy_backend_outstanding{{backend="{d_url}",role="decode"}} 0.0' in text
            # a second app in the same process has its own registry
            other = proxy_state(build_app(ProxyConfig(prefill_urls=(p_url,), decode_urls=(d_url,))))
            assert other.metrics.registry.get_sample_value(
                "hybridpd_proxy_requests_total", {"route": "/v1/completions", "status": "200"}) is None

    run(go())


def test_256_concurrent_streams_all_complete_correctly() -> None:
    async def go() -> None:
        async with harness(2, 2, policy="least_outstanding") as h:

            async def one(i: int) -> str:
                body = {**COMPLETION, "prompt": f"prompt number {i}", "max_tokens": 8, "stream": True}
                status, _, raw = await h.post("/v1/completions", body)
                assert status == 200, raw
                events = parse_sse(raw)
                assert events[-1] == "[DONE]", events[-2:]
                return stream_text(events)

            texts = await asyncio.gather(*(one(i) for i in range(256)))
            assert texts == [expected_text(f"prompt number {i}", 8) for i in range(256)]
            assert h.ledger.issued_total == h.ledger.consumed_total == 256
            assert sum(len(f.received) for f in h.decodes) == 256 and all(len(f.received) > 0 for f in h.decodes)
            assert_paired(h)
            assert h.metric("hybridpd_proxy_outstanding_requests") == 0

    run(go(), timeout=120)


# ----------------------------------------------------------------------------- run_proxy


def test_run_proxy_serves_and_stops_cleanly_on_sigterm() -> None:
    async def go() -> None:
        ledger = KVLedger()
        p, d = FakePrefill(ledger), FakeDecode(ledger)
        ps, ds = await start_server(p.make_app()), await start_server(d.make_app())
        port = unused_port()
        code = (
            "from hybridpd.launch.proxy import ProxyConfig, run_proxy; "
            f"run_proxy(ProxyConfig(prefill_urls=({ps.url!r},), decode_urls=({ds.url!r},), port={port})); "
            "print('clean exit')"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            async with aiohttp.ClientSession() as client:
                async def up() -> bool:
                    try:
                        async with client.get(f"http://127.0.0.1:{port}/health") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectionError:
                        return False

                await eventually(up, timeout=30, step=0.1)
                async with client.post(f"http://127.0.0.1:{port}/v1/completions", json=COMPLETION) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["text"] == expected_text(PROMPT, 5)
            proc.send_signal(signal.SIGTERM)
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()
            assert out.decode().strip() == "clean exit"
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await ps.close()
            await ds.close()

    run(go())


def test_sigterm_with_a_stream_in_flight_ends_it_with_an_error_event_within_the_grace() -> None:
    """Old: aiohttp cancelled the handler after the grace: the client saw the stream stop without any error
    event (and serve had to SIGKILL a proxy whose grace exceeded its own)."""

    async def go() -> None:
        ledger = KVLedger()
        p, d = FakePrefill(ledger), FakeDecode(ledger, mode="hold")
        ps, ds = await start_server(p.make_app()), await start_server(d.make_app())
        port = unused_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hybridpd_cli", "proxy", "--prefill", ps.url, "--decode", ds.url, "--port", str(port),
            "--shutdown-grace", "0.5", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as client:
                async def up() -> bool:
                    try:
                        async with client.get(url + "/health") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectionError:
                        return False

                await eventually(up, timeout=30, step=0.1)
                async with client.post(url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                    assert r.status == 200
                    first = await r.content.readuntil(b"\n\n")
                    assert json.loads(first[6:])["choices"][0]["text"] == token_text(PROMPT, 0)
                    proc.send_signal(signal.SIGTERM)
                    rest = await asyncio.wait_for(r.read(), 30)
            events = parse_sse(rest)
            assert events and "[DONE]" not in events
            assert json.loads(events[-1])["error"]["message"] == "the proxy is shutting down; the stream was ended"
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err.decode()[-2000:]
            assert d.cancellations == 1  # D's request was aborted, not left running
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            d.release.set()
            await ps.close()
            await ds.close()

    run(go())
