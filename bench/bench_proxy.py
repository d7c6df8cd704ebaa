"""Proxy overhead benchmark: fake vLLM P/D backends, three ways of reaching them, ratios against the direct baseline.

Rows (all measured in the same run, against the same backend process, by the same load generator):

  direct   client -> fake D, no P/D (the floor: what one HTTP hop to D costs)
  hybridpd client -> hybridpd.proxy (aiohttp) -> fake P, then fake D
  toy      client -> minimal re-implementation of vLLM's toy_proxy_server.py design (FastAPI + httpx + uvicorn)
           -> fake P, then fake D; only if fastapi, httpx and uvicorn are importable (otherwise the row is skipped)

Backends, the proxy under test and the load generator run in separate processes (the machine's cores are shared,
so absolute numbers depend on the box; compare the ratios). Every response is checked (text derived from the
prompt, ``data: [DONE]``, P/D pairing verified by the fake D): a wrong answer counts as an error.

    python bench/bench_proxy.py                      # ~20 s (per row: 2 s warm-up, then at most 4 s measured)
    python bench/bench_proxy.py --requests 5000 --concurrency 64 --tokens 32 --no-stream
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridpd.proxy.fakes import (  # noqa: E402
    FakeDecode,
    FakePrefill,
    KVLedger,
    expected_text,
    start_server,
    unused_port,
)

TOY_MODULES = ("fastapi", "httpx", "uvicorn")


# ----------------------------------------------------------------------------------------------- child processes


async def _serve_fakes() -> None:
    ledger = KVLedger()
    p = FakePrefill(ledger, record=False)
    d = FakeDecode(ledger, strict=False, record=False)  # direct requests carry no kv_transfer_params
    ps, ds = await start_server(p.make_app()), await start_server(d.make_app())
    print(f"READY {ps.url} {ds.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    bad = len(p.violations) + len(d.violations)
    print(f"VIOLATIONS {bad} {json.dumps((p.violations + d.violations)[:3])}", flush=True)
    await ps.close()
    await ds.close()


def _serve_hybridpd(prefill: str, decode: str, port: int) -> None:
    import logging

    from hybridpd.proxy import ProxyConfig, run_proxy

    logging.basicConfig(level=logging.WARNING)
    run_proxy(ProxyConfig(prefill_urls=(prefill,), decode_urls=(decode,), port=port))


def _serve_toy(prefill: str, decode: str, port: int) -> None:
    """vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py design, reduced to one P and one D."""
    from contextlib import asynccontextmanager

    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients["p"] = httpx.AsyncClient(timeout=None, base_url=f"{prefill}/v1", limits=limits)
        clients["d"] = httpx.AsyncClient(timeout=None, base_url=f"{decode}/v1", limits=limits)
        yield
        for c in clients.values():
            await c.aclose()

    app = FastAPI(lifespan=lifespan)

    async def handle(api: str, request: Request) -> StreamingResponse:
        req_data = await request.json()
        request_id = str(uuid.uuid4())
        p_data = dict(req_data)
        p_data["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        p_data["stream"] = False
        p_data["max_tokens"] = 1
        if "max_completion_tokens" in p_data:
            p_data["max_completion_tokens"] = 1
        p_data.pop("stream_options", None)
        p_data.pop("min_tokens", None)
        p_data.pop("min_completion_tokens", None)
        headers = {"X-Request-Id": request_id}
        response = await clients["p"].post(api, json=p_data, headers=headers)
        response.raise_for_status()
        kv = response.json().get("kv_transfer_params", {})
        if kv:
            req_data["kv_transfer_params"] = kv

        async def generate() -> AsyncIterator[bytes]:
            async with clients["d"].stream("POST", api, json=req_data, headers=headers) as resp:
                resp.raise_for_status()
                async for chunk in resp.aiter_bytes():
                    yield chunk

        return StreamingResponse(generate(), media_type="application/json")

    async def completions(request: Request) -> StreamingResponse:
        return await handle("/completions", request)

    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # This module postpones annotations (strings); FastAPI resolves them in module globals, where Request is not.
    completions.__annotations__ = {"request": Request, "return": StreamingResponse}
    app.post("/v1/completions")(completions)
    app.get("/health")(health)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ----------------------------------------------------------------------------------------------- load generator


@dataclass
class Row:
    name: str
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    wall: float = 0.0
    skipped: str | None = None
    capped: bool = False

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    def pct(self, q: float, data: list[float] | None = None) -> float:
        values = sorted(self.latencies if data is None else data)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def _one(session: aiohttp.ClientSession, url: str, i: int, tokens: int, stream: bool, row: Row) -> None:
    prompt = f"bench prompt {i}"
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": tokens, "stream": stream}
    t0 = time.perf_counter()
    ttfb = None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if stream:
                buf = b""
                async for chunk in r.content.iter_any():
                    if ttfb is None:
                        ttfb = time.perf_counter() - t0
                    buf += chunk
                raw = buf
            else:
                raw = await r.read()
                ttfb = time.perf_counter() - t0
            status = r.status
        elapsed = time.perf_counter() - t0
        want = expected_text(prompt, tokens)
        if status != 200:
            raise ValueError(f"HTTP {status}: {raw[:200]!r}")
        if stream:
            events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                raise ValueError(f"stream did not end with [DONE]: {events[-1:]}")
            got = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        else:
            got = json.loads(raw)["choices"][0]["text"]
        if got != want:
            raise ValueError(f"wrong text {got[:60]!r}")
    except (aiohttp.ClientError, ValueError, KeyError, asyncio.TimeoutError) as exc:
        row.errors += 1
        row.first_error = row.first_error or f"{type(exc).__name__}: {exc}"
        return
    row.latencies.append(elapsed)
    row.ttfbs.append(ttfb or elapsed)


async def _run_workers(
    session: aiohttp.ClientSession, url: str, row: Row, *, first: int, requests: int, concurrency: int, tokens: int,
    stream: bool, max_seconds: float,
) -> None:
    counter = iter(range(first, first + requests))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in counter:
            if time.perf_counter() - t0 > max_seconds:
                row.capped = True
                return
            await _one(session, url, i, tokens, stream, row)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    row.wall = time.perf_counter() - t0


async def _load(
    url: str, row: Row, *, requests: int, concurrency: int, tokens: int, stream: bool, warmup_seconds: float,
    max_seconds: float,
) -> None:
    """Warm up at full concurrency (connection pools grow, caches fill), then measure."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        scratch = Row("warmup")
        await _run_workers(session, url, scratch, first=10**9, requests=10**9, concurrency=concurrency,
                           tokens=tokens, stream=stream, max_seconds=warmup_seconds)
        if scratch.errors:
            row.errors += scratch.errors
            row.first_error = scratch.first_error
            return
        await _run_workers(session, url, row, first=0, requests=requests, concurrency=concurrency, tokens=tokens,
                           stream=stream, max_seconds=max_seconds)


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: server exited with {proc.returncode}")
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, env=env)


def _stop(proc: subprocess.Popen[bytes]) -> bytes:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
            return out
        except subprocess.TimeoutExpired:
            proc.kill()
    out, _ = proc.communicate()
    return out


async def _bench(args: argparse.Namespace) -> int:
    load = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "stream": args.stream,
        "warmup_seconds": args.warmup_seconds,
        "max_seconds": args.max_seconds,
    }
    fakes = _spawn("--serve-fakes")
    rows: list[Row] = []
    try:
        assert fakes.stdout is not None
        ready = fakes.stdout.readline().decode().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError(f"fake backends did not start: {ready}")
        p_url, d_url = ready[1], ready[2]

        direct = Row("direct -> fake D (no P/D)")
        await _load(d_url, direct, **load)
        rows.append(direct)

        servers: list[tuple[str, str, str | None]] = [("hybridpd.proxy (aiohttp)", "--serve-hybridpd", None)]
        missing = [m for m in TOY_MODULES if importlib.util.find_spec(m) is None]
        servers.append(("vLLM toy design (FastAPI+httpx)", "--serve-toy", ", ".join(missing) or None))
        for name, flag, skip in servers:
            row = Row(name)
            rows.append(row)
            if skip:
                row.skipped = f"skipped: {skip} not importable"
                continue
            port = unused_port()
            proc = _spawn(flag, p_url, d_url, str(port))
            try:
                await _wait_healthy(f"http://127.0.0.1:{port}", proc)
                await _load(f"http://127.0.0.1:{port}", row, **load)
            finally:
                _stop(proc)
    finally:
        out = _stop(fakes).decode()
    violations = next((ln for ln in out.splitlines() if ln.startswith("VIOLATIONS")), "VIOLATIONS ?")

    base = rows[0]
    print(
        f"\nproxy benchmark: {args.requests} requests/row, concurrency {args.concurrency}, "
        f"{'streaming' if args.stream else 'non-streaming'}, {args.tokens} tokens/answer, "
        f"{os.cpu_count()} CPUs shared by load generator, proxy and fake backends"
    )
    header = (
        f"{'path':34} {'done':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ttfb p50':>9} {'errors':>6}"
        f" {'req/s / direct':>15} {'p50 / direct':>13}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.skipped:
            print(f"{row.name:34} {row.skipped}")
            continue
        ratio_rps = row.rps / base.rps if base.rps else float("nan")
        ratio_p50 = row.pct(0.5) / base.pct(0.5) if base.latencies else float("nan")
        done = f"{len(row.latencies):5d}{'*' if row.capped else ' '}"
        print(
            f"{row.name:34} {done} {row.rps:8.0f} {row.pct(0.5):8.1f} {row.pct(0.99):8.1f}"
            f" {row.pct(0.5, row.ttfbs):9.1f} {row.errors:6d} {ratio_rps:15.2f} {ratio_p50:13.2f}"
        )
        if row.first_error:
            print(f"    first error: {row.first_error}")
    mean = statistics.fmean(base.latencies) * 1000 if base.latencies else float("nan")
    if any(r.capped for r in rows):
        print(f"* stopped after --max-seconds {args.max_seconds:g} (rates stay comparable)")
    print(f"(direct mean latency {mean:.1f} ms; fake-backend protocol violations: {violations.split(' ', 1)[1]})")
    failed = any(r.errors for r in rows) or not violations.startswith("VIOLATIONS 0")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="measured requests per row (default 2000)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent client requests (default 32)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer (SSE events when streaming)")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    ap.add_argument("--max-seconds", type=float, default=4.0, help="stop a row after this long (default 4)")
    ap.add_argument("--warmup-seconds", type=float, default=2.0, help="unmeasured warm-up per row (default 2)")
    ap.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-hybridpd", nargs=3, metavar=("P", "D", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-toy", nargs=3, metavar=("P", "D", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_fakes:
        asyncio.run(_serve_fakes())
        return 0
    if args.serve_hybridpd:
        _serve_hybridpd(args.serve_hybridpd[0], args.serve_hybridpd[1], int(args.serve_hybridpd[2]))
        return 0
    if args.serve_toy:
        _serve_toy(args.serve_toy[0], args.serve_toy[1], int(args.serve_toy[2]))
        return 0
    if args.requests < 1 or args.concurrency < 1 or args.tokens < 1:
        ap.error("--requests, --concurrency and --tokens must be >= 1")
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    sys.exit(main())
