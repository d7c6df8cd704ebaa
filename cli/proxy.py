"""`hybridpd proxy`: the P/D routing proxy in the foreground (what `serve` launches)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

import click

from hybridpd.errors import HybridPDError, UsageError
from hybridpd.launch.proxy.config import EVENT_LOOPS, POLICIES, ProxyConfig, ProxyConfigError

from ._options import FiniteFloatRange

#: The environment variables the API keys come from (not argv, which other users of the host can read).
KEY_ENV = {
    "api_key": "HYBRIDPD_PROXY_API_KEY",
    "backend_api_key": "HYBRIDPD_PROXY_BACKEND_API_KEY",
    "metrics_api_key": "HYBRIDPD_PROXY_METRICS_API_KEY",
}
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEFAULTS = {f.name: f.default for f in fields(ProxyConfig) if f.default is not MISSING}
_SECONDS = FiniteFloatRange(min=0, min_open=True)

# (option, ProxyConfig field, help) of the options in seconds; each default is the field's
_TIMES = (
    ("--prefill-timeout", "prefill_timeout_s", "Whole prefill leg; exceeded -> 504."),
    ("--decode-first-byte-timeout", "decode_first_byte_timeout_s", "Streams: until D's first byte; exceeded -> 504."),
    ("--decode-idle-timeout", "decode_idle_timeout_s", "Streams: longest gap between chunks."),
    ("--decode-timeout", "decode_timeout_s", "Whole decode leg."),
    ("--connect-timeout", "connect_timeout_s", "TCP connect to a backend; failure ejects it."),
    ("--header-timeout", "header_timeout_s", "Client: complete request headers within S of the first byte."),
    ("--body-timeout", "body_timeout_s", "Client: whole request body within S; exceeded -> 408."),
    ("--idle-timeout", "idle_timeout_s", "Client: close a connection idle this long."),
    ("--health-interval", "health_interval_s", "GET /health period per backend."),
    ("--health-timeout", "health_timeout_s", "One backend health probe."),
    ("--shutdown-grace", "shutdown_grace_s",
     "On SIGTERM: requests in flight may finish this long, then streams end with an error event."),
)


def _field(flag: str, name: str, type: Any, help: str, metavar: str | None = None) -> Callable[[Any], Any]:
    """An option stored under ProxyConfig field ``name``, defaulting to the field's default."""
    return click.option(flag, name, type=type, default=_DEFAULTS[name], show_default=True, metavar=metavar, help=help)


_OPTIONS: tuple[Callable[[Any], Any], ...] = (
    click.option("--prefill", "prefill_urls", multiple=True, required=True, metavar="URL",
                 help="Prefill vLLM server root, e.g. http://127.0.0.1:8100 (repeatable)."),
    click.option("--decode", "decode_urls", multiple=True, required=True, metavar="URL",
                 help="Decode vLLM server root (repeatable)."),
    _field("--host", "host", str, "Listen address."),
    _field("--port", "port", click.IntRange(0, 65535), "Listen port."),
    _field("--policy", "policy", click.Choice(POLICIES), "Backend selection."),
    *(_field(flag, name, _SECONDS, help, "S") for flag, name, help in _TIMES),
    click.option("--max-connections", "max_connections", type=click.IntRange(min=1), default=None, metavar="N",
                 help="Client connections; beyond, the longest-idle is closed, else 503 "
                      "(default: half the open-file limit)."),
    _field("--max-sse-event-bytes", "max_sse_event_bytes", click.IntRange(min=1024), "Largest SSE event accepted "
           "from decode.", "N"),
    _field("--max-request-bytes", "max_request_bytes", click.IntRange(min=1024), "Larger bodies -> 413.", "N"),
    click.option("--expose-backend-errors", "expose_backend_errors", is_flag=True,
                 help="Quote backend URLs and error text in client errors (default: log only)."),
    _field("--event-loop", "event_loop", click.Choice(EVENT_LOOPS),
           "auto: uvloop if installed (faster), else asyncio."),
    click.option("--access-log", "access_log", is_flag=True,
                 help="Log every request (logger hybridpd.launch.proxy.access)."),
    click.option("--no-auth", "no_auth", is_flag=True,
                 help="Run without client authentication (no HYBRIDPD_PROXY_API_KEY); logged at start."),
    click.option("--log-level", type=click.Choice(_LOG_LEVELS, case_sensitive=False), default="info",
                 show_default=True),
)


def _options(f: Any) -> Any:
    for option in reversed(_OPTIONS):
        f = option(f)
    return f


def api_keys_from_env(no_auth: bool) -> dict[str, str | None]:
    """The keys from the environment; one set but empty or blank is a usage error (never auth silently off)."""
    out: dict[str, str | None] = {}
    for name, env in KEY_ENV.items():
        value = os.environ.get(env)
        if value is not None and not value.strip() and not (no_auth and name == "api_key"):
            raise UsageError("is set but empty", field=env,
                             fix=f"set a key, or unset {env}" + (" and pass --no-auth (serve: --proxy-arg=--no-auth)"
                                                                 if name == "api_key" else ""))
        out[name] = value if value and value.strip() else None
    if no_auth:
        if out["api_key"] is not None:
            raise UsageError("--no-auth conflicts with a client key", field=KEY_ENV["api_key"],
                             fix=f"unset {KEY_ENV['api_key']} or drop --no-auth")
    return out


@click.command()
@_options
def proxy(log_level: str, no_auth: bool, **config: Any) -> None:
    """Run the P/D routing proxy in the foreground (what `serve` launches).

    Clients talk OpenAI (/v1/completions, /v1/chat/completions) to it; it runs the prefill on a P server and
    relays the decode from a D server (vLLM + NixlConnector). SIGTERM drains it (see --shutdown-grace).

    API keys come from the environment, not argv: HYBRIDPD_PROXY_API_KEY (required from clients),
    HYBRIDPD_PROXY_BACKEND_API_KEY (sent to vLLM), HYBRIDPD_PROXY_METRICS_API_KEY (required on /metrics;
    default: the client key). A key set but empty is refused; --no-auth runs without one (logged at start).

    \b
    Example:
      hybridpd proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    """
    from hybridpd.launch.proxy.server import run_proxy

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = api_keys_from_env(no_auth)
    try:
        cfg = ProxyConfig(**config, api_key=keys["api_key"], backend_api_key=keys["backend_api_key"],
                          metrics_api_key=keys["metrics_api_key"])
    except ProxyConfigError as e:  # name the flag (or variable) the user set, not the config field
        flags = {p.name: p.opts[0] for p in proxy.params}
        where = flags.get(e.field or "") or KEY_ENV.get(e.field or "") or e.field
        raise UsageError(e.message, field=where, fix=e.fix) from None
    if cfg.api_key is None:
        logging.getLogger("hybridpd.launch.proxy").warning(
            "authentication is off: clients need no key (%s)",
            "--no-auth" if no_auth else f"{KEY_ENV['api_key']} is not set")
    try:
        run_proxy(cfg)
    except OSError as exc:  # typically: address already in use
        raise HybridPDError(f"cannot serve on {cfg.host}:{cfg.port}: {exc}") from None
