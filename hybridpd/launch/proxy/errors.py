"""OpenAI-style errors raised by the proxy and rendered as ``{"error": {...}}`` JSON responses."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# ``type`` values used in error bodies (OpenAI uses free-form strings; these are stable for clients and tests).
INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
UPSTREAM = "upstream_error"
UPSTREAM_TIMEOUT = "upstream_timeout_error"
UNAVAILABLE = "service_unavailable_error"
INTERNAL = "internal_error"


class ProxyError(Exception):
    """An error the proxy answers itself, with an HTTP status and an OpenAI-style body.

    ``code`` is a short machine-readable string (``"prefill_timeout"``, ``"unsupported_parameter"``...),
    ``param`` names the offending request field when there is one, ``detail`` holds what only the log may see.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        #: Backend details (URL, backend error text) for the log only, never for the client.
        self.detail = detail
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def __repr__(self) -> str:
        return f"ProxyError({self.status}, {self.message!r}, type={self.type!r}, code={self.code!r})"


class UpstreamReply(Exception):
    """A backend's own 4xx answer, passed through to the client unchanged (status, body, content type)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


def error_body(message: str, *, type: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def sse_error_event(message: str, *, type: str = UPSTREAM, code: str = "stream_interrupted") -> bytes:
    """One SSE event carrying an OpenAI-style error, as vLLM itself emits when a stream fails."""
    return b"data: " + json.dumps(error_body(message, type=type, code=code)).encode() + b"\n\n"


def bad_request(message: str, *, code: str = "invalid_request", param: str | None = None) -> ProxyError:
    return ProxyError(400, message, type=INVALID_REQUEST, code=code, param=param)
