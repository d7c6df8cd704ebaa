"""``python -m hybridpd.proxy --prefill URL [--prefill URL...] --decode URL [...]``.

API keys come from the environment (not argv, which other users can read): ``HYBRIDPD_PROXY_API_KEY`` (required
from clients) and ``HYBRIDPD_PROXY_BACKEND_API_KEY`` (sent to the vLLM backends).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from hybridpd.errors import UsageError
from hybridpd.proxy.app import run_proxy
from hybridpd.proxy.config import POLICIES, ProxyConfig


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    defaults = ProxyConfig(prefill_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",))
    p = argparse.ArgumentParser(prog="python -m hybridpd.proxy", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="prefill vLLM server root")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="decode vLLM server root")
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=defaults.port)
    p.add_argument("--policy", choices=POLICIES, default=defaults.policy)
    p.add_argument("--prefill-timeout", type=float, default=defaults.prefill_timeout_s)
    p.add_argument("--decode-first-byte-timeout", type=float, default=defaults.decode_first_byte_timeout_s)
    p.add_argument("--decode-idle-timeout", type=float, default=defaults.decode_idle_timeout_s)
    p.add_argument("--decode-timeout", type=float, default=defaults.decode_timeout_s)
    p.add_argument("--health-interval", type=float, default=defaults.health_interval_s)
    p.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
        health_interval_s=a.health_interval,
        max_request_bytes=a.max_request_bytes,
        api_key=os.environ.get("HYBRIDPD_PROXY_API_KEY") or None,
        backend_api_key=os.environ.get("HYBRIDPD_PROXY_BACKEND_API_KEY") or None,
        access_log=a.access_log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        run_proxy(config)
    except OSError as exc:  # typically: address already in use
        print(f"error: cannot serve on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
