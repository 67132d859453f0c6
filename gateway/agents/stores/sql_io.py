"""The hot statements of the SQL session store, in two transports with the same effect.

`EngineIO` runs them through SQLAlchemy's async engine (PostgreSQL, in-memory SQLite).
`SQLiteFileIO` runs them on an SQLite file through `SQLiteThread`, because that is where SQLite's
speed is lost (see gateway/store/sqlite_thread.py), and through its group commit
(gateway/store/queue.py): the loads and saves of concurrent turns share a hop, and the saves one
transaction, each in a savepoint of its own. Both write the same rows in the same formats, so either
can read what the other wrote.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store import dedup, queue
from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.sqlite_thread import SQLiteThread, from_sqlite_datetime, to_sqlite_datetime
from gateway.store.tables import InboxRow, MessageRow, OutboxRow, ProcessedMessageRow, SessionRow
from gateway.store.turns import InboxCompletion, LeaseLostError


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
    """What a save writes to the session row."""

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


class SessionIO(Protocol):
    async def load(self, session_id: str, known_version: datetime | None = None) -> LoadedSession | None:
        """The session row, and its messages unless the row's updated_at equals `known_version`."""
        ...

    async def save(
        self,
        session_id: str,
        created_at: datetime | None,
        fields: SessionFields,
        pruned: list[int],
        rows: list[MessageFields],
        completion: InboxCompletion | None = None,
    ) -> bool:
        """One transaction: the session row (inserted when `created_at` is given, else updated),
        pruned positions deleted, new messages inserted, and the worker's inbox row and outbox rows.
        False when the session row to update is gone; LeaseLostError when the inbox row is."""
        ...

    async def is_processed(self, key: str, now: datetime) -> bool: ...

    async def mark(self, key: str, platform: str, now: datetime, expires_at: datetime) -> bool:
        """Insert the key, or take over an expired one; True when this call did either."""
        ...

    async def aclose(self) -> None: ...


class EngineIO:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def load(self, session_id: str, known_version: datetime | None = None) -> LoadedSession | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        SessionRow.active_agent_name,
                        SessionRow.title,
                        SessionRow.metadata_json,
                        SessionRow.created_at,
                        SessionRow.updated_at,
                    ).where(SessionRow.session_id == session_id)
                )
            ).one_or_none()
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

    async def save(
        self,
        session_id: str,
        created_at: datetime | None,
        fields: SessionFields,
        pruned: list[int],
        rows: list[MessageFields],
        completion: InboxCompletion | None = None,
    ) -> bool:
        values: dict[str, Any] = {
            "active_agent_name": fields.active_agent_name,
            "title": fields.title,
            "metadata_json": fields.metadata,
            "updated_at": fields.updated_at,
            "message_count": fields.message_count,
        }
        async with self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            if created_at is not None:
                await conn.execute(
                    insert(SessionRow).values(session_id=session_id, created_at=created_at, **values)
                )
            else:
                # Also takes the row lock, so a concurrent delete waits for this commit or wins before it.
                # As _UPDATE_SESSION: a stored title is kept (a rename during the turn wins).
                values["title"] = func.coalesce(SessionRow.title, fields.title)
                result = await conn.execute(
                    update(SessionRow).where(SessionRow.session_id == session_id).values(**values)
                )
                if result.rowcount == 0:
                    await conn.rollback()
                    return False
            if pruned:
                await conn.execute(
                    delete(MessageRow).where(
                        MessageRow.session_id == session_id, MessageRow.position.in_(pruned)
                    )
                )
            if rows:
                await conn.execute(
                    insert(MessageRow),
                    [
                        {
                            "session_id": session_id,
                            "position": r.position,
                            "role": r.role,
                            "message_json": r.message,
                            "created_at": r.created_at,
                        }
                        for r in rows
                    ],
                )
            if completion is not None:
                await _complete_engine(conn, completion, fields.updated_at)
        return True

    async def is_processed(self, key: str, now: datetime) -> bool:
        async with self.engine.connect() as conn:
            found = await conn.scalar(
                select(ProcessedMessageRow.message_key).where(
                    ProcessedMessageRow.message_key == key, ProcessedMessageRow.expires_at > now
                )
            )
        return found is not None

    async def mark(self, key: str, platform: str, now: datetime, expires_at: datetime) -> bool:
        values = {"message_key": key, "platform": platform, "processed_at": now, "expires_at": expires_at}
        async with self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            result = await conn.execute(dedup.claim_keys(self.engine.dialect.name, [values], now))
        return bool(result.rowcount)

    async def aclose(self) -> None:
        """The engine belongs to the store."""


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


_IS_PROCESSED = "SELECT 1 FROM chatflow_processed_messages WHERE message_key = ? AND expires_at > ?"


class SQLiteFileIO:
    """The same statements as EngineIO, as plain SQL on the store's own sqlite3 connection."""

    def __init__(self, thread: SQLiteThread, *, owns_thread: bool = True) -> None:
        self.thread = thread
        self.writer = queue.group_commit(thread)
        self._owns_thread = owns_thread

    async def load(self, session_id: str, known_version: datetime | None = None) -> LoadedSession | None:
        known = None if known_version is None else to_sqlite_datetime(known_version)

        def read(conn: sqlite3.Connection) -> LoadedSession | None:
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

        return await self.writer.read(read)

    async def save(
        self,
        session_id: str,
        created_at: datetime | None,
        fields: SessionFields,
        pruned: list[int],
        rows: list[MessageFields],
        completion: InboxCompletion | None = None,
    ) -> bool:
        session_values = (
            fields.active_agent_name,
            fields.title,
            json.dumps(fields.metadata),
            to_sqlite_datetime(fields.updated_at),
            fields.message_count,
            session_id,
        )
        # Parameters are built here, so the sqlite thread only runs statements: few of them, since
        # each releases and re-takes the GIL (multi-row inserts and deletes).
        session_row = (
            (_INSERT_SESSION, (*session_values, to_sqlite_datetime(created_at)))
            if created_at is not None
            else (_UPDATE_SESSION, session_values)
        )
        statements = [
            (_delete_messages_sql(len(positions)), (session_id, *positions)) for positions in _chunks(pruned)
        ]
        message_values = [
            (session_id, r.position, r.role, json.dumps(r.message), to_sqlite_datetime(r.created_at))
            for r in rows
        ]
        statements += [
            (_insert_messages_sql(len(chunk)), tuple(v for row in chunk for v in row))
            for chunk in _chunks(message_values)
        ]
        complete = None if completion is None else _completion_sqlite(completion, fields.updated_at)

        def write(conn: sqlite3.Connection) -> bool:
            if conn.execute(*session_row).rowcount == 0:
                return False  # the session was deleted meanwhile; nothing was written
            for statement, params in statements:
                conn.execute(statement, params)
            if complete is not None:
                complete(conn)  # LeaseLostError when the inbox row is no longer ours: nothing is kept
            return True

        return await self.writer.write(write)

    async def is_processed(self, key: str, now: datetime) -> bool:
        stamp = to_sqlite_datetime(now)
        return await self.writer.read(
            lambda conn: conn.execute(_IS_PROCESSED, (key, stamp)).fetchone() is not None
        )

    async def mark(self, key: str, platform: str, now: datetime, expires_at: datetime) -> bool:
        stamp = to_sqlite_datetime(now)
        values = (key, platform, stamp, to_sqlite_datetime(expires_at), stamp)
        return await self.writer.write(
            lambda conn: conn.execute(dedup.CLAIM_KEY_SQLITE, values).rowcount == 1
        )

    async def aclose(self) -> None:
        if self._owns_thread:
            await self.thread.aclose()


async def _complete_engine(conn: AsyncConnection, completion: InboxCompletion, now: datetime) -> None:
    done = await conn.execute(
        update(InboxRow)
        .where(
            InboxRow.id == completion.inbox_id,
            InboxRow.lease_owner == completion.lease_owner,
            InboxRow.status == "pending",
        )
        .values(status="done", finished_at=now, lease_owner=None, lease_until=None)
    )
    if done.rowcount != 1:
        raise LeaseLostError(f"inbox row {completion.inbox_id} is no longer held by {completion.lease_owner}")
    if completion.outbox:
        await conn.execute(
            insert(OutboxRow),
            [
                {
                    "inbox_id": completion.inbox_id,
                    "platform": entry.platform,
                    "session_id": entry.session_id,
                    "kind": entry.kind,
                    "text": entry.text,
                    "target_json": entry.target,
                    "status": "pending",
                    "attempts": 0,
                    "next_attempt_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for entry in completion.outbox
            ],
        )


_COMPLETE_INBOX = (
    "UPDATE chatflow_inbox SET status = 'done', finished_at = ?, lease_owner = NULL, lease_until = NULL "
    "WHERE id = ? AND lease_owner = ? AND status = 'pending'"
)


@functools.cache
def _insert_outbox_sql(count: int) -> str:
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?)"] * count)
    return (
        "INSERT INTO chatflow_outbox (inbox_id, platform, session_id, kind, text, target_json, status, "
        f"attempts, next_attempt_at, created_at, updated_at) VALUES {rows}"
    )


def _completion_sqlite(completion: InboxCompletion, now: datetime) -> Callable[[sqlite3.Connection], None]:
    """The inbox row done and the outbox rows, parameters built here so the thread only runs SQL."""
    stamp = to_sqlite_datetime(now)
    done = (stamp, completion.inbox_id, completion.lease_owner)
    rows = [
        (
            completion.inbox_id,
            e.platform,
            e.session_id,
            e.kind,
            e.text,
            json.dumps(e.target),
            stamp,
            stamp,
            stamp,
        )
        for e in completion.outbox
    ]
    chunks = [(_insert_outbox_sql(len(chunk)), [v for row in chunk for v in row]) for chunk in _chunks(rows)]

    def write(conn: sqlite3.Connection) -> None:
        if conn.execute(_COMPLETE_INBOX, done).rowcount != 1:
            raise LeaseLostError(
                f"inbox row {completion.inbox_id} is no longer held by {completion.lease_owner}"
            )
        for statement, params in chunks:
            conn.execute(statement, params)

    return write
