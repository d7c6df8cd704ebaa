"""live.run_probe against fake in-process P, D and proxy servers (aiohttp) serving /metrics and the P/D protocol."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from test_metrics import text  # tests/ is on sys.path (rootdir conftest)

from hybridpd import live, metrics
from hybridpd.plan import build_plan
from hybridpd.settings import EngineSettings


class FakePD:
    """D's counters rise by the plan's prediction (or a corrupted one) for each request it receives."""

    def __init__(self, plan: Any, *, short_bytes: int = 0) -> None:
        self.plan = plan
        self.short = short_bytes
        self.sum = self.count = self.descs = 0.0
        self.requests: list[dict[str, Any]] = []

    def _n(self, body: dict[str, Any]) -> int:
        p = body["prompt"]
        return len(p)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=text(self.sum, self.count, self.descs))

    async def prefill(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.requests.append(("P", body))
        assert body["max_tokens"] == 1 and body["kv_transfer_params"]["do_remote_decode"] is True
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "remote_num_tokens": self._n(body)}})

    async def decode(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.requests.append(("D", body))
        assert body["kv_transfer_params"]["do_remote_prefill"] is True
        t = self.plan.transfer_for(self._n(body))
        self.sum += t.bytes - self.short
        self.count += t.reads
        self.descs += t.descriptors
        return web.json_response({"choices": [{"text": "y"}]})

    async def proxy(self, req: web.Request) -> web.Response:
        body = await req.json()
        t = self.plan.transfer_for(len(body["prompt"]))
        self.sum += t.bytes
        self.count += t.reads
        self.descs += t.descriptors_min
        return web.json_response({"choices": [{"text": "z"}]})


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def serve() -> Iterator[Any]:
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    runners: list[web.AppRunner] = []

    def start(routes: list[tuple[str, str, Any]]) -> str:
        app = web.Application()
        for method, path, h in routes:
            app.router.add_route(method, path, h)
        runner = web.AppRunner(app)
        port = _port()

        async def go() -> None:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()

        asyncio.run_coroutine_threadsafe(go(), loop).result(10)
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for r in runners:
        asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)


def _plan(tiny: dict[str, Path], model: str = "nemoh", dtp: int = 1) -> Any:
    return build_plan(str(tiny[model]), prefill=EngineSettings(tp=1), decode=EngineSettings(tp=dtp), platform="cpu")


def _servers(serve: Any, fake: FakePD) -> tuple[str, str, str]:
    d = serve([("GET", "/metrics", fake.metrics), ("POST", "/v1/completions", fake.decode)])
    p = serve([("POST", "/v1/completions", fake.prefill)])
    x = serve([("POST", "/v1/completions", fake.proxy)])
    return d, p, x


def test_probe_via_prefill_healthy(serve: Any, tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    fake = FakePD(plan)
    d, p, _ = _servers(serve, fake)
    r = live.run_probe(d, p, plan, 54, "m")
    assert r["ok"], r["mismatches"]
    assert r["moved_bytes"] == plan.transfer_for(54).bytes
    (_, pb), (_, db) = fake.requests
    assert pb["prompt"] == live.prompt_ids(54) and len(db["prompt"]) == 54
    assert db["kv_transfer_params"]["remote_num_tokens"] == 54  # P's params passed on unchanged


def test_probe_via_proxy(serve: Any, tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    d, _, x = _servers(serve, FakePD(plan))
    r = live.run_probe(d, x, plan, 100, "m", proxy=True)
    assert r["ok"], r["mismatches"]


def test_probe_detects_short_transfer(serve: Any, tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    d, p, _ = _servers(serve, FakePD(plan, short_bytes=96))
    r = live.run_probe(d, p, plan, 54, "m")
    assert not r["ok"] and any("bytes" in m for m in r["mismatches"])


def test_cli_live_json_unhealthy_on_error_finding(serve: Any, tiny_models: dict[str, Path]) -> None:
    from click.testing import CliRunner
    from hybridpd_cli.main import cli

    plan = _plan(tiny_models, "granite", 2)
    d, p, _ = _servers(serve, FakePD(plan))
    r = CliRunner().invoke(cli, ["verify", str(tiny_models["granite"]), "--ptp", "1", "--dtp", "2", "--platform",
                                 "cpu", "--no-cpu-avx512-bf16", "--decode", d, "--prefill", p, "--prompt-tokens",
                                 "--json"])
    assert r.exit_code == 1, r.output
    import json

    data = json.loads(r.stdout)
    assert data["ok"] is False and data["plan_errors"]
    assert all(pr["moved_bytes"] == pr["expected_bytes"] for pr in data["probes"])  # bytes match, still unhealthy
    assert metrics.POOLING_NOTE == data["note"]
