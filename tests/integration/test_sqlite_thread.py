"""The dedicated sqlite3 thread: order of calls, urgent calls first (but nobody starved), transactions,
cancellation and closing, on a real SQLite file."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest

from gateway.store import sqlite_thread
from gateway.store.sqlite_thread import SQLiteThread


@pytest.fixture
async def thread(tmp_path: Path) -> SQLiteThread:
    made = SQLiteThread(tmp_path / "db" / "t.db")
    await made.write(lambda conn: conn.execute("CREATE TABLE t (v TEXT NOT NULL)"))
    return made


def blocker(started: threading.Event, release: threading.Event) -> Callable[[sqlite3.Connection], None]:
    """A call that holds the thread until the test releases it."""

    def work(conn: sqlite3.Connection) -> None:
        started.set()
        assert release.wait(timeout=30)

    return work


def recorder(order: list[str], name: str) -> Callable[[sqlite3.Connection], str]:
    def work(conn: sqlite3.Connection) -> str:
        order.append(name)
        return name

    return work


async def hold(thread: SQLiteThread) -> tuple[asyncio.Future[None], threading.Event]:
    started, release = threading.Event(), threading.Event()
    held: asyncio.Future[None] = thread.submit(blocker(started, release))
    assert await asyncio.to_thread(started.wait, 30)
    return held, release


async def test_calls_run_in_order_and_urgent_ones_go_first(thread: SQLiteThread) -> None:
    held, release = await hold(thread)
    order: list[str] = []
    ordinary = [thread.submit(recorder(order, f"ordinary{i}")) for i in range(3)]
    urgent = [thread.submit(recorder(order, f"urgent{i}"), urgent=True) for i in range(2)]
    release.set()
    await asyncio.gather(held, *ordinary, *urgent)
    assert order == ["urgent0", "urgent1", "ordinary0", "ordinary1", "ordinary2"]
    assert [f.result() for f in ordinary] == ["ordinary0", "ordinary1", "ordinary2"]
    await thread.aclose()


async def test_an_ordinary_call_that_waited_long_enough_goes_first(
    thread: SQLiteThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_thread, "MAX_DEFERRAL_SECONDS", 0.0)  # every wait is long enough
    held, release = await hold(thread)
    order: list[str] = []
    calls = [
        thread.submit(recorder(order, "ordinary"), urgent=False),
        thread.submit(recorder(order, "urgent"), urgent=True),
    ]
    release.set()
    await asyncio.gather(held, *calls)
    assert order == ["ordinary", "urgent"]
    await thread.aclose()


async def test_writes_commit_or_roll_back_and_errors_reach_the_caller(thread: SQLiteThread) -> None:
    await thread.write(lambda conn: conn.execute("INSERT INTO t VALUES ('kept')"))

    def failing(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t VALUES ('undone')")
        conn.execute("INSERT INTO t VALUES (NULL)")  # NOT NULL

    with pytest.raises(sqlite3.IntegrityError):
        await thread.write(failing)
    rows = await thread.run(lambda conn: conn.execute("SELECT v FROM t").fetchall())
    assert rows == [("kept",)]

    outcomes: asyncio.Queue[tuple[object, BaseException | None]] = asyncio.Queue()
    thread.post_write(
        lambda conn: conn.execute("SELECT count(*) FROM t").fetchone()[0],
        lambda r, e: outcomes.put_nowait((r, e)),
    )
    thread.post_write(failing, lambda r, e: outcomes.put_nowait((r, e)))
    first, second = await outcomes.get(), await outcomes.get()
    assert first == (1, None)
    assert second[0] is None
    assert isinstance(second[1], sqlite3.IntegrityError)
    await thread.aclose()


async def test_a_call_cancelled_before_it_began_never_runs(thread: SQLiteThread) -> None:
    held, release = await hold(thread)
    order: list[str] = []
    cancelled = thread.submit(recorder(order, "cancelled"))
    kept = thread.submit(recorder(order, "kept"))
    cancelled.cancel()
    release.set()
    await asyncio.gather(held, kept)
    assert order == ["kept"]
    await thread.aclose()


async def test_close_runs_what_was_submitted_then_refuses_more(thread: SQLiteThread) -> None:
    held, release = await hold(thread)
    writes = [
        thread.submit_write(
            cast(
                Callable[[sqlite3.Connection], sqlite3.Cursor],
                lambda conn, i=i: conn.execute("INSERT INTO t VALUES (?)", (str(i),)),
            )
        )
        for i in range(20)
    ]
    release.set()
    await thread.aclose()
    await asyncio.gather(held, *writes)
    with pytest.raises(RuntimeError):
        thread.submit(lambda conn: None)
    connection = sqlite3.connect(thread.path)
    try:
        assert connection.execute("SELECT count(*) FROM t").fetchone() == (20,)
    finally:
        connection.close()


async def test_the_writer_connection_has_the_engine_pragmas(thread: SQLiteThread) -> None:
    def pragmas(conn: sqlite3.Connection) -> list[object]:
        names = ("journal_mode", "foreign_keys", "busy_timeout", "synchronous")
        return [conn.execute(f"PRAGMA {name}").fetchone()[0] for name in names]

    try:
        assert await thread.run(pragmas) == ["wal", 1, 5000, 1]  # synchronous=1 is NORMAL
    finally:
        await thread.aclose()
