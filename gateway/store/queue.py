"""Claiming rows of a work table (inbox, outbox) in order, one conversation at a time, with leases.

A row is claimable when it is pending, due, not leased (or its lease expired), and no older row of
its conversation is still pending. A leased row is still pending, so it holds back the younger rows
of its conversation: each conversation advances in order, whatever the number of claimers.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import exists, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import aliased

from gateway.store.engine import SQLITE_IMMEDIATE


async def claim(
    engine: AsyncEngine, table: Any, columns: list[Any], owner: str, lease: timedelta, limit: int
) -> list[Any]:
    """Lease up to `limit` claimable rows of `table` (a mapped class) to `owner`, oldest first.

    Returns rows of (id, *columns).
    """
    if limit <= 0:
        return []
    now = datetime.now(UTC)
    older = aliased(table)
    held_back = exists().where(
        older.session_id == table.session_id, older.status == "pending", older.id < table.id
    )
    free = or_(table.lease_until.is_(None), table.lease_until < now)
    query = (
        select(table.id, *columns)
        .where(table.status == "pending", table.next_attempt_at <= now, free, ~held_back)
        .order_by(table.id)
        .limit(limit)
    )
    values = {"lease_owner": owner, "lease_until": now + lease}
    if engine.dialect.name == "postgresql":
        # Row locks, not a database lock: claim in one transaction, skipping rows others are claiming.
        async with engine.begin() as conn:
            rows = list(await conn.execute(query.with_for_update(skip_locked=True, of=table)))
            if rows:
                await conn.execute(update(table).where(table.id.in_([r[0] for r in rows])).values(**values))
        return rows
    # SQLite has one write lock for the whole file, which the webhooks need for their acks: look for
    # rows without it, then take the lease in a short write, only on rows still free.
    async with engine.connect() as conn:
        candidates = list(await conn.execute(query))
    if not candidates:
        return []
    async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
        taken = await conn.execute(
            update(table)
            .where(table.id.in_([r[0] for r in candidates]), table.status == "pending", free)
            .values(**values)
            .returning(table.id)
        )
        ids = set(taken.scalars())
    return [row for row in candidates if row[0] in ids]
