"""The processes that share the model providers' budgets (`chatflow_budget_members`).

Every process that runs turns on the database keeps a row here, its `seen_at` renewed every few
seconds (gateway/worker/budget_shares.py); a row not renewed within `stale_after` is a process that
is gone (stopped, crashed, frozen) and is deleted by whoever beats next (store/presence.py). The count
of rows is how many processes share each limit. `seen_at` is the beating process's wall clock, which
the replicas' clocks must roughly agree on (within a few seconds of the stale window).
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store.database import Database
from gateway.store.presence import renew_on_engine, renew_on_file
from gateway.store.tables import BudgetMemberRow

__all__ = ["beat", "leave"]

_COUNT = "SELECT count(*) FROM chatflow_budget_members"
_LEAVE = "DELETE FROM chatflow_budget_members WHERE owner = ?"


async def beat(db: Database, owner: str, now: datetime, stale_after: timedelta) -> int:
    """`owner` is alive at `now`; members not seen since `now - stale_after` are gone. Returns how many
    processes share the budgets (this one included)."""
    stale = now - stale_after

    def on_file(conn: sqlite3.Connection) -> int:
        renew_on_file(conn, BudgetMemberRow, "seen_at", owner, now, stale)
        count: int = conn.execute(_COUNT).fetchone()[0]
        return count

    async def on_engine(conn: AsyncConnection) -> int:
        await renew_on_engine(conn, db, BudgetMemberRow, "seen_at", owner, now, stale)
        return int((await conn.execute(select(func.count()).select_from(BudgetMemberRow))).scalar_one())

    return await db.write(on_file, on_engine)


async def leave(db: Database, owner: str) -> None:
    """`owner` stops: the others' shares grow at their next beat."""

    def on_file(conn: sqlite3.Connection) -> None:
        conn.execute(_LEAVE, (owner,))

    async def on_engine(conn: AsyncConnection) -> None:
        await conn.execute(delete(BudgetMemberRow).where(BudgetMemberRow.owner == owner))

    await db.write(on_file, on_engine)
