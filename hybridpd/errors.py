"""Typed errors. Each carries the field at fault and the fix; the CLI maps them to one line + exit code."""

from __future__ import annotations


class HybridPDError(Exception):
    """Base class. ``exit_code`` 2 = usage error (bad input), 1 = failure."""

    exit_code = 1

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None) -> None:
        self.message = message
        self.field = field
        self.fix = fix
        text = message
        if field and field not in message:
            text = f"{field}: {message}"
        if fix:
            text = f"{text} (fix: {fix})"
        super().__init__(text)


class UsageError(HybridPDError):
    """The user asked for something impossible or malformed."""

    exit_code = 2


class ConfigError(UsageError):
    """A model config is missing a field or has a malformed value."""


class ModelNotFound(UsageError):
    """MODEL is neither bundled, a path, nor in the local Hugging Face cache."""


class UnsupportedVersion(UsageError):
    """No behaviour profile covers the requested vLLM version."""


class OutputError(HybridPDError):
    """An output file could not be written (disk full, read-only, permissions); the message says what was written."""


class VerificationFailed(HybridPDError):
    """Expected and moved bytes differ."""


class ExternalToolError(HybridPDError):
    """An optional dependency (nixl, torch, vllm) is missing or failed."""
