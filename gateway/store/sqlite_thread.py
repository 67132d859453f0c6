"""One sqlite3 connection on one dedicated thread, for the hot paths of the SQLite file backend.

Through SQLAlchemy and aiosqlite, every cursor step is its own hop to the driver's thread (a
turn's save took 14, a dedup mark 8), which capped a store near a thousand writes per second.
Here a whole operation (BEGIN IMMEDIATE, the statements, COMMIT) is one hop. SQLAlchemy keeps
everything else: migrations, PostgreSQL, and the rarer queries.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from gateway.store.engine import SQLITE_PRAGMAS

T = TypeVar("T")
# How SQLAlchemy's DateTime stores values on SQLite, so rows read the same whoever wrote them.
SQLITE_DATETIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


def to_sqlite_datetime(value: datetime) -> str:
    return value.astimezone(UTC).strftime(SQLITE_DATETIME_FORMAT)


def from_sqlite_datetime(value: str) -> datetime:
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


class SQLiteThread:
    """Runs callables against a private connection on a single thread, one hop per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-sqlite")
        self._connection: sqlite3.Connection | None = None

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, work)

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` inside BEGIN IMMEDIATE … COMMIT (ROLLBACK when it raises)."""
        return await self.run(lambda conn: _in_transaction(conn, work))

    def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._connection is None:
            self._connection = self._connect()
        return work(self._connection)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, isolation_level=None)  # transactions are explicit
        for pragma in SQLITE_PRAGMAS:
            connection.execute(pragma)
        return connection

    async def aclose(self) -> None:
        def close() -> None:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=True)


def _in_transaction(conn: sqlite3.Connection, work: Callable[[sqlite3.Connection], T]) -> T:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result
