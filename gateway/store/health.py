"""Health (`chatflow_health`): the readiness probe's write, one row per process.

A probe that only reads passes on a full disk or a read-only database while every webhook fails, so
the probe commits a write: an upsert of this process's row. Rows of processes not heard from for a
day go in the same transaction, so the table stays the size of the fleet. On the SQLite file it is
one operation of the writer thread's group commit, like any other write.
"""

from __future__ import annotations

import sqlite3
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.errors import DatabaseUnavailableError
from gateway.store.database import Database
from gateway.store.engine import describe_failure
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import HealthRow

STALE_AFTER = timedelta(days=1)

UPSERT_SQL = (
    "INSERT INTO chatflow_health (owner, checked_at) VALUES (?, ?) "
    "ON CONFLICT (owner) DO UPDATE SET checked_at = excluded.checked_at"
)
PURGE_SQL = "DELETE FROM chatflow_health WHERE checked_at < ?"


async def record(db: Database, owner: str) -> None:
    """Commit `owner`'s row with the time now; DatabaseUnavailableError when the write cannot commit."""
    now = utcnow()

    def on_file(conn: sqlite3.Connection) -> None:
        conn.execute(UPSERT_SQL, (owner, to_sqlite_datetime(now)))
        conn.execute(PURGE_SQL, (to_sqlite_datetime(now - STALE_AFTER),))

    async def on_engine(conn: AsyncConnection) -> None:
        statement = db.insert(HealthRow).values(owner=owner, checked_at=now)
        await conn.execute(
            statement.on_conflict_do_update(
                index_elements=[HealthRow.owner], set_={"checked_at": statement.excluded.checked_at}
            )
        )
        await conn.execute(delete(HealthRow).where(HealthRow.checked_at < now - STALE_AFTER))

    try:
        await db.write(on_file, on_engine)
    except (SQLAlchemyError, sqlite3.Error, OSError) as exc:
        raise DatabaseUnavailableError(
            f"a write did not commit: {describe_failure(db.engine.url, exc)}"
        ) from exc
