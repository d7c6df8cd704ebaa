"""``python -m hybridpd.launch.proxy --prefill URL [--prefill URL...] --decode URL [...]``.

API keys come from the environment (not argv, which other users can read): ``HYBRIDPD_PROXY_API_KEY`` (required
from clients), ``HYBRIDPD_PROXY_BACKEND_API_KEY`` (sent to the vLLM backends) and
``HYBRIDPD_PROXY_METRICS_API_KEY`` (required on /metrics; default: the client key).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from hybridpd.errors import UsageError
from hybridpd.launch.proxy.config import EVENT_LOOPS, POLICIES, ProxyConfig
from hybridpd.launch.proxy.server import run_proxy


def build_parser() -> argparse.ArgumentParser:
    defaults = ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",))
    p = argparse.ArgumentParser(
        prog="python -m hybridpd.launch.proxy",
        description="P/D routing proxy for vLLM + NixlConnector (OpenAI /v1/completions and /v1/chat/completions).",
        epilog="API keys: HYBRIDPD_PROXY_API_KEY (required from clients), HYBRIDPD_PROXY_BACKEND_API_KEY (sent to "
               "vLLM), HYBRIDPD_PROXY_METRICS_API_KEY (required on /metrics; default: the client key).",
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="prefill vLLM server root")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="decode vLLM server root")
    p.add_argument("--host", default=defaults.host, help="listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.port, help="listen port (default %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default=defaults.policy, help="backend selection (default %(default)s)")
    p.add_argument("--prefill-timeout", type=float, default=defaults.prefill_timeout_s, metavar="S",
                   help="whole prefill leg; exceeded -> 504 (default %(default)s)")
    p.add_argument("--decode-first-byte-timeout", type=float, default=defaults.decode_first_byte_timeout_s,
                   metavar="S", help="streams: until D's first byte; exceeded -> 504 (default %(default)s)")
    p.add_argument("--decode-idle-timeout", type=float, default=defaults.decode_idle_timeout_s, metavar="S",
                   help="streams: longest gap between chunks (default %(default)s)")
    p.add_argument("--decode-timeout", type=float, default=defaults.decode_timeout_s, metavar="S",
                   help="whole decode leg (default %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=defaults.connect_timeout_s, metavar="S",
                   help="TCP connect to a backend; failure ejects it (default %(default)s)")
    p.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s, metavar="S",
                   help="client: complete request headers within S of the first byte (default %(default)s)")
    p.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s, metavar="S",
                   help="client: whole request body within S; exceeded -> 408 (default %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout_s, metavar="S",
                   help="client: close a connection idle this long (default %(default)s)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="client connections; beyond, the longest-idle is closed, else 503 "
                        "(default: half the open-file limit)")
    p.add_argument("--max-sse-event-bytes", type=int, default=defaults.max_sse_event_bytes, metavar="N",
                   help="largest SSE event accepted from decode (default %(default)s)")
    p.add_argument("--expose-backend-errors", action="store_true",
                   help="quote backend URLs and error text in client errors (default: log only)")
    p.add_argument("--health-interval", type=float, default=defaults.health_interval_s, metavar="S",
                   help="GET /health period per backend (default %(default)s)")
    p.add_argument("--health-timeout", type=float, default=defaults.health_timeout_s, metavar="S",
                   help="one backend health probe (default %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes, metavar="N",
                   help="larger bodies -> 413 (default %(default)s)")
    p.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace_s, metavar="S",
                   help="on SIGTERM: requests in flight may finish this long, then streams end with an error "
                        "event (default %(default)s)")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=defaults.event_loop,
                   help="auto: uvloop if installed (faster), else asyncio (default %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (logger hybridpd.launch.proxy.access)")
    p.add_argument("--log-level", default="INFO", help="default %(default)s")
    return p


def config_from_args(a: argparse.Namespace) -> ProxyConfig:
    """The ``ProxyConfig`` for parsed arguments; raises ``ProxyConfigError`` (a ``UsageError``) on bad values."""
    return ProxyConfig(
        prefill_urls=tuple(a.prefill),
        decode_urls=tuple(a.decode),
        host=a.host,
        port=a.port,
        policy=a.policy,
        prefill_timeout_s=a.prefill_timeout,
        decode_first_byte_timeout_s=a.decode_first_byte_timeout,
        decode_idle_timeout_s=a.decode_idle_timeout,
        decode_timeout_s=a.decode_timeout,
        connect_timeout_s=a.connect_timeout,
        header_timeout_s=a.header_timeout,
        body_timeout_s=a.body_timeout,
        idle_timeout_s=a.idle_timeout,
        max_connections=a.max_connections,
        max_sse_event_bytes=a.max_sse_event_bytes,
        expose_backend_errors=a.expose_backend_errors,
        health_interval_s=a.health_interval,
        health_timeout_s=a.health_timeout,
        shutdown_grace_s=a.shutdown_grace,
        event_loop=a.event_loop,
        max_request_bytes=a.max_request_bytes,
        api_key=os.environ.get("HYBRIDPD_PROXY_API_KEY") or None,
        backend_api_key=os.environ.get("HYBRIDPD_PROXY_BACKEND_API_KEY") or None,
        metrics_api_key=os.environ.get("HYBRIDPD_PROXY_METRICS_API_KEY") or None,
        access_log=a.access_log,
    )


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    return config_from_args(build_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        run_proxy(config)
    except UsageError as exc:  # e.g. --event-loop uvloop without uvloop installed
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # typically: address already in use
        print(f"error: cannot serve on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
