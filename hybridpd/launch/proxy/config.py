"""``ProxyConfig``: everything the P/D proxy needs, validated once, immutable afterwards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from yarl import URL

from hybridpd.errors import UsageError

Policy = Literal["round_robin", "least_outstanding"]
POLICIES: tuple[str, ...] = get_args(Policy)
EVENT_LOOPS: tuple[str, ...] = ("auto", "uvloop", "asyncio")


class ProxyConfigError(UsageError):
    """A ``ProxyConfig`` field has an impossible value."""


def normalize_backend_url(url: str, *, field: str) -> str:
    """``http://host:port[/prefix]`` without a trailing slash; rejects ``.../v1`` (give the server root)."""
    if not isinstance(url, str) or not url.strip():
        raise ProxyConfigError("empty backend URL", field=field, fix="give e.g. http://127.0.0.1:8100")
    try:
        parsed = URL(url.strip())
    except ValueError as exc:
        raise ProxyConfigError(f"malformed URL {url!r}: {exc}", field=field) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ProxyConfigError(
            f"backend URL {url!r} must be absolute http(s)://host:port", field=field, fix="e.g. http://127.0.0.1:8100"
        )
    if parsed.query_string or parsed.fragment:
        raise ProxyConfigError(f"backend URL {url!r} must not carry a query or fragment", field=field)
    text = str(parsed).rstrip("/")
    if text.endswith("/v1"):
        raise ProxyConfigError(
            f"backend URL {url!r} ends in /v1; the proxy appends /v1/... and /health itself",
            field=field,
            fix=f"use {text[: -len('/v1')]}",
        )
    return text


@dataclass(frozen=True)
class ProxyConfig:
    """Configuration of one proxy instance. Lists given for the URL fields are stored as tuples.

    Timeouts are in seconds. The defaults are generous on purpose: the first request of a new shape on a
    fresh CPU vLLM engine can take 4-24 s, and a decode whose NIXL handshake fails answers only after ~31 s.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: Policy = "round_robin"
    #: TCP connect to a backend; a failure ejects the backend and the request moves to the next one.
    connect_timeout_s: float = 5.0
    #: Whole prefill leg (request sent -> P's JSON fully read). Exceeded -> 504.
    prefill_timeout_s: float = 180.0
    #: Streaming decode: request sent -> first body bytes from D (KV pull + first token). Exceeded -> 504.
    decode_first_byte_timeout_s: float = 180.0
    #: Streaming decode: longest silence between two chunks once streaming; exceeded -> SSE error event.
    decode_idle_timeout_s: float = 120.0
    #: Whole decode leg, streaming or not. Exceeded before the first byte -> 504, after -> SSE error event.
    decode_timeout_s: float = 1800.0
    #: If set, clients must send ``Authorization: Bearer <api_key>`` on /v1/*. Never forwarded to backends.
    api_key: str | None = field(default=None, repr=False)
    #: If set, sent to backends as ``Authorization: Bearer <backend_api_key>`` (vLLM ``--api-key``).
    backend_api_key: str | None = field(default=None, repr=False)
    #: Largest accepted request body; larger -> 413.
    max_request_bytes: int = 16 * 1024 * 1024
    #: Period of ``GET /health`` probes on every backend.
    health_interval_s: float = 5.0
    health_timeout_s: float = 3.0
    #: Consecutive failed probes before a backend is ejected (a refused connection ejects at once).
    unhealthy_after: int = 3
    #: Consecutive successful probes before an ejected backend is re-admitted.
    healthy_after: int = 1
    #: Cap on simultaneous upstream connections (0 = unlimited; vLLM queues requests itself).
    max_upstream_connections: int = 0
    #: Idle keep-alive of upstream connections; below uvicorn's 5 s so the proxy never reuses a socket
    #: the backend is closing.
    upstream_keepalive_s: float = 4.0
    #: On SIGINT/SIGTERM, how long in-flight requests may finish before they are cancelled.
    shutdown_grace_s: float = 30.0
    access_log: bool = False
    # --- client side (hostile clients: see ``hybridpd.launch.proxy.guard``) ---
    #: A client connection has this long, from its first byte, to send a complete request line and headers.
    header_timeout_s: float = 10.0
    #: A request body must be fully received within this long once its headers are in. Exceeded -> 408.
    body_timeout_s: float = 30.0
    #: A client connection with no request in progress and nothing received is closed after this long.
    idle_timeout_s: float = 60.0
    #: Most simultaneous client connections; beyond it the longest-idle connection without a request in
    #: progress is closed, else the newcomer gets 503. None = derived from the process's open-file limit.
    max_connections: int | None = None
    #: Largest SSE event accepted from D; a longer one ends the stream with an error event.
    max_sse_event_bytes: int = 16 * 1024 * 1024
    #: Client error bodies quote backend URLs and backend error text (off: they go to the log only).
    expose_backend_errors: bool = False
    #: If set, ``/metrics`` needs ``Authorization: Bearer <metrics_api_key>``; if unset, it needs ``api_key``
    #: when that is set. /health stays open (it reveals only counts).
    metrics_api_key: str | None = field(default=None, repr=False)
    #: ``GET /health`` re-probes the backends itself when the last probe round is older than this, so a
    #: dead backend shows within one request instead of one ``health_interval_s``.
    health_max_age_s: float = 0.25
    #: Scrape every P's ``/metrics`` each health round for vLLM's KV-lease counters
    #: (``vllm:nixl_num_kv_expired_reqs``, ``vllm:nixl_num_notifications_after_expiry``).
    watch_kv_leases: bool = True
    #: "auto" (uvloop if importable, else asyncio), "uvloop" or "asyncio"; used by ``run_proxy``.
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        for name in ("prefill_urls", "decode_urls"):
            raw: Any = getattr(self, name)
            if isinstance(raw, str):
                raw = (raw,)
            if not isinstance(raw, Sequence) or len(raw) == 0:
                raise ProxyConfigError("at least one backend URL is required", field=name)
            urls = tuple(normalize_backend_url(u, field=name) for u in raw)
            dupes = sorted({u for u in urls if urls.count(u) > 1})
            if dupes:
                raise ProxyConfigError(f"duplicate backend URL(s) {', '.join(dupes)}", field=name)
            object.__setattr__(self, name, urls)
        if not isinstance(self.host, str) or not self.host:
            raise ProxyConfigError("host must be a non-empty string", field="host")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ProxyConfigError(f"port {self.port!r} out of range 0..65535", field="port")
        if self.policy not in POLICIES:
            raise ProxyConfigError(f"unknown policy {self.policy!r}", field="policy", fix=f"one of {', '.join(POLICIES)}")
        for f in fields(self):
            if f.name.endswith("_s"):
                value = getattr(self, f.name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                    raise ProxyConfigError(f"{value!r} is not a finite number of seconds", field=f.name)
                if value <= 0:
                    raise ProxyConfigError(f"{value!r} must be > 0", field=f.name)
        for name, low in (("max_request_bytes", 1024), ("unhealthy_after", 1), ("healthy_after", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ProxyConfigError(f"{value!r} must be an integer >= {low}", field=name)
        if not isinstance(self.max_upstream_connections, int) or self.max_upstream_connections < 0:
            raise ProxyConfigError("must be an integer >= 0 (0 = unlimited)", field="max_upstream_connections")
        mc = self.max_connections
        if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or mc < 1):
            raise ProxyConfigError(f"{mc!r} must be None (automatic) or an integer >= 1", field="max_connections")
        me = self.max_sse_event_bytes
        if not isinstance(me, int) or isinstance(me, bool) or me < 1024:
            raise ProxyConfigError(f"{me!r} must be an integer >= 1024", field="max_sse_event_bytes")
        if self.event_loop not in EVENT_LOOPS:
            raise ProxyConfigError(f"unknown event loop {self.event_loop!r}", field="event_loop",
                                   fix=f"one of {', '.join(EVENT_LOOPS)}")
        for name in ("api_key", "backend_api_key", "metrics_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or any(c.isspace() for c in value)):
                raise ProxyConfigError("must be None or a non-empty string without whitespace", field=name)
