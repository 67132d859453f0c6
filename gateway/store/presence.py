"""Rows that say a process is alive: one per owner, its time renewed by the owner, and the rows not
renewed since a bound forgotten by whoever renews next.

Two tables hold such rows, apart because their writers and bounds differ: the readiness probes'
(store/health.py: every process that serves /readyz, kept a day) and the model budgets' members
(store/budget_members.py: every process that runs turns, gone after 20 s of silence).
"""

from __future__ import annotations

import sqlite3
from datetime import datetime

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store.database import Database
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import BudgetMemberRow, HealthRow

Presence = type[HealthRow] | type[BudgetMemberRow]


def renew_on_file(
    conn: sqlite3.Connection, row: Presence, column: str, owner: str, now: datetime, stale: datetime
) -> None:
    """`owner`'s row says `now` in `column`; rows that say a time before `stale` go."""
    table = row.__tablename__
    conn.execute(
        f"INSERT INTO {table} (owner, {column}) VALUES (?, ?) "
        f"ON CONFLICT (owner) DO UPDATE SET {column} = excluded.{column}",
        (owner, to_sqlite_datetime(now)),
    )
    conn.execute(f"DELETE FROM {table} WHERE {column} < ?", (to_sqlite_datetime(stale),))


async def renew_on_engine(
    conn: AsyncConnection,
    db: Database,
    row: Presence,
    column: str,
    owner: str,
    now: datetime,
    stale: datetime,
) -> None:
    """renew_on_file in SQLAlchemy."""
    statement = db.insert(row).values({"owner": owner, column: now})
    await conn.execute(
        statement.on_conflict_do_update(index_elements=["owner"], set_={column: statement.excluded[column]})
    )
    await conn.execute(delete(row).where(getattr(row, column) < stale))
