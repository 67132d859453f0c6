"""The rule for a configured API base URL, shared by the settings and the platforms' settings groups."""

from __future__ import annotations

from urllib.parse import urlsplit


def check_base_url(value: str) -> str:
    """An API base: http(s) with a host, without a trailing slash. For a settings field validator: a
    malformed base would otherwise pass start-up and fail every model call or reply."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises on a port that is not a number, or out of range)
    except ValueError:
        raise ValueError("is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        raise ValueError("must be an http:// or https:// URL with a host")
    return value.rstrip("/")
