"""Health (`chatflow_health`): the readiness probe's write, one row per process.

A probe that only reads passes on a full disk or a read-only database while every webhook fails, so
the probe commits a write: an upsert of this process's row (store/presence.py). Rows of processes not
heard from for a day go in the same transaction, so the table stays the size of the fleet. On the
SQLite file it is one operation of the writer thread's group commit, like any other write.
"""

from __future__ import annotations

import sqlite3
from datetime import timedelta

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.errors import DatabaseUnavailableError
from gateway.store.database import Database
from gateway.store.engine import describe_failure
from gateway.store.presence import renew_on_engine, renew_on_file
from gateway.store.tables import HealthRow

STALE_AFTER = timedelta(days=1)


async def record(db: Database, owner: str) -> None:
    """Commit `owner`'s row with the time now; DatabaseUnavailableError when the write cannot commit."""
    now = utcnow()
    stale = now - STALE_AFTER

    def on_file(conn: sqlite3.Connection) -> None:
        renew_on_file(conn, HealthRow, "checked_at", owner, now, stale)

    async def on_engine(conn: AsyncConnection) -> None:
        await renew_on_engine(conn, db, HealthRow, "checked_at", owner, now, stale)

    try:
        await db.write(on_file, on_engine)
    except (SQLAlchemyError, sqlite3.Error, OSError) as exc:
        raise DatabaseUnavailableError(
            f"a write did not commit: {describe_failure(db.engine.url, exc)}"
        ) from exc
