"""Proxy overhead benchmark: fake vLLM P/D backends, reached directly and through two P/D routers.

Rows, measured in one run against the same fake backend process by the same load generator, for every
combination of concurrency (default 1, 16, 64) and streaming (SSE) or not:

  direct       client -> fake D, no P/D (the floor: one HTTP hop to D)
  hybridpd     client -> hybridpd's proxy (aiohttp) -> fake P, then fake D
  vllm-router  client -> vllm-router (Rust, PyPI ``vllm-router``, ``--vllm-pd-disaggregation``) -> fake P, then D
  toy          (``--with-toy``) vLLM's toy_proxy_server.py design (FastAPI + httpx + uvicorn), if importable

Reported per row: requests/s, p50/p99 latency, the latency each router ADDS over direct (p50, p99), and the CPU
time the router process spent per request (all threads; from /proc, robust to a busy machine); then the
hybridpd/vllm-router ratios: added p50, added p99, CPU per request (lower is better, 1.0 = equal) and throughput
(higher is better).
Backends, each router and the load generator run in separate processes (the machine's cores are shared, so
absolute numbers depend on the box; compare the ratios). Every answer is checked (text derived from the prompt,
``data: [DONE]``, P/D pairing verified by the fake D): a wrong answer counts as an error.

    python bench/bench_proxy.py                                   # ~2 min: 3 concurrencies x 2 modes x 3 rows
    python bench/bench_proxy.py --concurrency 64 --no-stream --max-seconds 10
    python bench/bench_proxy.py --vllm-router /path/to/vllm-router --json out.json
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
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # the fake P/D servers live with the tests (tests/proxy_fakes.py)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from proxy_fakes import (  # noqa: E402
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
    p = FakePrefill(ledger, record=False, require_request_id=False)  # vllm-router sends its id as x-request-id
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


async def _serve_one_fake(role: str) -> None:
    """One fake backend alone in this process (for --health-detect: killing it kills only that backend)."""
    ledger = KVLedger()
    fake = FakePrefill(ledger, record=False) if role == "prefill" else FakeDecode(ledger, record=False)
    server = await start_server(fake.make_app())
    print(f"READY {server.url}", flush=True)
    await asyncio.Event().wait()


async def _health_detect(args: argparse.Namespace) -> int:
    """Seconds from SIGKILL (dead) or SIGSTOP (hung) of the fake D process until the proxy's /health says 503,
    polled every 20 ms like a supervisor would, with the proxy's default health settings."""
    from hybridpd.launch.proxy import ProxyConfig

    defaults = ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",))
    results = []
    for how in ("SIGKILL", "SIGSTOP"):
        p = _spawn("--serve-one-fake", "prefill")
        d = _spawn("--serve-one-fake", "decode")
        assert p.stdout is not None and d.stdout is not None
        p_url, d_url = p.stdout.readline().decode().split()[1], d.stdout.readline().decode().split()[1]
        port = unused_port()
        proxy = _spawn("--serve-hybridpd", p_url, d_url, str(port))
        url = f"http://127.0.0.1:{port}"
        try:
            await _wait_healthy(url, proxy)
            async with aiohttp.ClientSession() as s:
                await asyncio.sleep(1.0)
                t0 = time.perf_counter()
                d.send_signal(getattr(signal, how))
                while True:
                    try:
                        async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                            if r.status == 503:
                                break
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        pass
                    await asyncio.sleep(0.02)
                results.append((how, time.perf_counter() - t0))
        finally:
            if how == "SIGSTOP":
                d.send_signal(signal.SIGCONT)
            for proc in (proxy, p, d):
                _stop(proc)
    print(f"\n/health after decode dies (proxy defaults: health_interval_s={defaults.health_interval_s}, "
          f"health_timeout_s={defaults.health_timeout_s}, unhealthy_after={defaults.unhealthy_after}, "
          f"health_max_age_s={getattr(defaults, 'health_max_age_s', None)})")
    for how, seconds in results:
        print(f"  decode {'killed (SIGKILL)' if how == 'SIGKILL' else 'hung (SIGSTOP)':18} -> 503 after {seconds:6.2f} s")
    return 0


def _serve_hybridpd(prefill: str, decode: str, port: int) -> None:
    import logging

    from hybridpd.launch.proxy import ProxyConfig, run_proxy

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
    #: CPU seconds the router process (all its threads) used during the measured part; None = not a router.
    cpu_s: float | None = None

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / len(self.latencies) * 1e6 if self.cpu_s is not None and self.latencies else float("nan")

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


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all threads (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    url: str, row: Row, *, requests: int, concurrency: int, tokens: int, stream: bool, warmup_seconds: float,
    max_seconds: float, pid: int | None = None,
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
        cpu0 = _cpu_seconds(pid) if pid else 0.0
        await _run_workers(session, url, row, first=0, requests=requests, concurrency=concurrency, tokens=tokens,
                           stream=stream, max_seconds=max_seconds)
        if pid:
            row.cpu_s = _cpu_seconds(pid) - cpu0


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


def _router_exe(explicit: str | None) -> str | None:
    try:
        from hybridpd.launch.proxy.router import find_vllm_router

        return find_vllm_router(explicit)
    except Exception:
        local = ROOT / ".venv-router" / "bin" / "vllm-router"
        return str(local) if local.exists() else None


def _spawn_router(exe: str, p_url: str, d_url: str, port: int) -> subprocess.Popen[bytes]:
    from hybridpd.launch.proxy.router import vllm_router_argv

    argv = vllm_router_argv(exe, host="127.0.0.1", port=port, prefill_urls=[p_url], decode_urls=[d_url],
                            prometheus_port=unused_port(), log_level="error")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass
class Cell:
    stream: bool
    concurrency: int
    rows: dict[str, Row]


def _added(row: Row, direct: Row, q: float) -> float:
    return row.pct(q) - direct.pct(q)


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


async def _measure(url: str, name: str, args: argparse.Namespace, stream: bool, concurrency: int,
                   pid: int | None) -> Row:
    row = Row(name)
    await _load(url, row, requests=args.requests, concurrency=concurrency, tokens=args.tokens, stream=stream,
                warmup_seconds=args.warmup_seconds, max_seconds=args.max_seconds, pid=pid)
    return row


async def _bench(args: argparse.Namespace) -> int:
    fakes = _spawn("--serve-fakes")
    procs: list[subprocess.Popen[bytes]] = []
    cells: list[Cell] = []
    routers: dict[str, str | None] = {}  # name -> url, None = skipped
    skipped: dict[str, str] = {}
    try:
        assert fakes.stdout is not None
        ready = fakes.stdout.readline().decode().split()
        if not ready or ready[0] != "READY":
            raise RuntimeError(f"fake backends did not start: {ready}")
        p_url, d_url = ready[1], ready[2]
        routers["direct"] = d_url
        port = unused_port()
        procs.append(_spawn("--serve-hybridpd", p_url, d_url, str(port)))
        routers["hybridpd"] = f"http://127.0.0.1:{port}"
        exe = _router_exe(args.vllm_router)
        if exe is None:
            skipped["vllm-router"] = "vllm-router not found (pip install vllm-router; --vllm-router PATH)"
        else:
            port = unused_port()
            procs.append(_spawn_router(exe, p_url, d_url, port))
            routers["vllm-router"] = f"http://127.0.0.1:{port}"
        if args.with_toy:
            missing = [m for m in TOY_MODULES if importlib.util.find_spec(m) is None]
            if missing:
                skipped["toy"] = f"{', '.join(missing)} not importable"
            else:
                port = unused_port()
                procs.append(_spawn("--serve-toy", p_url, d_url, str(port)))
                routers["toy"] = f"http://127.0.0.1:{port}"
        pids: dict[str, int] = {}
        for proc, name in zip(procs, [n for n in routers if n != "direct"], strict=True):
            await _wait_healthy(routers[name] or "", proc)
            pids[name] = proc.pid
        names = list(routers)
        for rep in range(args.repeat):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no path always first
            for stream in args.modes:
                for concurrency in args.concurrency:
                    cell = Cell(stream, concurrency, {})
                    for name in order:
                        cell.rows[name] = await _measure(routers[name] or "", name, args, stream, concurrency,
                                                         pids.get(name))
                    cell.rows = {n: cell.rows[n] for n in names}
                    cells.append(cell)
    finally:
        for proc in procs:
            _stop(proc)
        out = _stop(fakes).decode()
    violations = next((ln for ln in out.splitlines() if ln.startswith("VIOLATIONS")), "VIOLATIONS ?")
    _report(args, cells, skipped, violations)
    failed = any(r.errors for c in cells for r in c.rows.values()) or not violations.startswith("VIOLATIONS 0")
    return 1 if failed else 0


def _median(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def _report(args: argparse.Namespace, cells: list[Cell], skipped: dict[str, str], violations: str) -> None:
    """One line per (mode, concurrency, path): the MEDIAN over ``--repeat`` runs of each figure (ratios are
    medians of the per-run ratios), which a busy shared machine needs."""
    runs: dict[tuple[bool, int], list[Cell]] = {}
    for cell in cells:
        runs.setdefault((cell.stream, cell.concurrency), []).append(cell)
    print(f"\nproxy benchmark: {args.tokens} tokens/answer, per cell {args.warmup_seconds:g} s warm-up then at most "
          f"{args.requests} requests or {args.max_seconds:g} s, median of {args.repeat} run(s); {os.cpu_count()} CPUs "
          f"shared by load generator, routers and fake backends; hybridpd's event loop: "
          f"{'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}; load average "
          f"{os.getloadavg()[0]:.1f}")
    header = (f"{'mode':6} {'conc':>4} {'path':12} {'done':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
              f" {'+p50 ms':>8} {'+p99 ms':>8} {'cpu us/req':>10} {'errors':>6}")
    print(header)
    print("-" * len(header))
    summary = []
    rows_json = []
    for (stream, conc), group in runs.items():
        mode = "stream" if stream else "json"
        names = list(group[0].rows)
        for name in names:
            per = [(c.rows[name], c.rows["direct"]) for c in group]
            fig = {
                "requests": sum(len(r.latencies) for r, _ in per),
                "rps": _median([r.rps for r, _ in per]),
                "p50_ms": _median([r.pct(0.5) for r, _ in per]),
                "p99_ms": _median([r.pct(0.99) for r, _ in per]),
                "added_p50_ms": _median([_added(r, d, 0.5) for r, d in per]) if name != "direct" else 0.0,
                "added_p99_ms": _median([_added(r, d, 0.99) for r, d in per]) if name != "direct" else 0.0,
                "router_cpu_us_per_request": _median([r.cpu_us_per_request for r, _ in per]),
                "errors": sum(r.errors for r, _ in per),
            }
            rows_json.append({"stream": stream, "concurrency": conc, "path": name,
                              **{k: (None if v != v else v) for k, v in fig.items()}})  # NaN -> null
            print(f"{mode:6} {conc:4d} {name:12} {fig['requests']:6d} {fig['rps']:7.0f} {fig['p50_ms']:7.2f}"
                  f" {fig['p99_ms']:7.2f} {fig['added_p50_ms']:8.2f} {fig['added_p99_ms']:8.2f}"
                  f" {fig['router_cpu_us_per_request']:10.0f} {fig['errors']:6d}")
            first = next((r.first_error for r, _ in per if r.first_error), None)
            if first:
                print(f"    first error: {first}")
        if "hybridpd" in names and "vllm-router" in names:
            def med(f: Any, group: list[Cell] = group) -> float:
                return _median([f(c.rows["hybridpd"], c.rows["vllm-router"], c.rows["direct"]) for c in group])
            summary.append((mode, conc,
                            med(lambda o, t, d: _ratio(_added(o, d, 0.5), _added(t, d, 0.5))),
                            med(lambda o, t, d: _ratio(_added(o, d, 0.99), _added(t, d, 0.99))),
                            med(lambda o, t, d: _ratio(o.rps, t.rps)),
                            med(lambda o, t, d: _ratio(o.cpu_us_per_request, t.cpu_us_per_request))))
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    if summary:
        print("\nhybridpd / vllm-router (added latency and CPU: lower is better; throughput: higher is better)")
        print(f"{'mode':6} {'conc':>4} {'+p50 ratio':>10} {'+p99 ratio':>10} {'req/s ratio':>11} {'cpu/req ratio':>13}")
        for mode, conc, r50, r99, rps, cpu in summary:
            print(f"{mode:6} {conc:4d} {r50:10.2f} {r99:10.2f} {rps:11.2f} {cpu:13.2f}")
    if any(r.capped for c in cells for r in c.rows.values()):
        print(f"(cells stopped after --max-seconds {args.max_seconds:g}; rates stay comparable)")
    print(f"(fake-backend protocol violations: {violations.split(' ', 1)[1]})")
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({"rows": rows_json, "skipped": skipped, "repeat": args.repeat}, indent=1))
        tmp.replace(args.json)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000, help="measured requests per cell at most (default 5000)")
    ap.add_argument("--concurrency", type=_int_list, default=[1, 16, 64],
                    help="comma-separated concurrencies (default 1,16,64)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer (SSE events when streaming)")
    ap.add_argument("--stream", dest="modes", action="store_const", const=[True], default=[True, False],
                    help="streaming only (default: both)")
    ap.add_argument("--no-stream", dest="modes", action="store_const", const=[False], help="non-streaming only")
    ap.add_argument("--max-seconds", type=float, default=4.0, help="stop a cell's row after this long (default 4)")
    ap.add_argument("--warmup-seconds", type=float, default=1.0, help="unmeasured warm-up per row (default 1)")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole matrix N times, report medians")
    ap.add_argument("--vllm-router", default=None, help="vllm-router executable (default: found like serve does)")
    ap.add_argument("--with-toy", action="store_true", help="also vLLM's toy proxy design (fastapi/httpx/uvicorn)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--health-detect", action="store_true",
                    help="instead: how fast the proxy's /health reports a killed or hung decode")
    ap.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-one-fake", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-hybridpd", nargs=3, metavar=("P", "D", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-toy", nargs=3, metavar=("P", "D", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_fakes:
        asyncio.run(_serve_fakes())
        return 0
    if args.serve_one_fake:
        asyncio.run(_serve_one_fake(args.serve_one_fake))
        return 0
    if args.health_detect:
        return asyncio.run(_health_detect(args))
    if args.serve_hybridpd:
        _serve_hybridpd(args.serve_hybridpd[0], args.serve_hybridpd[1], int(args.serve_hybridpd[2]))
        return 0
    if args.serve_toy:
        _serve_toy(args.serve_toy[0], args.serve_toy[1], int(args.serve_toy[2]))
        return 0
    if args.requests < 1 or args.tokens < 1 or args.repeat < 1:
        ap.error("--requests, --tokens and --repeat must be >= 1")
    return asyncio.run(_bench(args))


if __name__ == "__main__":
    sys.exit(main())
