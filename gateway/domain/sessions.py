"""Sessions as the operators see them: the rules for ids, titles, searches and page cursors, and the
shapes a listing and a detail come in. Standard library only; the rows live in gateway/store/sessions.py.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
MAX_SESSION_ID_LENGTH = 255  # the column's length
MAX_TITLE_LENGTH = 200
MAX_QUERY_LENGTH = 255  # a longer search cannot match a title
MAX_CURSOR_LENGTH = 2048
# A platform filter names the prefix of session ids, before their first ':'.
PLATFORM_PATTERN = r"^[A-Za-z0-9_-]{1,32}$"
# Control characters (C0, DEL, C1) are refused in ids and titles: they break logs and terminals, and
# PostgreSQL cannot store NUL. The whitespace a title is stripped of is spelled out, so this check
# and the OpenAPI document's pattern agree character for character whatever the regex engine.
_SPACE_CHARACTERS = (
    " \u00a0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
_CONTROL = "\\u0000-\\u001f\\u007f-\\u009f"
_SPACE = "".join(f"\\u{ord(c):04x}" for c in _SPACE_CHARACTERS)
SESSION_ID_PATTERN = f"^[^{_CONTROL}]+$"
QUERY_PATTERN = f"^[^{_CONTROL}]*$"
TITLE_PATTERN = f"^[^{_CONTROL}]*[^{_CONTROL}{_SPACE}][^{_CONTROL}]*$"
_SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
_CONTROL_RE = re.compile(f"[{_CONTROL}]")
_PLATFORM_RE = re.compile(PLATFORM_PATTERN)
_CURSOR_RE = re.compile(r"^[A-Za-z0-9_-]+={0,2}$")


def platform_of(session_id: str) -> str | None:
    """`telegram:42` -> `telegram`; None for an id without a ':'."""
    prefix, colon, _ = session_id.partition(":")
    return prefix if colon and prefix else None


def _storable(value: str) -> bool:
    """Every database can store it: no lone surrogates (they have no UTF-8 form)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_valid_session_id(session_id: str) -> bool:
    """1-255 characters, none of them a control character. Ids of the platforms always are."""
    return (
        len(session_id) <= MAX_SESSION_ID_LENGTH
        and _SESSION_ID_RE.fullmatch(session_id) is not None
        and _storable(session_id)
    )


def clean_title(title: str) -> str:
    """The title to store: stripped of surrounding spaces. ValueError when it is empty after
    stripping, over MAX_TITLE_LENGTH characters as given, or holds a control character."""
    if len(title) > MAX_TITLE_LENGTH:
        raise ValueError(f"title is over {MAX_TITLE_LENGTH} characters")
    if not _storable(title) or _CONTROL_RE.search(title):
        raise ValueError("title holds a control character or is not valid Unicode text")
    stripped = title.strip(_SPACE_CHARACTERS)
    if not stripped:
        raise ValueError("title is empty")
    return stripped


def is_valid_platform(platform: str) -> bool:
    return _PLATFORM_RE.fullmatch(platform) is not None


def is_valid_query(text: str) -> bool:
    """A title search: at most MAX_QUERY_LENGTH characters, no control characters."""
    return len(text) <= MAX_QUERY_LENGTH and _CONTROL_RE.search(text) is None and _storable(text)


@dataclass(frozen=True)
class StoredVersion:
    """A session's version as read under a lease on its conversation (which keeps other turns from
    writing it): its row's updated_at, None when it had no row. A reader that remembers that version
    of the session need not read it again."""

    updated_at: datetime | None


@dataclass(frozen=True)
class Cursor:
    """Where a page ended: the last session's (updated_at, session_id). Opaque to clients."""

    updated_at: datetime
    session_id: str

    def encode(self) -> str:
        data = json.dumps([self.updated_at.astimezone(UTC).isoformat(), self.session_id])
        return base64.urlsafe_b64encode(data.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Cursor:
        """ValueError for anything that is not a cursor this module made (or could have made)."""
        if len(token) > MAX_CURSOR_LENGTH or not _CURSOR_RE.fullmatch(token):
            raise ValueError("not a cursor")
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw.decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError, ValueError, RecursionError):
            raise ValueError("not a cursor") from None
        if not (isinstance(data, list) and len(data) == 2 and all(isinstance(v, str) for v in data)):
            raise ValueError("not a cursor")
        stamp, session_id = data
        try:
            updated_at = datetime.fromisoformat(stamp)
            if updated_at.tzinfo is None:
                raise ValueError("naive")
            updated_at = updated_at.astimezone(UTC)
        except (ValueError, OverflowError):
            raise ValueError("not a cursor") from None
        if not is_valid_session_id(session_id):
            raise ValueError("not a cursor")
        return cls(updated_at, session_id)


@dataclass(frozen=True)
class SessionSummary:
    """A session as a listing shows it: no messages, no metadata."""

    session_id: str
    title: str | None
    active_agent: str | None
    created_at: datetime
    updated_at: datetime
    message_count: int

    @property
    def platform(self) -> str | None:
        return platform_of(self.session_id)

    def cursor(self) -> Cursor:
        return Cursor(self.updated_at, self.session_id)


@dataclass(frozen=True)
class StoredMessage:
    """One kept message, as stored by the agents' session store."""

    position: int
    role: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    tool_call_id: str | None
    agent_name: str | None
    created_at: datetime


@dataclass(frozen=True)
class SessionDetail:
    session: SessionSummary
    metadata: dict[str, Any]
    messages: list[StoredMessage]


@dataclass(frozen=True)
class Page:
    sessions: list[SessionSummary]
    next_cursor: Cursor | None  # None on the last page
