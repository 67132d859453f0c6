"""Sessions for operators (the admin API and `gateway sessions …`): list, show, create, rename, delete.

Read from the tables the agents' SQL store writes, without going through it: a listing is one
query on the session rows (never their messages), newest `updated_at` first, paged by a keyset on
(`updated_at`, `session_id`) that the table's index serves. A session's platform is its id's prefix
before the first ':' (`telegram:42`, `whatsapp:…`, `cli:…`), None for an id without one.

Deleting a session deletes its messages (ON DELETE CASCADE); a turn still running on it then fails
with the session store's SessionDeletedError and writes nothing, because its save updates a row
that no longer exists.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, delete, func, insert, literal, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import GatewayError
from gateway.store.engine import SQLITE_CASEFOLD, SQLITE_IMMEDIATE
from gateway.store.tables import MessageRow, SessionRow, utcnow

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
_LIKE_ESCAPE = "\\"


class SessionExistsError(GatewayError):
    """A session with that id already exists."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} already exists")
        self.session_id = session_id


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


_SUMMARY_COLUMNS = (
    SessionRow.session_id,
    SessionRow.title,
    SessionRow.active_agent_name,
    SessionRow.created_at,
    SessionRow.updated_at,
    SessionRow.message_count,
)


def _like_escape(text: str) -> str:
    return text.replace(_LIKE_ESCAPE, _LIKE_ESCAPE * 2).replace("%", "\\%").replace("_", "\\_")


def _title_contains(dialect: str, text: str) -> ColumnElement[bool]:
    """Case-insensitive substring match on titles, with LIKE's wildcards taken literally.

    SQLite's own LIKE and lower() fold ASCII letters only, so there titles go through the
    casefold function that every SQLite connection of `create_engine` has; PostgreSQL's ILIKE folds
    by the database's locale.
    """
    if dialect == "sqlite":
        pattern = f"%{_like_escape(text.casefold())}%"
        casefold = getattr(func, SQLITE_CASEFOLD)
        return casefold(SessionRow.title).like(pattern, escape=_LIKE_ESCAPE)  # type: ignore[no-any-return]
    return SessionRow.title.ilike(f"%{_like_escape(text)}%", escape=_LIKE_ESCAPE)


def _listing(
    dialect: str, limit: int, after: Cursor | None, platform: str | None, query: str | None
) -> Select[*tuple[Any, ...]]:
    statement = select(*_SUMMARY_COLUMNS)
    if platform is not None:
        prefix = f"{platform}:"
        # LIKE narrows by the prefix; the substr comparison makes it exact (SQLite's LIKE ignores case).
        statement = statement.where(
            SessionRow.session_id.like(f"{_like_escape(prefix)}%", escape=_LIKE_ESCAPE),
            func.substr(SessionRow.session_id, 1, len(prefix)) == prefix,
        )
    if query:
        statement = statement.where(_title_contains(dialect, query))
    if after is not None:
        statement = statement.where(
            tuple_(SessionRow.updated_at, SessionRow.session_id)
            < tuple_(
                _typed(SessionRow.updated_at, after.updated_at),
                _typed(SessionRow.session_id, after.session_id),
            )
        )
    return statement.order_by(SessionRow.updated_at.desc(), SessionRow.session_id.desc()).limit(limit + 1)


def _typed(column: Any, value: Any) -> Any:
    """A bound value with its column's type (so a datetime is stored-format on SQLite)."""
    return literal(value, column.type)


async def list_sessions(
    engine: AsyncEngine,
    *,
    limit: int = DEFAULT_PAGE_SIZE,
    after: Cursor | None = None,
    platform: str | None = None,
    query: str | None = None,
) -> Page:
    """One page, newest `updated_at` first; `after` is the previous page's `next_cursor`."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be 1-{MAX_PAGE_SIZE}")
    statement = _listing(engine.dialect.name, limit, after, platform, query)
    async with engine.connect() as conn:
        rows = (await conn.execute(statement)).all()
    sessions = [SessionSummary(*row) for row in rows[:limit]]
    more = len(rows) > limit
    return Page(sessions, sessions[-1].cursor() if more else None)


def _message(position: int, role: str, data: Any, created_at: datetime) -> StoredMessage:
    """A stored message's JSON as the API shows it; whatever another writer left, never an error."""
    data = data if isinstance(data, dict) else {}

    def text(key: str) -> str | None:
        value = data.get(key)
        return value if isinstance(value, str) else None

    calls = data.get("tool_calls")
    tool_calls = [
        {
            "id": str(call.get("id", "")),
            "name": str(call.get("name", "")),
            "arguments": call["arguments"] if isinstance(call.get("arguments"), dict) else {},
        }
        for call in (calls if isinstance(calls, list) else [])
        if isinstance(call, dict)
    ]
    return StoredMessage(
        position=position,
        role=role,
        content=text("content"),
        tool_calls=tool_calls,
        tool_call_id=text("tool_call_id"),
        agent_name=text("agent_name"),
        created_at=created_at,
    )


async def get_session(engine: AsyncEngine, session_id: str) -> SessionDetail | None:
    """The session with its metadata and kept messages in order, read from one snapshot."""
    if not is_valid_session_id(session_id):
        return None
    async with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            # Both reads see the same commit, so message_count and the messages agree.
            conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        row = (
            await conn.execute(
                select(*_SUMMARY_COLUMNS, SessionRow.metadata_json).where(SessionRow.session_id == session_id)
            )
        ).one_or_none()
        if row is None:
            return None
        messages = await conn.execute(
            select(MessageRow.position, MessageRow.role, MessageRow.message_json, MessageRow.created_at)
            .where(MessageRow.session_id == session_id)
            .order_by(MessageRow.position)
        )
        rendered = [_message(*message) for message in messages]
    metadata = row.metadata_json if isinstance(row.metadata_json, dict) else {}
    return SessionDetail(SessionSummary(*row[:6]), metadata, rendered)


async def create_session(
    engine: AsyncEngine,
    session_id: str | None = None,
    title: str | None = None,
    agent_name: str | None = None,
) -> SessionSummary:
    """A new, empty session (a UUID id when none is given); SessionExistsError if the id is taken.

    Validate `session_id` with is_valid_session_id and `title` with clean_title first.
    """
    session_id = session_id if session_id is not None else str(uuid.uuid4())
    now = utcnow()
    values: dict[str, Any] = {
        "session_id": session_id,
        "active_agent_name": agent_name,
        "title": title,
        "metadata_json": {},
        "created_at": now,
        "updated_at": now,
        "message_count": 0,
    }
    try:
        async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            await conn.execute(insert(SessionRow).values(**values))
    except IntegrityError:
        raise SessionExistsError(session_id) from None
    return SessionSummary(session_id, title, agent_name, now, now, 0)


async def rename_session(engine: AsyncEngine, session_id: str, title: str) -> SessionSummary | None:
    """Set the title (validated with clean_title) and move `updated_at` forward; None if unknown."""
    if not is_valid_session_id(session_id):
        return None
    async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
        current = (
            await conn.execute(
                select(SessionRow.updated_at).where(SessionRow.session_id == session_id).with_for_update()
            )
        ).scalar_one_or_none()
        if current is None:
            return None
        # Strictly later, also when the clock has not moved since the last write.
        stamp = max(utcnow(), current + timedelta(microseconds=1))
        row = (
            await conn.execute(
                update(SessionRow)
                .where(SessionRow.session_id == session_id)
                .values(title=title, updated_at=stamp)
                .returning(*_SUMMARY_COLUMNS)
            )
        ).one()
    return SessionSummary(*row)


async def delete_session(engine: AsyncEngine, session_id: str) -> bool:
    """Delete the session and its messages; False when there was none."""
    if not is_valid_session_id(session_id):
        return False
    async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
        result = await conn.execute(delete(SessionRow).where(SessionRow.session_id == session_id))
    return bool(result.rowcount)
