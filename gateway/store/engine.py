"""Async engines for SQLite (the embedded default) and PostgreSQL (the scale-out path).

Only the composition root, the CLI and the migration runner call ``create_engine``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, Connection, ExceptionContext, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from gateway.errors import DatabaseUnavailableError
from gateway.store import storable

SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=5000",
    "PRAGMA synchronous=NORMAL",
)
# Execution option: start the transaction with BEGIN IMMEDIATE, taking SQLite's write lock up front.
# A deferred transaction that reads and then writes can fail at once with SQLITE_BUSY when another
# connection wrote meanwhile; busy_timeout only helps when the lock is taken at BEGIN.
SQLITE_IMMEDIATE = "sqlite_immediate"
CONNECT_TIMEOUT_SECONDS = 10
# SQL function on every SQLite connection: Unicode case folding (SQLite's lower() folds ASCII only),
# for case-insensitive searches such as the admin API's title filter.
SQLITE_CASEFOLD = "gateway_casefold"


def _casefold(value: object) -> object:
    return value.casefold() if isinstance(value, str) else value


def is_memory_sqlite(url: str | URL) -> bool:
    parsed = make_url(url)
    return parsed.get_backend_name() == "sqlite" and (
        parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
    )


# Sync drivers' URLs a user may well write, and the async drivers the gateway runs them with.
_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+pysqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgresql+psycopg2": "postgresql+asyncpg",
    "postgresql+psycopg": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
}


def async_url(url: str | URL) -> URL:
    """`sqlite:///x.db` -> `sqlite+aiosqlite:///x.db`, `postgresql://…` -> `postgresql+asyncpg://…`."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=driver) if driver else parsed


def sqlite_file_path(url: str | URL) -> Path | None:
    """The file of an SQLite URL (absolute), or None for PostgreSQL and in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or is_memory_sqlite(parsed) or not parsed.database:
        return None
    return Path(parsed.database).expanduser().resolve()


def create_private_file(path: Path) -> None:
    """Create the database file (and its folder) readable by this user only, unless it exists.

    It holds every conversation; SQLite gives its -wal and -shm files the database file's permissions.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # a folder it creates: this user's only
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def safe_url(url: str | URL) -> str:
    """The URL with its password hidden, fit for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def create_engine(
    url: str | URL, *, pool_timeout: float | None = None, pool_size: int | None = None, **kwargs: Any
) -> AsyncEngine:
    """An engine for `url`. On PostgreSQL: `pool_timeout` (seconds, the service's) is the longest wait
    for a pooled connection (SQLAlchemy's default is 30 s); at most `pool_size` connections, kept open
    (SQLAlchemy's default is 5, plus 10 opened and closed in bursts). No ping before each use: it cost
    a round trip per transaction; a connection the server dropped fails its operation once, and
    SQLAlchemy then replaces every connection of the pool.

    No server-side statement_timeout: a webhook's wait is bounded where it waits (store/ingest.py), and
    a limit on every statement also cut the claims short once a backlog made them slow, which stopped
    every turn instead of slowing them (measured: a 3,500-row backlog, claims of 4-5 s on a loaded host).
    """
    # A statement's parameters (message text, phone numbers) stay out of its errors' messages, which
    # are logged and shown; SQLAlchemy's own SQL logging omits them as well.
    kwargs.setdefault("hide_parameters", True)
    # JSON columns are encoded by the storable rule (NaN as null, bounded depth; see storable.py).
    kwargs.setdefault("json_serializer", storable.json_text)
    parsed = async_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _create_sqlite_engine(parsed, **kwargs)
    if pool_timeout is not None:
        kwargs.setdefault("pool_timeout", pool_timeout)
    if pool_size is not None:
        # A fixed pool: connections opened beyond it ("overflow") are closed on return, and opening
        # them again (TLS negotiation, authentication) took a tenth of the process's CPU under load.
        kwargs.setdefault("pool_size", pool_size)
        kwargs.setdefault("max_overflow", 0)
    engine = create_async_engine(parsed, connect_args={"timeout": CONNECT_TIMEOUT_SECONDS}, **kwargs)
    event.listen(engine.sync_engine, "handle_error", _drop_a_broken_driver_state)
    return engine


def _drop_a_broken_driver_state(context: ExceptionContext) -> None:
    """asyncpg left mid-operation by a fault ("cannot switch to state 11; another operation is in
    progress": an InternalClientError, seen after a terminated backend) keeps its connection open, so
    the dialect does not call it a disconnect, and the pool lent it again: every later use failed.
    It is one: that connection is dropped (not the pool's others). The lanes do the same
    (store/postgres_lanes.py)."""
    import asyncpg  # type: ignore[import-untyped]  # the postgres extra: only PostgreSQL gets here

    if isinstance(context.original_exception.__cause__, asyncpg.InternalClientError):
        context.is_disconnect = True
        context.invalidate_pool_on_disconnect = False


def _create_sqlite_engine(url: URL, **kwargs: Any) -> AsyncEngine:
    if is_memory_sqlite(url):
        # Exactly one connection, lent to one user at a time: every user sees the same in-memory
        # database, and concurrent tasks queue for it instead of nesting transactions on it.
        kwargs.update(
            poolclass=AsyncAdaptedQueuePool,
            pool_size=1,
            max_overflow=0,
            connect_args={"check_same_thread": False},
        )
    else:
        assert url.database is not None
        create_private_file(Path(url.database).expanduser())
    engine = create_async_engine(url, **kwargs)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy (the driver's implicit BEGIN is unreliable), so
        # DDL is transactional and BEGIN IMMEDIATE is possible; see the "begin" hook below.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()
        dbapi_connection.create_function(SQLITE_CASEFOLD, 1, _casefold, deterministic=True)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(SQLITE_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def describe_failure(url: str | URL, exc: BaseException) -> str:
    """One line saying why the database could not be used, without a password or a traceback."""
    reason = getattr(exc, "orig", None) or exc
    detail = str(reason).strip().splitlines()[0] if str(reason).strip() else type(reason).__name__
    return f"cannot use the database at {safe_url(url)}: {detail}"


async def ping(engine: AsyncEngine) -> None:
    """Raise DatabaseUnavailableError unless the database answers a trivial query."""
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except (SQLAlchemyError, OSError, TimeoutError) as exc:
        raise DatabaseUnavailableError(describe_failure(engine.url, exc)) from exc
