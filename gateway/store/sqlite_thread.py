"""One sqlite3 connection on one dedicated thread, for the hot paths of the SQLite file backend.

Through SQLAlchemy and aiosqlite, every cursor step is its own hop to the driver's thread (a
turn's save took 14, a dedup mark 8), which capped a store near a thousand writes per second.
Here a whole operation (BEGIN IMMEDIATE, the statements, COMMIT) is one hop. SQLAlchemy keeps
everything else: migrations, PostgreSQL, and the rarer queries.

Calls run one at a time, in the order they were submitted, except that urgent ones (the webhooks'
group commits: a platform waits for each of them) go before the others that are waiting, such as a
batch of turns or a claim. So that the others are not starved under a flood of webhooks, one of
them goes first anyway once it has waited `MAX_DEFERRAL_SECONDS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from gateway.store.engine import SQLITE_PRAGMAS, create_private_file

T = TypeVar("T")
# How SQLAlchemy's DateTime stores values on SQLite, so rows read the same whoever wrote them.
SQLITE_DATETIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"
# The longest an ordinary call waits behind urgent ones that keep coming.
MAX_DEFERRAL_SECONDS = 0.02
# Prepared statements kept by the connection (sqlite3's default is 128): the webhooks' multi-row
# statements take up to 3 x 64 (gateway/store/ingest.py), besides everyone else's.
STATEMENT_CACHE_SIZE = 512


def to_sqlite_datetime(value: datetime) -> str:
    """SQLITE_DATETIME_FORMAT, through isoformat: a fifth of strftime's time, on every row written (a
    UTC time, the gateway's own, goes without a conversion: its offset is cut off)."""
    if value.tzinfo is not UTC:
        value = value.astimezone(UTC)
    return value.isoformat(" ", "microseconds")[:26]


def from_sqlite_datetime(value: str) -> datetime:
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


Outcome = Callable[[Any, BaseException | None], None]  # (result, None) or (None, the exception)


@dataclass(slots=True)
class _Call:
    work: Callable[[sqlite3.Connection], Any]
    done: Outcome  # called on `loop`
    loop: asyncio.AbstractEventLoop
    submitted: float
    future: asyncio.Future[Any] | None = None  # when it was submitted for a future


class SQLiteThread:
    """Runs callables against a private connection on a single thread, one hop per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._urgent: deque[_Call] = deque()
        self._ordinary: deque[_Call] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        result: T = await self.submit(work)
        return result

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` inside BEGIN IMMEDIATE … COMMIT (ROLLBACK when it raises)."""
        result: T = await self.submit_write(work)
        return result

    def submit_write(
        self, work: Callable[[sqlite3.Connection], T], *, urgent: bool = False
    ) -> asyncio.Future[T]:
        """Like `write`, but handed to the thread now; the future resolves once it committed."""
        return self.submit(lambda conn: in_transaction(conn, work), urgent=urgent)

    def submit(self, work: Callable[[sqlite3.Connection], T], *, urgent: bool = False) -> asyncio.Future[T]:
        """Hand `work` to the thread now (before ordinary calls already waiting, when `urgent`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)

        self._enqueue(_Call(work, done, loop, time.monotonic(), future), urgent)
        return future

    def post_write(
        self,
        work: Callable[[sqlite3.Connection], Any],
        done: Outcome,
        *,
        urgent: bool = False,
    ) -> None:
        """`work` in a transaction, then `done(result, exception)` on this event loop.

        One loop iteration sooner than a future's done callback, which asyncio schedules in turn.
        """
        call = _Call(
            lambda conn: in_transaction(conn, work), done, asyncio.get_running_loop(), time.monotonic()
        )
        self._enqueue(call, urgent)

    def post(self, work: Callable[[sqlite3.Connection], Any], done: Outcome, *, urgent: bool = False) -> None:
        """Like `post_write`, but `work` runs outside any transaction (it opens one if it needs one)."""
        self._enqueue(_Call(work, done, asyncio.get_running_loop(), time.monotonic()), urgent)

    def _enqueue(self, call: _Call, urgent: bool) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the SQLite thread is closed")
            (self._urgent if urgent else self._ordinary).append(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="gateway-sqlite", daemon=True)
                self._thread.start()
            else:
                self._ready.notify()

    def _next(self) -> _Call | None:
        """The next call to run (under the lock), or None once closed and drained."""
        while True:
            if self._urgent and not (
                self._ordinary and time.monotonic() - self._ordinary[0].submitted >= MAX_DEFERRAL_SECONDS
            ):
                return self._urgent.popleft()
            if self._ordinary:
                return self._ordinary.popleft()
            if self._closed:
                return None
            self._ready.wait()

    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    call = self._next()
                if call is None:
                    return
                if call.future is not None and call.future.cancelled():  # its caller gave up before it began
                    continue
                try:
                    if self._connection is None:
                        self._connection = self._connect()
                    result = call.work(self._connection)
                except BaseException as exc:  # handed to the caller, as an executor does
                    _resolve(call, None, exc)
                else:
                    _resolve(call, result, None)
        finally:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def _connect(self) -> sqlite3.Connection:
        create_private_file(self.path)
        # Transactions are explicit (isolation_level=None).
        connection = sqlite3.connect(self.path, isolation_level=None, cached_statements=STATEMENT_CACHE_SIZE)
        for pragma in SQLITE_PRAGMAS:
            connection.execute(pragma)
        connection.execute("PRAGMA temp_store = MEMORY")  # this connection's temporary tables, if any
        return connection

    async def aclose(self) -> None:
        """Run what was submitted, close the connection and end the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._ready.notify()
        if thread is not None:
            await asyncio.to_thread(thread.join)


def _resolve(call: _Call, result: Any, exc: BaseException | None) -> None:
    """Hand the outcome to the caller on its own loop (if the loop is still there to take it)."""
    with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile: nobody waits any more
        call.loop.call_soon_threadsafe(call.done, result, exc)


def in_transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    """`work` inside BEGIN IMMEDIATE … COMMIT (ROLLBACK when it raises), on this thread's connection."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result
