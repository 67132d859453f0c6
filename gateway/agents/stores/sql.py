"""Sessions in SQL (SQLite or PostgreSQL), on the same tables and migrations as the gateway service.

A turn writes only what changed, in one transaction: the session row, the pruned positions
deleted, the new messages appended. Loading reads the session row and its kept window through
the (session_id, position) index, so neither the number of sessions nor the turns pruned before
make a turn slower.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.agents.agent import Agent
from gateway.agents.context import DEFAULT_MAX_TURNS, DEFAULT_TITLE, SessionContext
from gateway.agents.stores.base import (
    DEFAULT_DEDUP_TTL_HOURS,
    BaseSessionStore,
    SessionDeletedError,
    SessionInfo,
)
from gateway.agents.stores.sql_io import EngineIO, MessageFields, SessionFields, SessionIO, SQLiteFileIO
from gateway.domain.messages import Message, utcnow
from gateway.store import dedup, migrations, queue
from gateway.store.engine import SQLITE_IMMEDIATE, async_url, create_engine, sqlite_file_path
from gateway.store.sqlite_thread import SQLiteThread
from gateway.store.tables import SessionRow
from gateway.store.turns import InboxCompletion

SQLITE_LOCK_BUCKETS = 1024
RECENT_SESSIONS = 1000  # decoded sessions kept per store, so a turn need not re-read its history
PG_SESSION_LOCKS = 20  # sessions one store runs turns on at once, on an engine it creates


class SQLSessionStore(BaseSessionStore):
    """A store on any SQLAlchemy async URL or engine; migrates the schema to head on first use."""

    def __init__(
        self,
        url_or_engine: str | AsyncEngine,
        default_max_turns: int = DEFAULT_MAX_TURNS,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        default_title: str = DEFAULT_TITLE,
        sqlite_thread: SQLiteThread | None = None,
    ) -> None:
        """`sqlite_thread`: share the service's SQLite writer thread (one connection writes, so writers
        in one process queue there instead of in SQLite's busy handler, which sleeps)."""
        super().__init__(default_max_turns, dedup_ttl_hours, default_title=default_title)
        if isinstance(url_or_engine, AsyncEngine):
            self.engine, self._owns_engine = url_or_engine, False
        elif isinstance(url_or_engine, str):
            self.engine, self._owns_engine = (
                create_engine(url_or_engine, **_pool_options(url_or_engine)),
                True,
            )
        else:
            raise TypeError("url_or_engine must be a database URL or an AsyncEngine")
        self._dialect = self.engine.dialect.name
        self._schema_ready = False
        self._recent: OrderedDict[str, tuple[datetime, tuple[Message, ...]]] = OrderedDict()
        self._lock_dir = _sqlite_lock_dir(self.engine)
        sqlite_file = sqlite_file_path(self.engine.url)
        self._io: SessionIO = EngineIO(self.engine)
        self._sqlite_thread: SQLiteThread | None = None
        if sqlite_thread is not None:
            self._io = SQLiteFileIO(sqlite_thread, owns_thread=False)
        elif sqlite_file is not None:
            self._io = SQLiteFileIO(SQLiteThread(sqlite_file))
        if isinstance(self._io, SQLiteFileIO):
            # The one writer of this file in the process: the inbox worker and delivery use it too.
            self._sqlite_thread = self._io.thread
            queue.attach(self.engine, self._io.thread)
        # Each PostgreSQL session lock holds a pooled connection for the whole turn; leave the other
        # half of the pool for the turns' own reads and writes, so lock holders cannot starve them.
        self._pg_lock_slots = asyncio.Semaphore(max(1, _pool_capacity(self.engine) // 2))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.url.render_as_string(hide_password=True)!r})"

    async def aclose(self) -> None:
        if self._sqlite_thread is not None:
            queue.detach(self.engine, self._sqlite_thread)
        await self._io.aclose()
        if self._owns_engine:
            await self.engine.dispose()

    async def _ready(self) -> AsyncEngine:
        if not self._schema_ready:
            await migrations.ensure_head(self.engine)
            self._schema_ready = True
        return self.engine

    def _write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A transaction that takes SQLite's write lock at BEGIN (a no-op option elsewhere)."""
        return self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin()

    # --- sessions -----------------------------------------------------------------------------
    async def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        *,
        metadata: dict[str, Any] | None = None,
        max_turns: int | None = None,
    ) -> SessionContext:
        session = await self._load(session_id, max_turns)
        if session is None:
            return SessionContext(session_id, default_agent, max_turns or self.default_max_turns, metadata)
        if metadata:
            session.metadata.update(metadata)
        return session

    async def get(self, session_id: str) -> SessionContext | None:
        return await self._load(session_id, None)

    async def _load(self, session_id: str, max_turns: int | None) -> SessionContext | None:
        await self._ready()
        cached = self._recent.get(session_id)
        loaded = await self._io.load(session_id, cached[0] if cached else None)
        if loaded is None:
            self._recent.pop(session_id, None)
            return None
        session = SessionContext(
            session_id,
            self._resolve_agent(loaded.agent_name or ""),
            max_turns or self.default_max_turns,
            loaded.metadata,
        )
        session.title = loaded.title
        session.created_at, session.updated_at = loaded.created_at, loaded.updated_at
        if loaded.messages is None and cached is not None:
            session.history = list(cached[1])  # unchanged since this store last saw it: no decoding
        else:
            for position, data in loaded.messages or ():
                message = Message.from_dict(data)
                message.position = position
                session.history.append(message)
            self._remember(session)
        session._mark_saved()
        return session

    def _remember(self, session: SessionContext) -> None:
        """Keep the decoded messages of recently used sessions, checked by updated_at on every load.

        Stored messages are never changed in place, so sharing the objects between turns is safe.
        """
        self._recent.pop(session.session_id, None)
        self._recent[session.session_id] = (session.updated_at, tuple(session.history))
        while len(self._recent) > RECENT_SESSIONS:
            self._recent.popitem(last=False)

    async def save(self, session: SessionContext, completion: InboxCompletion | None = None) -> None:
        await self._ready()
        now = utcnow()
        title = self._title_for(session)
        fields = SessionFields(
            active_agent_name=session.active_agent.name,
            title=title,
            metadata=session.metadata,
            updated_at=now,
            message_count=len(session.history),
        )
        next_position = session._next_position()
        rows = []
        for message in session._unsaved_messages():
            message.position = next_position
            next_position += 1
            rows.append(
                MessageFields(message.position, message.role.value, message.to_dict(), message.created_at)
            )
        saved = await self._io.save(
            session.session_id,
            session.created_at if session._is_new else None,
            fields,
            sorted(session._pruned_positions()),
            rows,
            completion,
        )
        if not saved:
            raise SessionDeletedError(session.session_id)
        session.title = title
        session.updated_at = now
        session._mark_saved()
        self._remember(session)

    async def delete(self, session_id: str) -> bool:
        await self._ready()
        self._recent.pop(session_id, None)
        async with self._write() as conn:
            result = await conn.execute(delete(SessionRow).where(SessionRow.session_id == session_id))
        return bool(result.rowcount)

    async def list_sessions(self, limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be zero or more")
        engine = await self._ready()
        query = (
            select(
                SessionRow.session_id,
                SessionRow.title,
                SessionRow.active_agent_name,
                SessionRow.created_at,
                SessionRow.updated_at,
                SessionRow.message_count,
                SessionRow.metadata_json,
            )
            .order_by(SessionRow.updated_at.desc(), SessionRow.session_id.desc())
            .limit(limit)
            .offset(offset)
        )
        async with engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            SessionInfo(
                session_id=r.session_id,
                title=r.title,
                active_agent_name=r.active_agent_name,
                created_at=r.created_at,
                updated_at=r.updated_at,
                message_count=r.message_count,
                metadata=r.metadata_json,
            )
            for r in rows
        ]

    # --- cross-process serialization --------------------------------------------------------
    @asynccontextmanager
    async def _exclusive(self, session_id: str) -> AsyncIterator[None]:
        if self._dialect == "postgresql":
            async with self._pg_lock_slots, self._pg_advisory_lock(session_id):
                yield
        elif self._lock_dir is not None:
            async with _file_lock(self._lock_dir / f"{_bucket(session_id)}.lock"):
                yield
        else:
            yield

    @asynccontextmanager
    async def _pg_advisory_lock(self, session_id: str) -> AsyncIterator[None]:
        key = _lock_key(session_id)
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(select(func.pg_advisory_lock(key)))
            try:
                yield
            finally:
                await asyncio.shield(_pg_unlock(conn, key))

    # --- dedup --------------------------------------------------------------------------------
    async def is_message_processed(self, key: str) -> bool:
        await self._ready()
        return await self._io.is_processed(key, utcnow())

    async def mark_message_processed(self, key: str, platform: str = "") -> bool:
        await self._ready()
        now = utcnow()
        return await self._io.mark(key, platform, now, now + self.dedup_ttl)

    async def purge_expired(self) -> int:
        """Delete expired keys in bounded batches, each its own short transaction."""
        await self._ready()
        return await dedup.purge_expired(self.engine)


class SQLiteSessionStore(SQLSessionStore):
    """The SQL store on an SQLite file path (or ":memory:")."""

    def __init__(
        self,
        db_path: str | os.PathLike[str],
        default_max_turns: int = DEFAULT_MAX_TURNS,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        default_title: str = DEFAULT_TITLE,
    ) -> None:
        path = str(db_path)
        url = "sqlite+aiosqlite:///:memory:" if path == ":memory:" else f"sqlite+aiosqlite:///{Path(path)}"
        super().__init__(url, default_max_turns, dedup_ttl_hours, default_title=default_title)


def _pool_options(url: str) -> dict[str, int]:
    """PostgreSQL: room for PG_SESSION_LOCKS turns holding a session lock, and as many working connections."""
    if async_url(url).get_backend_name() != "postgresql":
        return {}
    return {"pool_size": 10, "max_overflow": 2 * PG_SESSION_LOCKS - 10}


def _pool_capacity(engine: AsyncEngine) -> int:
    pool = engine.sync_engine.pool
    size = getattr(pool, "size", None)
    overflow = int(getattr(pool, "_max_overflow", 0))
    return (int(size()) if callable(size) else 5) + max(0, overflow)


def _sqlite_lock_dir(engine: AsyncEngine) -> Path | None:
    """Lock files live next to an SQLite file, shared by every process that opens it."""
    path = sqlite_file_path(engine.url)
    return None if path is None else path.with_suffix(".locks")


def _digest(session_id: str) -> bytes:
    return hashlib.blake2b(session_id.encode(), digest_size=8).digest()


def _lock_key(session_id: str) -> int:
    return int.from_bytes(_digest(session_id), "big", signed=True)


def _bucket(session_id: str) -> int:
    return int.from_bytes(_digest(session_id), "big") % SQLITE_LOCK_BUCKETS


async def _pg_unlock(conn: AsyncConnection, key: int) -> None:
    await conn.execute(select(func.pg_advisory_unlock(key)))


@asynccontextmanager
async def _file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on its own open file, so it excludes other processes and other tasks alike.

    The blocking flock runs in a thread; if the waiting task is cancelled, the lock it may still
    get is released as soon as it arrives.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:  # the lock folder's first use
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # uncontended: no thread hop at all
    except BlockingIOError:
        acquiring = asyncio.ensure_future(asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX))
        try:
            await asyncio.shield(acquiring)
        except BaseException:
            acquiring.add_done_callback(lambda _: os.close(fd))  # closing the file releases the lock
            raise
    try:
        yield
    finally:
        os.close(fd)
