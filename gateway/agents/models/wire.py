"""What every HTTP model provider's client shares: which failures are worth another attempt, the
server's `Retry-After`, and the provider's own error message (an excerpt, never a whole body)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from gateway.http_client import HttpAnswer

__all__ = ["RETRYABLE_ERRORS", "RETRYABLE_STATUSES", "error_message", "excerpt", "retry_after"]

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504, 529})  # 529: Anthropic's "overloaded"
# Network failures worth another attempt; a bad URL or proxy set-up (other TransportErrors) is not.
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)
EXCERPT_CHARS = 300


def error_message(response: HttpAnswer) -> str:
    """The provider's own error message when the body has one, else an excerpt of the body."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, list) and body:  # Gemini's compatible endpoint wraps the error in a list
        body = body[0]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):  # Ollama and some proxies: {"error": "..."}
            return error
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return excerpt(response.text) or response.reason_phrase or "no error message"


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait from `retry-after-ms` (OpenAI, Azure) or `Retry-After` (seconds or HTTP date)."""
    if (millis := _seconds(headers.get("retry-after-ms"))) is not None:
        return millis / 1000
    value = headers.get("retry-after")
    if value is None:
        return None
    if (seconds := _seconds(value)) is not None:
        return seconds
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"
