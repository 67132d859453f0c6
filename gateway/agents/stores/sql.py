"""Sessions in SQL (SQLite or PostgreSQL): the agents' face of the store's session repository.

The statements live in gateway/store/sessions.py (and a turn's unit of work in gateway/store/turns.py);
this class turns SessionContexts into their rows and back, keeps recently decoded histories, and holds
a session exclusively while a turn runs on it.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gateway.agents.agent import Agent
from gateway.agents.context import DEFAULT_MAX_TURNS, DEFAULT_TITLE, SessionContext
from gateway.agents.stores.base import (
    DEFAULT_DEDUP_TTL_HOURS,
    BaseSessionStore,
    SessionDeletedError,
    SessionInfo,
)
from gateway.domain.messages import Message, utcnow
from gateway.domain.sessions import StoredVersion
from gateway.store import dedup, migrations, sessions, turns
from gateway.store.database import Database, Engine
from gateway.store.engine import async_url
from gateway.store.session_locks import session_lock

RECENT_SESSIONS = 1000  # decoded sessions kept per store, so a turn need not re-read its history
PG_SESSION_LOCKS = 20  # sessions one store runs turns on at once, on a database it opens


@dataclass(frozen=True)
class _Remembered:
    """A session as this store last read or wrote it: its row (`updated_at` is its version) and its
    decoded messages (never changed in place once stored, so turns may share them)."""

    updated_at: datetime
    created_at: datetime
    agent_name: str
    title: str | None
    metadata: dict[str, Any]
    messages: tuple[Message, ...]


class SQLSessionStore(BaseSessionStore):
    """A store on a database URL (it then opens and closes its own `Database`), on the service's
    `Database`, or on an AsyncEngine (for library use; the store closes what it opened on it, never
    the engine). Migrates the schema to head on first use."""

    def __init__(
        self,
        url_or_database: str | Database | Any,
        default_max_turns: int = DEFAULT_MAX_TURNS,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        default_title: str = DEFAULT_TITLE,
    ) -> None:
        super().__init__(default_max_turns, dedup_ttl_hours, default_title=default_title)
        if isinstance(url_or_database, Database):
            self.database, self._owns_database = url_or_database, False
        elif isinstance(url_or_database, str):
            self.database = Database.open(url_or_database, **_pool_options(url_or_database))
            self._owns_database = True
        else:  # an AsyncEngine (TypeError for anything else)
            self.database, self._owns_database = Database.on_engine(url_or_database), True
        self._schema_ready = False
        self._schema_checks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._recent: OrderedDict[str, _Remembered] = OrderedDict()
        # Each PostgreSQL session lock holds a pooled connection for the whole turn; leave the other
        # half of the pool for the turns' own reads and writes, so lock holders cannot starve them.
        self._lock = session_lock(self.database, _pool_capacity(self.database) // 2)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine underneath (for library users' own queries on the same tables)."""
        return self.database.engine

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.database.engine.url.render_as_string(hide_password=True)!r})"

    async def aclose(self) -> None:
        if self._owns_database:
            await self.database.aclose()

    async def _ready(self) -> Database:
        """The schema is checked once, by whoever comes first (a lock per event loop): a burst of turns
        on a new store ran one check each, each on a connection of its own, and 2,000 turns whose
        model answers came back together waited 0.7 s for them before any reply went out."""
        if not self._schema_ready:
            async with self._schema_checks.setdefault(asyncio.get_running_loop(), asyncio.Lock()):
                if not self._schema_ready:
                    await migrations.ensure_head(self.database.engine)
                    self._schema_ready = True
        return self.database

    # --- sessions -----------------------------------------------------------------------------
    async def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        *,
        metadata: dict[str, Any] | None = None,
        max_turns: int | None = None,
        stored: StoredVersion | None = None,
    ) -> SessionContext:
        """`stored`: the session's version as the caller read it under its conversation's lease (the
        worker's claim): no read at all when it says there is no row, or names the version this store
        remembers."""
        session = await self._load(session_id, max_turns, stored)
        if session is None:
            return SessionContext(session_id, default_agent, max_turns or self.default_max_turns, metadata)
        if metadata:
            session.metadata.update(metadata)
        return session

    async def get(self, session_id: str) -> SessionContext | None:
        return await self._load(session_id, None)

    async def _load(
        self, session_id: str, max_turns: int | None, stored: StoredVersion | None = None
    ) -> SessionContext | None:
        remembered = self._recent.get(session_id)
        if stored is not None and stored.updated_at is None:
            self._recent.pop(session_id, None)
            return None
        if stored is not None and remembered is not None and remembered.updated_at == stored.updated_at:
            self._recent.move_to_end(session_id)
            return self._session_of(session_id, max_turns, remembered)
        db = await self._ready()
        loaded = await sessions.load(db, session_id, remembered.updated_at if remembered else None)
        if loaded is None:
            self._recent.pop(session_id, None)
            return None
        if loaded.messages is None and remembered is not None:
            messages = remembered.messages  # unchanged since this store last saw it: no decoding
        else:
            messages = tuple(_decoded(loaded.messages or ()))
        remembered = _Remembered(
            loaded.updated_at,
            loaded.created_at,
            loaded.agent_name or "",
            loaded.title,
            loaded.metadata,
            messages,
        )
        self._remember(session_id, remembered)
        return self._session_of(session_id, max_turns, remembered)

    def _session_of(self, session_id: str, max_turns: int | None, remembered: _Remembered) -> SessionContext:
        session = SessionContext(
            session_id,
            self._resolve_agent(remembered.agent_name),
            max_turns or self.default_max_turns,
            dict(remembered.metadata),
        )
        session.title = remembered.title
        session.created_at, session.updated_at = remembered.created_at, remembered.updated_at
        session.history = list(remembered.messages)
        session._mark_saved()
        return session

    def _remember(self, session_id: str, remembered: _Remembered) -> None:
        """Keep recently used sessions, checked by updated_at on every load."""
        self._recent.pop(session_id, None)
        self._recent[session_id] = remembered
        while len(self._recent) > RECENT_SESSIONS:
            self._recent.popitem(last=False)

    async def save(self, session: SessionContext, also: object | None = None) -> None:
        """`also`: a gateway.store.turns.TurnCompletion to commit with the session (the worker's)."""
        if also is not None and not isinstance(also, turns.TurnCompletion):
            raise TypeError("also must be a gateway.store.turns.TurnCompletion")
        db = await self._ready()
        now = utcnow()
        title = self._title_for(session)
        fields = sessions.SessionFields(
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
                sessions.MessageFields(
                    message.position, message.role.value, message.to_dict(), message.created_at
                )
            )
        write = sessions.TurnWrite(
            session.session_id,
            session.created_at if session._is_new else None,
            fields,
            sorted(session._pruned_positions()),
            rows,
        )
        if not await turns.commit(db, write, also):
            raise SessionDeletedError(session.session_id)
        session.title = title
        session.updated_at = now
        session._mark_saved()
        self._remember(
            session.session_id,
            _Remembered(
                now,
                session.created_at,
                session.active_agent.name,
                title,
                dict(session.metadata),
                tuple(session.history),
            ),
        )

    async def delete(self, session_id: str) -> bool:
        db = await self._ready()
        self._recent.pop(session_id, None)
        return await sessions.delete_session(db, session_id)

    async def list_sessions(self, limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        if limit < 0 or offset < 0:
            raise ValueError("limit and offset must be zero or more")
        db = await self._ready()
        return [
            SessionInfo(
                session_id=listing.session.session_id,
                title=listing.session.title,
                active_agent_name=listing.session.active_agent,
                created_at=listing.session.created_at,
                updated_at=listing.session.updated_at,
                message_count=listing.session.message_count,
                metadata=listing.metadata,
            )
            for listing in await sessions.recent(db, limit, offset)
        ]

    # --- cross-process serialization --------------------------------------------------------
    @asynccontextmanager
    async def _exclusive(self, session_id: str) -> AsyncIterator[None]:
        async with self._lock(session_id):
            yield

    # --- dedup --------------------------------------------------------------------------------
    async def is_message_processed(self, key: str) -> bool:
        return await dedup.is_processed(await self._ready(), key)

    async def mark_message_processed(self, key: str, platform: str = "") -> bool:
        return await dedup.mark(await self._ready(), key, platform, self.dedup_ttl)

    async def purge_expired(self) -> int:
        """Delete expired keys in bounded batches, each its own short transaction."""
        return await dedup.purge_expired(await self._ready())


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


def _pool_capacity(db: Database) -> int:
    pool = db.engine.sync_engine.pool
    size = getattr(pool, "size", None)
    overflow = int(getattr(pool, "_max_overflow", 0))
    return (int(size()) if callable(size) else 5) + max(0, overflow)


def _decoded(rows: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[Message]:
    for position, data in rows:
        message = Message.from_dict(data)
        message.position = position
        yield message
