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

from hybridpd.core.plan import build_plan
from hybridpd.core.settings import EngineSettings
from hybridpd.verify import live, metrics


class FakePD:
    """D's counters rise by the plan's prediction (or a corrupted one) for each request it receives.

    ``prefix_cache=True``: D keeps a prefix cache of full blocks (a hash chain, as vLLM's block pool does). A
    prompt whose first ``k`` full blocks D already holds moves only the rest: the bytes of a request ``k*block``
    tokens shorter, none at all when every block it would read is held; the hits show in
    ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` like vLLM's own counters.
    ``actual``: the plan the deployment really runs (e.g. another block size); the bytes follow it.
    """

    def __init__(self, plan: Any, *, short_bytes: int = 0, prefix_cache: bool = False,
                 actual: Any = None) -> None:
        self.plan = actual or plan
        self.short = short_bytes
        self.sum = self.count = self.descs = 0.0
        self.requests: list[dict[str, Any]] = []
        self.prefix_cache = prefix_cache
        self.block = self.plan.prefill.block_size
        self.held: set[tuple[Any, ...]] = set()
        self.queries = self.hits = 0

    def _n(self, body: dict[str, Any]) -> int:
        p = body["prompt"]
        return len(p)

    def _move(self, prompt: Any) -> Any:
        """The transfer D needs for ``prompt`` after its local prefix-cache hits (None: nothing to read)."""
        n, b = len(prompt), self.block
        t = self.plan.transfer_for(n)
        if not self.prefix_cache:
            return t
        chains = [tuple(prompt[:k * b]) for k in range(1, t.tokens_transferred // b + 1)]
        hit = 0
        for c in chains:
            if c not in self.held:
                break
            hit += 1
        self.held.update(chains)
        self.queries += n
        self.hits += hit * b
        if hit == 0:
            return t
        if hit * b >= t.tokens_transferred:
            return None
        return self.plan.transfer_for(n - hit * b)

    async def metrics(self, _: web.Request) -> web.Response:
        extra = (f"vllm:prefix_cache_queries_total{{engine=\"0\"}} {float(self.queries)}\n"
                 f"vllm:prefix_cache_hits_total{{engine=\"0\"}} {float(self.hits)}\n")
        return web.Response(text=text(self.sum, self.count, self.descs, extra=extra))

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
        t = self._move(body["prompt"])
        if t is not None:
            self.sum += t.bytes - self.short
            self.count += t.reads
            self.descs += t.descriptors
        return web.json_response({"choices": [{"text": "y"}]})

    async def proxy(self, req: web.Request) -> web.Response:
        body = await req.json()
        t = self._move(body["prompt"])
        if t is not None:
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
    assert r.ok, r.mismatches
    assert r.comparison.moved_bytes == plan.transfer_for(54).bytes
    assert (r.isl, r.tokens_transferred) == (54, 53)  # N-1: P prefills 53 tokens, D computes the 54th
    (_, pb), (_, db) = fake.requests
    assert pb["prompt"] == db["prompt"] and len(db["prompt"]) == 54
    k = live.NONCE_TOKENS
    assert pb["prompt"][k:] == live.prompt_ids(54)[k:]  # a random start, then the fixed filler
    assert db["kv_transfer_params"]["remote_num_tokens"] == 54  # P's params passed on unchanged


def test_probe_via_proxy(serve: Any, tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    d, _, x = _servers(serve, FakePD(plan))
    r = live.run_probe(d, x, plan, 100, "m", proxy=True)
    assert r.ok, r.mismatches


def test_probe_detects_short_transfer(serve: Any, tiny_models: dict[str, Path]) -> None:
    plan = _plan(tiny_models)
    d, p, _ = _servers(serve, FakePD(plan, short_bytes=96))
    r = live.run_probe(d, p, plan, 54, "m")
    assert not r.ok and any("bytes" in m for m in r.mismatches)


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


@pytest.mark.parametrize("name,block", [("llama", 128), ("llama", 64), ("nemoh", 128), ("granite", 64),
                                        ("granite", 32)])
def test_default_probes_catch_a_wrong_block_size(tiny_models: dict[str, Path], name: str, block: int) -> None:
    """Issue #12: the default ISLs let a deployment at --block-size 64 pass a plan for 128 (ISL 96 moves 128
    tokens' worth either way). Every other block size the planner accepts must change the predicted bytes of at
    least one default probe — judged by the planner's own byte model for the other block size."""
    def plan_for(bs: int) -> Any:
        s = EngineSettings(block_size=bs, max_model_len=256, enable_prefix_caching=False)
        return build_plan(str(tiny_models[name]), prefill=s, decode=s, vllm_version="0.32", platform="cpu")

    plan = plan_for(block)
    assert plan.prefill.block_size == block
    isls, blind = live.choose_isls(plan)
    assert blind == [] and 1 <= len(isls) <= 3 and max(isls) <= 248
    tested = 0
    for other in range(32, 4 * block + 1, 32):
        alt = plan_for(other)
        if alt.prefill.block_size == block or alt.routes is None:
            continue  # the planner maps it to the same size (hybrid alignment) or refuses it
        tested += 1
        assert any(alt.transfer_for(n).bytes != plan.transfer_for(n).bytes for n in isls), (other, isls)
    assert tested >= 2


def test_default_probes_old_lengths_were_blind(tiny_models: dict[str, Path]) -> None:
    """The reproduction from the issue: ISL 96 cannot tell 64 from 128 (so a probe set must not rely on it)."""
    def plan_for(bs: int) -> Any:
        s = EngineSettings(block_size=bs, max_model_len=256)
        return build_plan(str(tiny_models["llama"]), prefill=s, decode=s, vllm_version="0.32", platform="cpu")

    p64, p128 = plan_for(64), plan_for(128)
    assert p64.transfer_for(96).bytes == p128.transfer_for(96).bytes
    assert any(p64.transfer_for(n).bytes != p128.transfer_for(n).bytes for n in live.default_isls(p64))


def test_default_probes_catch_a_wrong_dtype_or_tp(tiny_models: dict[str, Path]) -> None:
    """A wrong KV dtype changes the bytes of every default probe; a wrong D TP changes its READs (one per D rank)."""
    def plan_for(**kw: Any) -> Any:
        p = EngineSettings(max_model_len=256, enable_prefix_caching=False)
        d = EngineSettings(max_model_len=256, enable_prefix_caching=False, **kw)
        if "kv_cache_dtype" in kw:
            p = EngineSettings(max_model_len=256, enable_prefix_caching=False, kv_cache_dtype=kw["kv_cache_dtype"])
        return build_plan(str(tiny_models["llama"]), prefill=p, decode=d, vllm_version="0.32", platform="cpu")

    base = plan_for()
    isls = live.default_isls(base)
    fp8 = plan_for(kv_cache_dtype="fp8")
    assert all(fp8.transfer_for(n).bytes != base.transfer_for(n).bytes for n in isls)
    tp2 = plan_for(tp=2)
    assert all(tp2.transfer_for(n).reads != base.transfer_for(n).reads for n in isls)


def _three_runs(serve: Any, fake: FakePD, plan: Any, proxy: bool) -> list[live.LiveResult]:
    d, p, x = _servers(serve, fake)
    kw = {"proxy_url": x} if proxy else {"prefill_url": p}
    return [live.run_probes(d, plan, "m", **kw) for _ in range(3)]


@pytest.mark.parametrize("model", ["llama", "nemoh"])
@pytest.mark.parametrize("proxy", [False, True])
def test_verify_three_times_with_prefix_caching(serve: Any, tiny_models: dict[str, Path], model: str,
                                                proxy: bool) -> None:
    """Issue #27/#32: `verify` run 3 times against one healthy deployment with D's prefix cache on passes every
    time (each probe starts with a fresh nonce, so D holds none of its blocks)."""
    plan = _plan(tiny_models, model)
    fake = FakePD(plan, prefix_cache=True)
    runs = _three_runs(serve, fake, plan, proxy)
    assert [r.ok for r in runs] == [True] * 3, [r.probes[0].mismatches for r in runs]
    assert fake.queries > 0 and fake.hits == 0


@pytest.mark.parametrize("model", ["llama", "nemoh"])
def test_fixed_probes_fail_on_the_second_run(serve: Any, tiny_models: dict[str, Path], model: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The old fixed prompts: D's prefix cache serves the repeat, fewer bytes move, a healthy deployment fails."""
    monkeypatch.setattr(live, "new_nonce", lambda: [])
    plan = _plan(tiny_models, model)
    fake = FakePD(plan, prefix_cache=True)
    d, p, _ = _servers(serve, fake)
    live.run_probes(d, plan, "m", prefill_url=p)
    second = live.run_probes(d, plan, "m", prefill_url=p)
    assert not second.ok and fake.hits > 0


def test_verify_three_times_still_fails_for_a_wrong_block_size(serve: Any, tiny_models: dict[str, Path]) -> None:
    """A deployment at block 64 against a plan for 128, prefix cache on: every one of 3 runs fails on bytes."""
    def plan_for(bs: int) -> Any:
        s = EngineSettings(block_size=bs, max_model_len=256, enable_prefix_caching=False)
        return build_plan(str(tiny_models["llama"]), prefill=s, decode=s, vllm_version="0.32", platform="cpu")

    plan, wrong = plan_for(128), plan_for(64)
    assert wrong.prefill.block_size == 64
    runs = _three_runs(serve, FakePD(plan, prefix_cache=True, actual=wrong), plan, False)
    for r in runs:
        assert not r.ok and any("bytes" in m for pr in r.probes for m in pr.mismatches)


def test_cli_live_prints_its_assumptions(serve: Any, tiny_models: dict[str, Path]) -> None:
    """Issue #27: verify says what it assumed and where each came from, and what D itself reports (/version,
    /metrics vllm:cache_config_info), in --json (`assumptions`) and in the human output."""
    import json

    from click.testing import CliRunner
    from hybridpd_cli.main import cli

    plan = _plan(tiny_models, "llama")
    fake = FakePD(plan)

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def mets(req: web.Request) -> web.Response:
        r = await fake.metrics(req)
        info = f'vllm:cache_config_info{{block_size="{plan.prefill.block_size}",enable_prefix_caching="True"}} 1.0\n'
        return web.Response(text=str(r.text) + info)

    d = serve([("GET", "/metrics", mets), ("GET", "/version", version), ("POST", "/v1/completions", fake.decode)])
    p = serve([("POST", "/v1/completions", fake.prefill)])
    args = ["verify", str(tiny_models["llama"]), "--platform", "cpu", "--decode", d, "--prefill", p,
            "--prompt-tokens"]
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    a = json.loads(r.stdout)["assumptions"]
    assert a["vllm_version"]["deployment_reports"] == "0.32.0" and a["vllm_version"]["read_from"] == "/version"
    assert a["vllm_version"]["source"].startswith("assumed")  # no --vllm-version given
    assert a["block_size"] == {"value": plan.prefill.block_size, "source": a["block_size"]["source"],
                               "deployment_reports": plan.prefill.block_size,
                               "read_from": "/metrics vllm:cache_config_info", "differs": False}
    assert a["platform"] == {"value": "cpu", "source": "--platform", "deployment_reports": None, "read_from": None,
                             "differs": False}
    assert a["vllm_version"]["differs"] is (a["vllm_version"]["value"].split(".")[:2] != ["0", "32"])
    h = CliRunner().invoke(cli, [*args, "--fmt", "plain"])
    assert h.exit_code == 0, h.output
    assert "assumed vllm version" in h.stdout and "D reports 0.32.0 (/version)" in h.stdout
    assert f"D reports {plan.prefill.block_size} (/metrics vllm:cache_config_info)" in h.stdout
    r = CliRunner().invoke(cli, [*args, "--vllm-version", "0.26", "--json"])
    a = json.loads(r.stdout)["assumptions"]["vllm_version"]
    assert a["source"] == "--vllm-version" and a["value"].startswith("0.26") and a["differs"] is True
