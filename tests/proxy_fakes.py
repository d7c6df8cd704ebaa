"""Fake vLLM prefill (P) and decode (D) servers that speak the NixlConnector P/D protocol over HTTP, and a test
harness that puts the proxy in front of them: 127.0.0.1 ephemeral ports, one event loop. Tests are plain functions
that call ``run(coro)``: no pytest asyncio plugin needed. ``bench/bench_proxy.py`` uses the fakes too.

No vLLM, no model. The fakes check what a real pair would need:

* P answers ``max_tokens=1`` requests with ``kv_transfer_params`` shaped like vLLM 0.32's (verbatim field set of
  ``vllm-cpu-notes.md`` section 2.2) and records them in a ``KVLedger`` under the request's ``X-Request-Id``;
  it flags (HTTP 400 + ``violations``) any request not rewritten as the protocol demands.
* D requires ``kv_transfer_params`` to be exactly a dict P issued for the same ``X-Request-Id`` (each dict is
  consumed once), then answers with text derived from the prompt (``expected_text``), streamed as SSE chunks
  ending in ``data: [DONE]`` when ``stream`` is true.

Fault injection: ``FakePrefill.mode`` / ``FakeDecode.mode`` (see the class docstrings), ``health_status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from hybridpd.launch.proxy import ProxyConfig, ProxyState, build_app, proxy_state
from hybridpd.launch.proxy.protocol import PREFILL_KV_TRANSFER_PARAMS, RESTORED_FIELDS
from hybridpd.launch.proxy.server import make_runner, make_site

if TYPE_CHECKING:
    import pytest

PrefillMode = Literal["ok", "error_500", "error_404", "slow", "bad_kv", "null_kv", "not_json"]
DecodeMode = Literal[
    "ok", "error_500", "drop_mid_stream", "no_done", "slow_first_byte", "hold", "not_json", "bad_event", "huge_event"
]


def unused_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound then released), for "backend down" cases."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def prompt_key(body: dict[str, Any]) -> str:
    """What the fake D derives its answer from: the completions prompt, or the last chat message's content."""
    if "messages" in body:
        messages = body.get("messages") or [{}]
        last = messages[-1] if isinstance(messages, list) and messages else {}
        content = last.get("content", "") if isinstance(last, dict) else ""
        return content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def token_text(key: str, i: int) -> str:
    return f" t{i}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def expected_text(key: str, n_tokens: int) -> str:
    """The full text the fake D produces for ``prompt_key`` ``key`` and ``max_tokens`` ``n_tokens``."""
    return "".join(token_text(key, i) for i in range(n_tokens))


class KVLedger:
    """kv_transfer_params issued by fake P instances, per X-Request-Id, until a fake D consumes them."""

    def __init__(self) -> None:
        self._issued: dict[str, list[dict[str, Any]]] = {}
        self.issued_total = 0
        self.consumed_total = 0

    def issue(self, request_id: str, params: dict[str, Any]) -> None:
        self._issued.setdefault(request_id, []).append(json.loads(json.dumps(params)))
        self.issued_total += 1

    def consume(self, request_id: str, params: object) -> bool:
        issued = self._issued.get(request_id, [])
        if params in issued:
            issued.remove(params)
            if not issued:
                self._issued.pop(request_id, None)
            self.consumed_total += 1
            return True
        return False


@dataclass
class Seen:
    """One request a fake received."""

    path: str
    body: dict[str, Any]
    headers: CIMultiDict[str]


@dataclass
class _Base:
    ledger: KVLedger
    model: str = "fake-model"
    health_status: int = 200
    received: list[Seen] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    #: Handlers that saw their client (the proxy) go away mid-request.
    cancellations: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    record: bool = True
    #: Values of vLLM's KV-lease counters on ``/metrics`` (meaningful on P; see ``_metrics``).
    kv_expired: int = 0
    reads_after_expiry: int = 0

    role: str = "fake"

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize answer shape; the fake tokenizer maps characters to code points."""
        body = await request.json()
        tokens = [ord(c) for c in str(body.get("prompt", ""))]
        return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens,
                                  "token_strs": None, "served_by": self.role})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": "".join(chr(t) for t in body.get("tokens", [])), "served_by": self.role})

    async def _metrics(self, request: web.Request) -> web.Response:
        """The two KV-lease counters of vLLM 0.32's NixlConnector (``nixl/stats.py``), as prometheus_client
        renders them (``_total`` suffix, one series per engine)."""
        lines = []
        for name, value in (("vllm:nixl_num_kv_expired_reqs", self.kv_expired),
                            ("vllm:nixl_num_notifications_after_expiry", self.reads_after_expiry)):
            lines += [f"# HELP {name}_total fake", f"# TYPE {name}_total counter",
                      f'{name}_total{{engine="0",model_name="{self.model}"}} {float(value)}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": f"fake-{self.role}"}]}
        )

    async def _intake(self, request: web.Request) -> tuple[dict[str, Any], str]:
        """Parse the JSON body, note the X-Request-Id, and record what arrived."""
        body = await request.json()
        if self.record:
            self.received.append(Seen(request.path, body, CIMultiDict(request.headers)))
        return body, request.headers.get("X-Request-Id", "")

    def _violation(self, message: str) -> web.Response:
        self.violations.append(message)
        return web.json_response(
            {"error": {"message": f"fake {self.role}: {message}", "type": "BadRequestError", "code": 400}}, status=400
        )

    def _observed_cancel(self) -> None:
        self.cancellations += 1
        self.cancelled.set()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError


@dataclass
class FakePrefill(_Base):
    """Fake P. ``mode``: ok | error_500 | error_404 | slow (sleeps ``delay_s`` first) | bad_kv (no
    remote_block_ids) | null_kv (``kv_transfer_params: null``) | not_json."""

    mode: PrefillMode = "ok"
    delay_s: float = 0.0
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    side_channel_port: int = 5600
    #: Flag requests without ``X-Request-Id`` (hybridpd's proxy always sends one; vLLM itself does not need it).
    require_request_id: bool = True
    role: str = "prefill"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, rid = await self._intake(request)
        problems = []
        if not rid and self.require_request_id:
            problems.append("no X-Request-Id")
        if body.get("kv_transfer_params") != dict(PREFILL_KV_TRANSFER_PARAMS):
            problems.append(f"kv_transfer_params {body.get('kv_transfer_params')!r}")
        if body.get("stream") is not False:
            problems.append(f"stream={body.get('stream')!r}")
        if body.get("max_tokens") != 1:
            problems.append(f"max_tokens={body.get('max_tokens')!r}")
        if "max_completion_tokens" in body and body["max_completion_tokens"] != 1:
            problems.append(f"max_completion_tokens={body['max_completion_tokens']!r}")
        problems += [f"{k} present" for k in ("stream_options",) if k in body]
        # vLLM refuses min_tokens > max_tokens (= 1 here); 0 or 1 is accepted (vllm-router sends min_tokens=1)
        problems += [f"{k}={body[k]!r} > 1" for k in RESTORED_FIELDS if k in body and body[k] not in (0, 1, None)]
        if problems:
            return self._violation("prefill request not rewritten: " + "; ".join(problems))
        try:
            if self.mode == "slow":
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self._observed_cancel()
            raise
        if self.mode == "error_500":
            return web.json_response(
                {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}, status=500
            )
        if self.mode == "error_404":
            return web.json_response(
                {"error": {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError",
                           "code": 404}},
                status=404,
            )
        if self.mode == "not_json":
            return web.Response(text="<html>gateway</html>", content_type="text/html")
        key = prompt_key(body)
        params: dict[str, Any] | None = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1 + len(key) % 7, 2 + len(key) % 7]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"cmpl-{rid}-0-{uuid.uuid4().hex[:8]}",
            "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(key),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }
        assert params is not None
        if self.mode == "bad_kv":
            del params["remote_block_ids"]
        self.ledger.issue(rid, params)
        if self.mode == "null_kv":
            params = None
        return web.json_response(_completion(rid, self.model, "messages" in body, "x", len(key), 1, params))


def _completion(rid: str, model: str, chat: bool, text: str, prompt_tokens: int, completion_tokens: int,
                kv: Any) -> dict[str, Any]:
    """A non-streamed OpenAI completion (or chat completion) body as vLLM returns it."""
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    )
    return {
        "id": f"cmpl-{rid}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "kv_transfer_params": kv,
    }


@dataclass
class FakeDecode(_Base):
    """Fake D. ``mode``: ok | error_500 | drop_mid_stream (after ``drop_after`` chunks, waits for ``release``, then
    writes half an event and kills the connection) | no_done (ends cleanly without ``[DONE]``) | slow_first_byte (headers, then
    ``first_byte_delay_s`` of silence) | hold (one chunk, then waits for ``release``) | not_json (200 with an HTML
    body, streamed or not) | bad_event (one good event, then ``data: <garbage>``) | huge_event (one good event, then
    ``huge_event_bytes`` of one event without a separator, then a clean end).

    Like vLLM, D refuses (400) ``max_tokens`` < 1 and ``min_tokens`` > ``max_tokens``.

    ``strict``: a request without ``kv_transfer_params`` is a violation (False: served as a local request, which
    the benchmark's direct baseline needs).
    """

    mode: DecodeMode = "ok"
    strict: bool = True
    token_delay_s: float = 0.0
    first_byte_delay_s: float = 0.0
    drop_after: int = 2
    huge_event_bytes: int = 1 << 20
    release: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when a "hold" stream has sent its first chunk.
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    role: str = "decode"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, rid = await self._intake(request)
        kv = body.get("kv_transfer_params")
        if kv is None:
            if self.strict:
                return self._violation("no kv_transfer_params: the prompt would be recomputed")
        elif not self.ledger.consume(rid, kv):
            return self._violation(f"kv_transfer_params not issued by P for X-Request-Id {rid!r}: {kv!r}")
        if self.mode == "error_500":
            return web.json_response(
                {"error": {"message": "KV load failed", "type": "InternalServerError", "code": 500}}, status=500
            )
        key = prompt_key(body)
        n = body.get("max_completion_tokens") or body.get("max_tokens")
        n = 16 if n is None else n
        n = int(n) if isinstance(n, float) and n.is_integer() else n  # pydantic's lax int, as vLLM parses it
        if not isinstance(n, int) or n < 1 or (body.get("min_tokens") or 0) > n:
            return web.json_response(
                {"error": {"message": f"max_tokens must be at least 1 and >= min_tokens, got {n}",
                           "type": "BadRequestError", "code": 400}}, status=400)
        if self.mode == "not_json":
            return web.Response(text="<html>upstream proxy error</html>", content_type="application/json")
        chat = "messages" in body
        fake = {
            "request_id": rid,
            "remote_request_id": kv.get("remote_request_id") if isinstance(kv, dict) else None,
            "min_tokens": body.get("min_tokens"),
        }
        if body.get("stream") is True:
            try:
                return await self._stream(request, body, key, int(n), chat, fake)
            except (asyncio.CancelledError, ConnectionResetError):
                if self.mode != "drop_mid_stream":
                    self._observed_cancel()
                raise
        body_out = _completion(rid, self.model, chat, expected_text(key, int(n)), len(key), n, None)
        return web.json_response({**body_out, "fake": fake})

    async def _stream(
        self, request: web.Request, body: dict[str, Any], key: str, n: int, chat: bool, fake: dict[str, Any]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        if self.mode == "slow_first_byte":
            await asyncio.sleep(self.first_byte_delay_s)
        rid = fake["request_id"]
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(n):
            piece = token_text(key, i)
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                if chat
                else {"index": 0, "text": piece, "finish_reason": None}
            )
            if i == n - 1:
                choice["finish_reason"] = "length"
            chunk: dict[str, Any] = {"id": f"cmpl-{rid}", "object": obj, "model": self.model, "choices": [choice]}
            if i == 0:
                chunk["fake"] = fake
            if self.mode == "drop_mid_stream" and i == self.drop_after:
                await self.release.wait()  # let the test read what was sent so far, then die mid-event
                await resp.write(b'data: {"id": "truncated-ev')
                assert request.transport is not None
                request.transport.abort()
                await asyncio.sleep(3600)  # cancelled by the server once the connection is gone
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and self.mode == "bad_event":
                await resp.write(b"data: <html>oops</html>\n\n")
            if i == 0 and self.mode == "huge_event":
                piece_bytes = b"x" * 65536
                for _ in range(self.huge_event_bytes // len(piece_bytes)):
                    await resp.write(piece_bytes)
                await resp.write(b"\n\n")
            if i == 0 and self.mode == "hold":
                self.holding.set()
                await self.release.wait()
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        stream_options = body.get("stream_options") or {}
        if isinstance(stream_options, dict) and stream_options.get("include_usage"):
            usage = {"prompt_tokens": len(key), "completion_tokens": n, "total_tokens": len(key) + n}
            await resp.write(b"data: " + json.dumps({"id": f"cmpl-{rid}", "choices": [], "usage": usage}).encode()
                             + b"\n\n")
        if self.mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass
class RunningServer:
    runner: web.AppRunner
    url: str
    closed: bool = False

    async def close(self) -> None:
        """Stop serving (idempotent); afterwards connections to ``url`` are refused."""
        if not self.closed:
            self.closed = True
            await self.runner.cleanup()


async def start_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, handler_cancellation: bool = True
) -> RunningServer:
    """Serve ``app`` on ``host:port`` (0 = ephemeral); by default handlers are cancelled when their client leaves."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return RunningServer(runner, f"http://{bound_host}:{bound_port}")


# ------------------------------------------------------------------------------ harness

T = TypeVar("T")

#: Upper bound for one test's event loop; a hang fails the test instead of the whole run.
TEST_TIMEOUT_S = 90.0


def run(coro: Coroutine[Any, Any, T], timeout: float = TEST_TIMEOUT_S) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, step: float = 0.02) -> None:
    """Wait until ``predicate()`` holds (a condition, not a timing assertion: ``timeout`` only bounds a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s: {predicate}")
        await asyncio.sleep(step)


def parse_sse(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    events = []
    for block in raw.decode().replace("\r\n", "\n").split("\n\n"):
        lines = [ln[len("data:"):].strip() for ln in block.split("\n") if ln.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events


def stream_text(events: list[str], chat: bool = False) -> str:
    out = []
    for ev in events:
        if ev == "[DONE]":
            continue
        obj = json.loads(ev)
        for choice in obj.get("choices", []):
            out.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(out)


@dataclass
class Harness:
    ledger: KVLedger
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    url: str
    state: ProxyState
    client: aiohttp.ClientSession
    servers: list[RunningServer] = field(default_factory=list)
    p_servers: list[RunningServer] = field(default_factory=list)
    d_servers: list[RunningServer] = field(default_factory=list)

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, CIMultiDict[str], bytes]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, CIMultiDict(r.headers), await r.read()

    async def get(self, path: str, **kw: Any) -> tuple[int, bytes]:
        async with self.client.get(self.url + path, **kw) as r:
            return r.status, await r.read()

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value

    @property
    def p(self) -> FakePrefill:
        return self.prefills[0]

    @property
    def d(self) -> FakeDecode:
        return self.decodes[0]


@asynccontextmanager
async def harness(
    n_prefill: int = 1,
    n_decode: int = 1,
    *,
    extra_prefill_urls: tuple[str, ...] = (),
    extra_decode_urls: tuple[str, ...] = (),
    prefill_kw: dict[str, Any] | None = None,
    decode_kw: dict[str, Any] | None = None,
    proxy_handler_cancellation: bool = True,
    guarded: bool = True,
    **config_kw: Any,
) -> AsyncIterator[Harness]:
    """Fakes + proxy. ``extra_*_urls`` come FIRST in the proxy's lists (e.g. a URL nobody listens on).

    Health probes run once at proxy start-up, then every 600 s (i.e. not during a test) unless
    ``health_interval_s`` is given. ``guarded`` (default) serves the proxy as ``serve_proxy`` does, behind
    ``make_site``'s connection guard; ``guarded=False`` uses a plain site (``proxy_handler_cancellation`` applies).
    """
    ledger = KVLedger()
    prefills = [FakePrefill(ledger, **(prefill_kw or {})) for _ in range(n_prefill)]
    decodes = [FakeDecode(ledger, **(decode_kw or {})) for _ in range(n_decode)]
    servers = [await start_server(f.make_app()) for f in (*prefills, *decodes)]
    config_kw.setdefault("health_interval_s", 600.0)
    config_kw.setdefault("port", 0)
    config = ProxyConfig(
        prefill_urls=(*extra_prefill_urls, *(s.url for s in servers[:n_prefill])),
        decode_urls=(*extra_decode_urls, *(s.url for s in servers[n_prefill:])),
        **config_kw,
    )
    app = build_app(config)
    if guarded:  # as ``serve_proxy`` serves it: the client-connection guard in front
        runner = make_runner(app)
        await runner.setup()
        site = make_site(runner)
        await site.start()
        host, port = runner.addresses[0][:2]
        proxy = RunningServer(runner, f"http://{host}:{port}")
    else:
        proxy = await start_server(app, handler_cancellation=proxy_handler_cancellation)
    servers.append(proxy)
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        yield Harness(ledger, prefills, decodes, proxy.url, proxy_state(app), client, servers,
                      servers[:n_prefill], servers[n_prefill:n_prefill + n_decode])
    finally:
        await client.close()
        for f in decodes:
            f.release.set()
        for s in reversed(servers):
            await s.close()


def proxy_cli(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[ProxyConfig], str]:
    """``hybridpd proxy ARGS`` through the real entry point (error table, exit codes) with ``run_proxy`` replaced
    by a recorder: (exit code, the configs it would have served, stderr)."""
    from hybridpd_cli.main import main

    served: list[ProxyConfig] = []
    monkeypatch.setattr("hybridpd.launch.proxy.server.run_proxy", served.append)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["proxy", *args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    return code, served, err.getvalue()
