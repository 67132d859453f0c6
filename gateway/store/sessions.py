"""Sessions (`chatflow_sessions`, `chatflow_messages`): the one repository of the agents' SQL store and
of the operators (the admin API and `gateway sessions …`).

A turn writes only what changed, in one transaction: the session row, the pruned positions deleted,
the new messages appended. Loading reads the session row and its kept window through the
(session_id, position) index, so neither the number of sessions nor the turns pruned before make a
turn slower. Both spellings (the SQLite file's and SQLAlchemy's) write the same rows in the same
formats, so either reads what the other wrote.

A listing is one query on the session rows (never their messages), newest `updated_at` first, paged
by a keyset on (`updated_at`, `session_id`) that the table's index serves. A session's platform is
its id's prefix before the first ':' (`telegram:42`, `whatsapp:…`, `cli:…`), None for an id without one.

Deleting a session deletes its messages (ON DELETE CASCADE); a turn still running on it then fails
with the session store's SessionDeletedError and writes nothing, because its save updates a row
that no longer exists.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Select,
    String,
    bindparam,
    delete,
    func,
    insert,
    literal,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.domain.sessions import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    Cursor,
    Page,
    SessionDetail,
    SessionSummary,
    StoredMessage,
    is_valid_session_id,
)
from gateway.errors import GatewayError
from gateway.store.database import Database
from gateway.store.engine import SQLITE_CASEFOLD
from gateway.store.postgres_lanes import Statement
from gateway.store.sqlite_thread import from_sqlite_datetime, to_sqlite_datetime
from gateway.store.storable import json_text
from gateway.store.tables import MessageRow, SessionRow

_LIKE_ESCAPE = "\\"


class SessionExistsError(GatewayError):
    """A session with that id already exists."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} already exists")
        self.session_id = session_id


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
    db: Database,
    *,
    limit: int = DEFAULT_PAGE_SIZE,
    after: Cursor | None = None,
    platform: str | None = None,
    query: str | None = None,
) -> Page:
    """One page, newest `updated_at` first; `after` is the previous page's `next_cursor`."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be 1-{MAX_PAGE_SIZE}")
    statement = _listing(db.dialect, limit, after, platform, query)
    async with db.connect() as conn:
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


async def get_session(db: Database, session_id: str) -> SessionDetail | None:
    """The session with its metadata and kept messages in order, read from one snapshot."""
    if not is_valid_session_id(session_id):
        return None
    async with db.connect() as conn:
        if db.dialect == "postgresql":
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
    db: Database,
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
        async with db.begin() as conn:
            await conn.execute(insert(SessionRow).values(**values))
    except IntegrityError:
        raise SessionExistsError(session_id) from None
    return SessionSummary(session_id, title, agent_name, now, now, 0)


async def rename_session(db: Database, session_id: str, title: str) -> SessionSummary | None:
    """Set the title (validated with clean_title) and move `updated_at` forward; None if unknown."""
    if not is_valid_session_id(session_id):
        return None
    async with db.begin() as conn:
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


async def delete_session(db: Database, session_id: str) -> bool:
    """Delete the session and its messages; False when there was none."""
    if not is_valid_session_id(session_id):
        return False
    async with db.begin() as conn:
        result = await conn.execute(delete(SessionRow).where(SessionRow.session_id == session_id))
    return bool(result.rowcount)


# --- the agents' store: a session's kept window, and a turn's writes -------------------------------
@dataclass(frozen=True)
class LoadedSession:
    agent_name: str | None
    title: str | None
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    messages: list[tuple[int, dict[str, Any]]] | None  # None: unchanged since `known_version`


@dataclass(frozen=True)
class SessionFields:
    """What a turn writes to the session row."""

    active_agent_name: str
    title: str | None
    metadata: dict[str, Any]
    updated_at: datetime
    message_count: int


@dataclass(frozen=True)
class MessageFields:
    position: int
    role: str
    message: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class TurnWrite:
    """A turn's changes to one session: its row (inserted when `created_at` is given, else updated),
    the positions pruned, the messages appended."""

    session_id: str
    created_at: datetime | None
    fields: SessionFields
    pruned: list[int]
    rows: list[MessageFields]


_LOAD_SESSION = (
    "SELECT active_agent_name, title, metadata_json, created_at, updated_at "
    "FROM chatflow_sessions WHERE session_id = ?"
)
_LOAD_MESSAGES = "SELECT position, message_json FROM chatflow_messages WHERE session_id = ? ORDER BY position"
_INSERT_SESSION = (
    "INSERT INTO chatflow_sessions (active_agent_name, title, metadata_json, updated_at, message_count, "
    "session_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# A title, once stored, changes only by a rename (the admin API): a turn only fills in a missing one,
# so a rename made while the turn ran is kept.
_UPDATE_SESSION = (
    "UPDATE chatflow_sessions SET active_agent_name = ?, title = COALESCE(title, ?), metadata_json = ?, "
    "updated_at = ?, message_count = ? WHERE session_id = ?"
)
ROWS_PER_STATEMENT = 64  # rows (or positions) per multi-row statement; far below SQLite's limits


@functools.cache
def _delete_messages_sql(count: int) -> str:
    marks = ", ".join("?" * count)
    return f"DELETE FROM chatflow_messages WHERE session_id = ? AND position IN ({marks})"


@functools.cache
def _insert_messages_sql(count: int) -> str:
    rows = ", ".join(["(?, ?, ?, ?, ?)"] * count)
    return (
        f"INSERT INTO chatflow_messages (session_id, position, role, message_json, created_at) VALUES {rows}"
    )


def _chunks(values: list[Any]) -> list[list[Any]]:
    """Multi-row statements instead of one per row: each statement releases and re-takes the GIL."""
    return [values[i : i + ROWS_PER_STATEMENT] for i in range(0, len(values), ROWS_PER_STATEMENT)]


# PostgreSQL: the row and, unless the caller knows its version, its messages, in one statement on the
# lanes. Through the pool the two reads cost about 0.8 ms of the gateway's CPU, paid by every turn whose
# session this process did not write last (another replica did, or the store forgot it): with three
# replicas, most turns (benchmarks/postgres.py).
_LOAD_ON_POSTGRES = Statement(
    text(
        "SELECT active_agent_name, title, metadata_json, created_at, updated_at, "
        "CASE WHEN updated_at IS DISTINCT FROM :known THEN (SELECT COALESCE(json_agg("
        "json_build_array(m.position, m.message_json) ORDER BY m.position), '[]') FROM chatflow_messages m "
        "WHERE m.session_id = s.session_id) END FROM chatflow_sessions s WHERE s.session_id = :session_id"
    ).bindparams(bindparam("known", type_=DateTime(timezone=True)))
)


async def load(db: Database, session_id: str, known_version: datetime | None = None) -> LoadedSession | None:
    """The session row, and its kept messages unless the row's updated_at equals `known_version`."""
    if db.postgres is not None:
        rows = await db.postgres.fetch(_LOAD_ON_POSTGRES, {"session_id": session_id, "known": known_version})
        if not rows:
            return None
        # JSON comes decoded: the pool's connections carry SQLAlchemy's codecs.
        agent, title, metadata, created, updated, messages = rows[0]
        kept = None if messages is None else [(position, message) for position, message in messages]
        return LoadedSession(agent, title, metadata, created, updated, kept)
    known = None if known_version is None else to_sqlite_datetime(known_version)

    def on_file(conn: sqlite3.Connection) -> LoadedSession | None:
        row = conn.execute(_LOAD_SESSION, (session_id,)).fetchone()
        if row is None:
            return None
        agent, title, metadata, created, updated = row
        messages = None
        if updated != known:
            rows = conn.execute(_LOAD_MESSAGES, (session_id,)).fetchall()
            messages = [(position, json.loads(data)) for position, data in rows]
        return LoadedSession(
            agent,
            title,
            json.loads(metadata),
            from_sqlite_datetime(created),
            from_sqlite_datetime(updated),
            messages,
        )

    async def on_engine(conn: AsyncConnection) -> LoadedSession | None:
        row = (await conn.execute(_LOAD_SESSION_STATEMENT, {"b_session": session_id})).one_or_none()
        if row is None:
            return None
        agent, title, metadata, created, updated = row
        if updated == known_version:
            return LoadedSession(agent, title, metadata, created, updated, None)
        messages = await conn.execute(
            select(MessageRow.position, MessageRow.message_json)
            .where(MessageRow.session_id == session_id)
            .order_by(MessageRow.position)
        )
        return LoadedSession(agent, title, metadata, created, updated, [(p, m) for p, m in messages])

    return await db.read(on_file, on_engine)


def save_on_file(turn: TurnWrite) -> Callable[[sqlite3.Connection], bool]:
    """The turn's session writes; False (nothing written) when the session row to update is gone.

    Parameters are built here, on the event loop, so the writer thread only runs statements: few of
    them, since each releases and re-takes the GIL (multi-row inserts and deletes).
    """
    fields, session_id = turn.fields, turn.session_id
    session_values = (
        fields.active_agent_name,
        fields.title,
        json_text(fields.metadata),
        to_sqlite_datetime(fields.updated_at),
        fields.message_count,
        session_id,
    )
    session_row = (
        (_INSERT_SESSION, (*session_values, to_sqlite_datetime(turn.created_at)))
        if turn.created_at is not None
        else (_UPDATE_SESSION, session_values)
    )
    statements = [
        (_delete_messages_sql(len(positions)), (session_id, *positions)) for positions in _chunks(turn.pruned)
    ]
    message_values = [
        (session_id, r.position, r.role, json_text(r.message), to_sqlite_datetime(r.created_at))
        for r in turn.rows
    ]
    statements += [
        (_insert_messages_sql(len(chunk)), tuple(v for row in chunk for v in row))
        for chunk in _chunks(message_values)
    ]

    def write(conn: sqlite3.Connection) -> bool:
        if conn.execute(*session_row).rowcount == 0:
            return False  # the session was deleted meanwhile; nothing was written
        for statement, params in statements:
            conn.execute(statement, params)
        return True

    return write


# Built once: building a statement costs more than running it (a fifth of a turn's CPU on PostgreSQL).
_LOAD_SESSION_STATEMENT = select(
    SessionRow.active_agent_name,
    SessionRow.title,
    SessionRow.metadata_json,
    SessionRow.created_at,
    SessionRow.updated_at,
).where(SessionRow.session_id == bindparam("b_session"))
_UPDATE_SESSION_STATEMENT = (
    update(SessionRow)
    .where(SessionRow.session_id == bindparam("b_session"))
    .values(
        active_agent_name=bindparam("v_agent"),
        title=func.coalesce(SessionRow.title, bindparam("v_title", type_=String)),
        metadata_json=bindparam("v_metadata", type_=SessionRow.metadata_json.type),
        updated_at=bindparam("v_updated_at", type_=SessionRow.updated_at.type),
        message_count=bindparam("v_message_count"),
    )
)
_INSERT_MESSAGES_STATEMENT = insert(MessageRow)


async def save_on_engine(conn: AsyncConnection, turn: TurnWrite) -> bool:
    """The same writes in SQLAlchemy; False (nothing written) when the session row to update is gone."""
    fields, session_id = turn.fields, turn.session_id
    values: dict[str, Any] = {
        "active_agent_name": fields.active_agent_name,
        "title": fields.title,
        "metadata_json": fields.metadata,
        "updated_at": fields.updated_at,
        "message_count": fields.message_count,
    }
    if turn.created_at is not None:
        await conn.execute(
            insert(SessionRow).values(session_id=session_id, created_at=turn.created_at, **values)
        )
    else:
        # Also takes the row lock, so a concurrent delete waits for this commit or wins before it.
        # As _UPDATE_SESSION: a stored title is kept (a rename during the turn wins).
        result = await conn.execute(
            _UPDATE_SESSION_STATEMENT,
            {
                "b_session": session_id,
                "v_agent": fields.active_agent_name,
                "v_title": fields.title,
                "v_metadata": fields.metadata,
                "v_updated_at": fields.updated_at,
                "v_message_count": fields.message_count,
            },
        )
        if result.rowcount == 0:
            return False
    if turn.pruned:
        await conn.execute(
            delete(MessageRow).where(
                MessageRow.session_id == session_id, MessageRow.position.in_(turn.pruned)
            )
        )
    if turn.rows:
        await conn.execute(
            _INSERT_MESSAGES_STATEMENT,
            [
                {
                    "session_id": session_id,
                    "position": r.position,
                    "role": r.role,
                    "message_json": r.message,
                    "created_at": r.created_at,
                }
                for r in turn.rows
            ],
        )
    return True


@dataclass(frozen=True)
class SessionListing:
    """A session as the agents' store lists it: the summary and its metadata."""

    session: SessionSummary
    metadata: dict[str, Any]


async def recent(db: Database, limit: int, offset: int) -> list[SessionListing]:
    """Newest `updated_at` first, by offset (the agents' store's `list_sessions`)."""
    query = (
        select(*_SUMMARY_COLUMNS, SessionRow.metadata_json)
        .order_by(SessionRow.updated_at.desc(), SessionRow.session_id.desc())
        .limit(limit)
        .offset(offset)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [SessionListing(SessionSummary(*row[:6]), row.metadata_json) for row in rows]
