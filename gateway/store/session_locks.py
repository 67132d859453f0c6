"""Turns of one session, one at a time across processes: how each backend holds a session exclusively.

PostgreSQL: a session-level advisory lock on a connection of its own (replicas share the server).
An SQLite file: an flock on one of SQLITE_LOCK_BUCKETS files beside the database (every process that
opens the file shares them). In-memory SQLite: nothing, since only this process can see it.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store.database import Database

SQLITE_LOCK_BUCKETS = 1024
SessionLock = Callable[[str], AbstractAsyncContextManager[None]]


def session_lock(db: Database, slots: int) -> SessionLock:
    """The backend's cross-process lock of a session; on PostgreSQL at most `slots` held at once
    (each holds a pooled connection for the whole turn)."""
    if db.dialect == "postgresql":
        return _advisory(db, asyncio.Semaphore(max(1, slots)))
    if db.sqlite_file is not None:
        lock_dir = db.sqlite_file.with_suffix(".locks")
        return lambda session_id: _file_lock(lock_dir / f"{_bucket(session_id)}.lock")
    return _nothing


@asynccontextmanager
async def _nothing(session_id: str) -> AsyncIterator[None]:
    yield


def _advisory(db: Database, slots: asyncio.Semaphore) -> SessionLock:
    @asynccontextmanager
    async def lock(session_id: str) -> AsyncIterator[None]:
        key = _lock_key(session_id)
        async with slots, db.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(select(func.pg_advisory_lock(key)))
            try:
                yield
            finally:
                await asyncio.shield(_pg_unlock(conn, key))

    return lock


async def _pg_unlock(conn: AsyncConnection, key: int) -> None:
    await conn.execute(select(func.pg_advisory_unlock(key)))


def _digest(session_id: str) -> bytes:
    return hashlib.blake2b(session_id.encode(), digest_size=8).digest()


def _lock_key(session_id: str) -> int:
    return int.from_bytes(_digest(session_id), "big", signed=True)


def _bucket(session_id: str) -> int:
    return int.from_bytes(_digest(session_id), "big") % SQLITE_LOCK_BUCKETS


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
