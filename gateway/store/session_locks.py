"""Turns of one session, one at a time across processes: how each backend holds a session exclusively.

PostgreSQL: a session-level advisory lock on a connection of its own (replicas share the server).
An SQLite file: an flock on one of SQLITE_LOCK_BUCKETS files beside the database (every process that
opens the file shares them), which the process holds while any of its sessions of that bucket is held
(within the process, the stores' per-session lock keeps a session's turns apart). Sessions share a bucket by
chance, and a turn holds its session while its model answers: an flock per turn made the turns of
one process whose sessions shared a bucket wait for each other (a whole model latency for 3 % of
1,000 turns in flight with 16,384 buckets, 35 % with 1,024), and each such waiter blocked a thread
of the default executor in flock(): with more waiters than threads (6 on 2 cores) the holders' sync
tools could not get one either, and every turn stopped (seen at 100 turns in flight). Now only
another process's turns wait for a bucket. In-memory SQLite: nothing, since only this process can
see it.
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
        return _bucket_locks(db.sqlite_file.with_suffix(".locks"))
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


def _bucket_locks(lock_dir: Path) -> SessionLock:
    """The session's bucket's flock, shared by this process's sessions of the bucket (other processes
    wait for it). The caller holds the session within the process (the stores' per-session lock)."""
    buckets: dict[int, _SharedFlock] = {}

    @asynccontextmanager
    async def lock(session_id: str) -> AsyncIterator[None]:
        bucket = _bucket(session_id)
        shared = buckets.get(bucket)
        if shared is None:
            shared = buckets[bucket] = _SharedFlock(lock_dir / f"{bucket}.lock")
        try:
            await shared.acquire()
            yield
        finally:
            if shared.release():
                del buckets[bucket]

    return lock


class _SharedFlock:
    """An exclusive flock on one file, held by this process while any of its users holds it.

    The first user takes it (waiting in a thread if another process holds it; the others wait for
    the same acquisition); the last one out closes the file, which releases it, also when the
    acquisition is still running (then as soon as it completes).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        self._fd: asyncio.Future[int] | None = None

    async def acquire(self) -> None:
        self.users += 1
        if self._fd is None:
            self._fd = asyncio.ensure_future(_flock(self.path))
        await asyncio.shield(self._fd)

    def release(self) -> bool:
        """One user is done (acquired or not); True when it was the last (the flock is released)."""
        self.users -= 1
        if self.users or self._fd is None:
            return not self.users
        if self._fd.done():
            _close(self._fd)  # now: the next process may take it at once
        else:
            self._fd.add_done_callback(_close)
        return True


def _close(acquired: asyncio.Future[int]) -> None:
    if not acquired.cancelled() and acquired.exception() is None:
        os.close(acquired.result())  # closing the file releases the lock


async def _flock(path: Path) -> int:
    """Open `path` and take an exclusive flock on it; the open file (its descriptor) holds the lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:  # the lock folder's first use
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # uncontended: no thread hop at all
        except BlockingIOError:
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)  # another process holds it
    except BaseException:
        os.close(fd)
        raise
    return fd
