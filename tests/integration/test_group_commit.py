"""Group commit on an SQLite file (gateway.store.group_commit through Database's file backend), on real files.

Operations queued together run in one hop and one transaction; one that fails leaves no trace and
costs the others nothing; a failed COMMIT fails every write of its hop; an operation whose caller
gave up before its hop never runs.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.agents import SQLiteSessionStore, SQLSessionStore
from gateway.store.database import Database
from gateway.store.sqlite_thread import SQLiteThread

T = TypeVar("T")


async def _no_engine(conn: AsyncConnection) -> Any:
    raise AssertionError("a Database on an SQLite file runs the file's spelling")


class Writer:
    """A Database's operations with only the file's spelling, as these tests submit them."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self.database.write(work, _no_engine)

    async def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self.database.read(work, _no_engine)


def open_database(path: Path) -> Database:
    return Database.open(f"sqlite+aiosqlite:///{path}")


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[Database]:
    database = open_database(tmp_path / "g.db")
    assert database.thread is not None
    await database.thread.run(
        lambda conn: conn.execute("CREATE TABLE items (name TEXT PRIMARY KEY, n INTEGER)")
    )
    yield database
    await database.aclose()


@pytest.fixture
def thread(database: Database) -> SQLiteThread:
    assert database.thread is not None
    return database.thread


@pytest.fixture
def writer(database: Database) -> Writer:
    return Writer(database)


def insert(name: str, n: int = 0) -> Callable[[sqlite3.Connection], int]:
    return lambda conn: conn.execute("INSERT INTO items VALUES (?, ?)", (name, n)).rowcount


def names(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [name for (name,) in conn.execute("SELECT name FROM items ORDER BY name")]
    finally:
        conn.close()


async def test_concurrent_writes_share_hops_and_each_gets_its_result(
    thread: SQLiteThread, writer: Writer
) -> None:
    statements: list[str] = []
    await writer.write(lambda conn: conn.set_trace_callback(statements.append))
    results = await asyncio.gather(*(writer.write(insert(f"i{k:03}")) for k in range(200)))
    await writer.write(lambda conn: conn.set_trace_callback(None))
    assert results == [1] * 200
    # The 200 writes, queued in one turn of the loop, in one transaction; then the one that stops tracing.
    assert statements.count("BEGIN IMMEDIATE") == 2
    assert names(thread.path) == [f"i{k:03}" for k in range(200)]


async def test_a_failing_write_leaves_no_trace_and_the_others_commit(
    thread: SQLiteThread, writer: Writer
) -> None:
    await writer.write(insert("taken"))

    def half_then_fail(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO items VALUES ('half', 1)")
        conn.execute("INSERT INTO items VALUES ('taken', 2)")  # primary key: fails after a write

    outcomes = await asyncio.gather(
        writer.write(insert("a")),
        writer.write(half_then_fail),
        writer.write(insert("b")),
        writer.read(lambda conn: conn.execute("SELECT count(*) FROM items").fetchone()[0]),
        return_exceptions=True,
    )
    assert outcomes[0] == 1
    assert isinstance(outcomes[1], sqlite3.IntegrityError)
    assert outcomes[2] == 1
    assert outcomes[3] == 3  # a read sees the writes queued before it: taken, a, b
    assert names(thread.path) == ["a", "b", "taken"]  # no "half"


async def test_a_failed_commit_fails_every_write_of_its_hop(tmp_path: Path) -> None:
    database = open_database(tmp_path / "fk.db")
    thread = database.thread
    assert thread is not None
    try:
        # A deferred foreign key is checked at COMMIT: a dangling child makes the COMMIT fail.
        await thread.run(
            lambda conn: conn.executescript(
                "CREATE TABLE parent (id INTEGER PRIMARY KEY);"
                "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER "
                "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);"
            )
        )
        writer = Writer(database)
        outcomes = await asyncio.gather(
            writer.write(lambda conn: conn.execute("INSERT INTO parent VALUES (1)").rowcount),
            writer.write(lambda conn: conn.execute("INSERT INTO child VALUES (1, 99)").rowcount),
            return_exceptions=True,
        )
        assert all(isinstance(o, sqlite3.IntegrityError) for o in outcomes), outcomes
        count = await writer.read(lambda conn: conn.execute("SELECT count(*) FROM parent").fetchone()[0])
        assert count == 0  # the good write went down with its hop: nothing is half-committed
        assert await writer.write(lambda conn: conn.execute("INSERT INTO parent VALUES (2)").rowcount) == 1
    finally:
        await database.aclose()


async def test_an_operation_cancelled_before_its_hop_never_runs(thread: SQLiteThread, writer: Writer) -> None:
    first = asyncio.ensure_future(writer.write(insert("kept")))
    cancelled = asyncio.ensure_future(writer.write(insert("never")))
    await asyncio.sleep(0)  # both are queued; their hop starts at the loop's next turn
    cancelled.cancel()
    assert await first == 1
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert names(thread.path) == ["kept"]


def test_one_writer_serves_successive_event_loops(tmp_path: Path) -> None:
    """Runner.run (a script's blocking call) starts a new event loop each time, on the same store."""
    store = SQLiteSessionStore(tmp_path / "s.db")
    try:
        for n in range(3):
            assert asyncio.run(store.mark_message_processed(f"key-{n}"))
        assert not asyncio.run(store.mark_message_processed("key-1"))
    finally:
        asyncio.run(store.aclose())


async def test_a_session_store_on_the_services_database_writes_through_its_writer(tmp_path: Path) -> None:
    database = open_database(tmp_path / "w.db")
    try:
        assert database.thread is not None  # a file: one writer thread, built with the Database
        store = SQLSessionStore(database)
        assert store.database is database  # no second writer of its own
        assert await store.mark_message_processed("k")
        await store.aclose()  # the service's Database stays open: the store did not make it
        assert await Writer(database).read(lambda conn: conn.execute("SELECT 1").fetchone()[0]) == 1
        memory = Database.open("sqlite+aiosqlite:///:memory:")
        assert memory.thread is None  # no file, no writer thread: the engine is used
        await memory.aclose()
    finally:
        await database.aclose()


async def test_operations_on_a_closed_writer_fail_instead_of_waiting(tmp_path: Path) -> None:
    database = open_database(tmp_path / "closed.db")
    writer = Writer(database)
    await writer.read(lambda conn: conn.execute("SELECT 1").fetchone())
    assert database.thread is not None
    await database.thread.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        async with asyncio.timeout(10):  # a hang would end here as TimeoutError, not RuntimeError
            await writer.write(insert("late"))
    await database.aclose()
