"""The database of a process, with its backend chosen once: an SQLite file, in-memory SQLite, or PostgreSQL.

Every repository (the modules beside this one) takes a `Database`. A hot statement is written twice,
side by side in its table's module: `on_file`, plain SQL on the sqlite3 connection of the SQLite file's
writer thread, and `on_engine`, SQLAlchemy Core on an async connection (PostgreSQL, in-memory SQLite).
`Database.read` and `Database.write` run the spelling of the backend picked when the Database was
built; nothing else asks which backend it is on, except four writes of the per-message path, which
have a PostgreSQL spelling of one statement each (turns.py, postgres_ingest.py, sent_replies.py and
leases.py's claim; docs/architecture.md says why), and its reads of a session (sessions.py) and of a
handed-on row (inbox.py, outbox.py), run on `Database.postgres`'s held connections (postgres_lanes.py).

Why the file gets its own spelling: through SQLAlchemy and aiosqlite every cursor step is its own hop
to the driver's thread (a turn's save took 14), which capped a store near a thousand writes per
second. On the file, every write of the process goes through one connection on one thread
(`SQLiteThread`), through one group commit: what the process queued meanwhile (turns, claims,
delivery results, session loads) runs in one hop and one transaction, and an operation that fails
leaves no trace and does not affect the others. Two connections of one process would instead queue
for the file's write lock in SQLite's busy handler, which sleeps.

Statements that only have a SQLAlchemy spelling (the operators' reads and writes, migrations) use the
engine on every backend (`connect`, `begin`).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
    StatementError,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store.engine import SQLITE_IMMEDIATE, create_engine, sqlite_file_path
from gateway.store.group_commit import Done, GroupCommit, Outcome
from gateway.store.postgres_lanes import MAX_LANES, PostgresLanes
from gateway.store.sqlite_thread import SQLiteThread

T = TypeVar("T")
Engine = AsyncEngine  # for callers outside the store that name the engine's type
Item = TypeVar("Item")
OnFile = Callable[[sqlite3.Connection], T]
OnEngine = Callable[[AsyncConnection], Awaitable[T]]


class Run(Protocol):
    """`Database.read` / `Database.write`: one operation, in the spelling of the backend."""

    async def __call__(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T: ...


# What a database that does not answer (down, unreachable, locked past its timeout) raises: callers
# outside the store answer 503 for these without importing SQLAlchemy.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    OSError,
    TimeoutError,
)
# What a database raises when it refuses a value (not when it is away): a group commit that fails with
# one of these is committed again one submission at a time (see group_commit.py).
_REFUSED_VALUE_ERRORS: tuple[type[BaseException], ...] = (
    DataError,
    IntegrityError,
    ValueError,
    TypeError,
    RecursionError,
    sqlite3.DataError,
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
    sqlite3.ProgrammingError,
)


def refused_value(exc: BaseException) -> bool:
    """Whether `exc` says the database (or its driver, or the encoder before it) refused a value."""
    if isinstance(exc, StatementError) and not isinstance(exc, DBAPIError):
        return True  # raised while binding a parameter, before the database saw the statement
    if isinstance(exc, DBAPIError) and not isinstance(exc, DataError | IntegrityError):
        # asyncpg's errors reach SQLAlchemy wrapped: look at the driver's own error.
        driver_error = getattr(exc.orig, "__cause__", None) or exc.orig
        sqlstate = str(getattr(driver_error, "sqlstate", "") or "")
        # 22: data exception (NUL, too long, bad JSON), 23: integrity; a ValueError: refused on the
        # client side (a value of the wrong type for its column).
        return sqlstate.startswith(("22", "23")) or isinstance(driver_error, ValueError | TypeError)
    return isinstance(exc, _REFUSED_VALUE_ERRORS)


def engine_only(conn: sqlite3.Connection) -> Any:
    """The `on_file` of an operation that only ever runs on the engine (a PostgreSQL spelling)."""
    raise AssertionError("an engine-only operation reached the SQLite file")


# Everything a database call may raise besides a bug: for a command's one-line failure message.
FAILURE_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, OSError)
MAX_OPERATIONS_PER_COMMIT = 1000  # keeps the write lock short for other processes on the file
HOPS_IN_FLIGHT = 2  # batches handed to the writer thread at once (see GroupCommit)


class Database:
    """The engine, and on an SQLite file its writer thread and group commit. Built by bootstrap."""

    def __init__(self, engine: AsyncEngine, *, owns_engine: bool = True) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        # The dialect's INSERT, for ON CONFLICT clauses in the SQLAlchemy spellings.
        self.insert: Any = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._owns_engine = owns_engine
        path = sqlite_file_path(engine.url)
        self.thread = SQLiteThread(path) if path is not None else None
        self._backend: _FileBackend | _EngineBackend = (
            _EngineBackend(engine) if self.thread is None else _FileBackend(self.thread)
        )
        # Reads see the writes submitted before them; a write runs in one transaction (on the file,
        # its group commit's); `write_alone` is a write of a single statement, atomic by itself, which
        # on the engine runs outside any transaction (no BEGIN and COMMIT round trips).
        self.read: Run = self._backend.read
        self.write: Run = self._backend.write
        self.write_alone: Run = self._backend.write_alone
        # PostgreSQL: the per-message statements' held connections (postgres_lanes.py), half the pool.
        self.postgres = _lanes(engine) if self.dialect == "postgresql" else None

    @classmethod
    def open(cls, url: str, **engine_options: Any) -> Database:
        return cls(create_engine(url, **engine_options))

    @classmethod
    def on_engine(cls, engine: object) -> Database:
        """A Database on someone else's engine (library use): closing it leaves the engine open."""
        if not isinstance(engine, AsyncEngine):
            raise TypeError(
                f"expected a database URL, a Database or an AsyncEngine, got {type(engine).__name__}"
            )
        return cls(engine, owns_engine=False)

    def __repr__(self) -> str:
        return f"Database({self.engine.url.render_as_string(hide_password=True)!r})"

    def batcher(
        self,
        on_file: Callable[[list[Item]], Callable[[sqlite3.Connection], list[Outcome]]],
        on_engine: Callable[[list[Item]], Awaitable[list[Outcome]]],
        *,
        urgent: bool = False,
    ) -> GroupCommit[Item]:
        """A group commit of its own, for a writer that merges its items into few statements (webhooks).

        `on_file(items)` runs on the event loop and gives the work to run on the writer thread, outside
        any transaction (it opens its own); `urgent`: ahead of the other work waiting there.
        `on_engine` runs up to ENGINE_BATCHES_IN_FLIGHT batches at once: a batch's ids follow the
        requests answered before it was started, and it takes its locks in one order (ingest.py).
        """
        return self._backend.batcher(on_file, on_engine, urgent=urgent)

    def connect(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """An engine connection, for the SQLAlchemy-only statements."""
        return self.engine.connect()

    def begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """An engine transaction taking SQLite's write lock at BEGIN (a no-op option elsewhere)."""
        return self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin()

    @property
    def sqlite_file(self) -> Path | None:
        return None if self.thread is None else self.thread.path

    async def aclose(self) -> None:
        """Answer what was submitted, stop the writer thread and close the engine (if it is ours)."""
        await self._backend.aclose()
        if self.postgres is not None:
            await self.postgres.aclose()
        if self._owns_engine:
            await self.engine.dispose()


def _lanes(engine: AsyncEngine) -> PostgresLanes:
    pool: Any = engine.pool
    size = pool.size() if hasattr(pool, "size") else 0
    timeout = pool.timeout() if hasattr(pool, "timeout") else 30.0
    return PostgresLanes(engine, min(MAX_LANES, size // 2), timeout)


class _EngineBackend:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._batchers: list[GroupCommit[Any]] = []

    async def read(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T:
        """Outside a transaction: under READ COMMITTED each statement sees its own snapshot anyway, and
        BEGIN and ROLLBACK cost two round trips of a PostgreSQL read's four."""
        async with self.engine.connect() as conn:
            return await on_engine(await conn.execution_options(isolation_level="AUTOCOMMIT"))

    async def write(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T:
        async with self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            return await on_engine(conn)

    async def write_alone(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T:
        async with self.engine.connect() as conn:
            return await on_engine(await conn.execution_options(isolation_level="AUTOCOMMIT"))

    def batcher(
        self,
        on_file: Callable[[list[Item]], Callable[[sqlite3.Connection], list[Outcome]]],
        on_engine: Callable[[list[Item]], Awaitable[list[Outcome]]],
        *,
        urgent: bool,
    ) -> GroupCommit[Item]:
        def commit(items: list[Item], done: Done) -> None:
            task = asyncio.ensure_future(on_engine(items))

            def finished(task: asyncio.Future[list[Outcome]]) -> None:
                if task.cancelled():
                    done(None, asyncio.CancelledError())
                elif (exc := task.exception()) is not None:
                    done(None, exc)
                else:
                    done(task.result(), None)

            task.add_done_callback(finished)

        batcher = GroupCommit(
            commit, in_flight=ENGINE_BATCHES_IN_FLIGHT, max_batch=MAX_BATCH_ITEMS, isolate=refused_value
        )
        self._batchers.append(batcher)
        return batcher

    async def aclose(self) -> None:
        for batcher in self._batchers:
            await batcher.drain()


MAX_BATCH_ITEMS = 2000  # submissions of a merging batcher committed together
# Batches of a merging batcher committing at once on PostgreSQL: each waits for its round trips and its
# commit's flush, so one at a time left the server idle between them (see benchmarks/postgres.py).
ENGINE_BATCHES_IN_FLIGHT = 4


@dataclass(slots=True)
class _Operation:
    work: Callable[[sqlite3.Connection], Any]
    writes: bool


class _FileBackend:
    def __init__(self, thread: SQLiteThread) -> None:
        self.thread = thread
        self._operations: GroupCommit[_Operation] = GroupCommit(
            self._commit_operations, in_flight=HOPS_IN_FLIGHT, max_batch=MAX_OPERATIONS_PER_COMMIT
        )
        self._batchers: list[GroupCommit[Any]] = [self._operations]

    async def read(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T:
        result: T = await self._operations.submit(_Operation(on_file, writes=False))
        return result

    async def write(self, on_file: OnFile[T], on_engine: OnEngine[T]) -> T:
        result: T = await self._operations.submit(_Operation(on_file, writes=True))
        return result

    write_alone = write  # the group commit's transaction costs a single write nothing more

    def _commit_operations(self, batch: list[_Operation], done: Done) -> None:
        self.thread.post(functools.partial(_run_batch, batch), done)

    def batcher(
        self,
        on_file: Callable[[list[Item]], Callable[[sqlite3.Connection], list[Outcome]]],
        on_engine: Callable[[list[Item]], Awaitable[list[Outcome]]],
        *,
        urgent: bool,
    ) -> GroupCommit[Item]:
        def commit(items: list[Item], done: Done) -> None:
            self.thread.post(on_file(items), done, urgent=urgent)

        batcher = GroupCommit(
            commit, in_flight=HOPS_IN_FLIGHT, max_batch=MAX_BATCH_ITEMS, isolate=refused_value
        )
        self._batchers.append(batcher)
        return batcher

    async def aclose(self) -> None:
        for batcher in self._batchers:
            await batcher.drain()
        await self.thread.aclose()


def _run_batch(batch: list[_Operation], conn: sqlite3.Connection) -> list[Outcome]:
    """On the writer thread: the batch's operations in order, its writes in one transaction.

    A write that raises leaves no trace and its caller gets the exception; the others commit together.
    If the COMMIT fails, every write of the batch gets that error. Optimistically without savepoints
    (each statement costs a release and a re-acquisition of the GIL); if a write fails, the whole
    transaction is rolled back and the batch runs again with a savepoint around each write. So an
    operation may run twice, the first run leaving no trace: it must depend only on the database.
    """
    if not any(op.writes for op in batch):
        return _run_operations(conn, batch, savepoints=False)
    conn.execute("BEGIN IMMEDIATE")
    outcomes: list[Outcome] = []
    try:
        outcomes = _run_operations(conn, batch, savepoints=False)
        if any(op.writes and not ok for op, (ok, _) in zip(batch, outcomes, strict=True)):
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            outcomes = _run_operations(conn, batch, savepoints=True)
        conn.execute("COMMIT")
    except BaseException as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if not isinstance(exc, Exception):
            raise
        # Nothing was written: every write of the batch shares the failure; the reads that ran stand.
        return [
            outcomes[i] if i < len(outcomes) and not op.writes else (False, exc) for i, op in enumerate(batch)
        ]
    return outcomes


def _run_operations(conn: sqlite3.Connection, batch: list[_Operation], *, savepoints: bool) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for op in batch:
        isolated = savepoints and op.writes
        if isolated:
            conn.execute("SAVEPOINT operation")
        try:
            value = op.work(conn)
        except Exception as exc:
            if isolated:
                conn.execute("ROLLBACK TO operation")
                conn.execute("RELEASE operation")
            outcomes.append((False, exc))
        else:
            if isolated:
                conn.execute("RELEASE operation")
            outcomes.append((True, value))
    return outcomes
