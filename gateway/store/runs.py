"""Coalesced runs: the pending inbox rows right behind a claimed one, answered by the same turn.

With GATEWAY_COALESCE_MS on, the worker holding a conversation's head row (its claim, store/leases.py)
also leases the pending rows behind it that belong to the same burst (gateway/worker/coalesce.py). The
claim stays a claim of heads: only the head's holder takes the rows behind it, and it takes them over
from whoever leased them before (a crashed predecessor's run), checking in the same statement that it
still holds the head. Leasing a row does not move its conversation's head (the triggers of migration
0007 look at rows leaving pending or handed back), and a run's rows are settled together, in one
transaction: done with the turn (store/turns.py), failed, or handed back. Every settlement is
conditional on the lease of every row, so of two workers that both took a run, one writes nothing.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import aliased

from gateway.domain.inbound import InboundMessage
from gateway.domain.messages import utcnow
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage, LeaseLostError, failure_values
from gateway.store.sqlite_thread import from_sqlite_datetime, to_sqlite_datetime
from gateway.store.tables import InboxRow

__all__ = ["Pending", "complete_on_engine", "complete_on_file", "fail", "pending_from", "take_over"]


@dataclass(frozen=True)
class Pending:
    """A pending row of a conversation, with when it arrived (what decides whether it joins a run)."""

    message: ClaimedMessage
    received_at: datetime


_PENDING_FROM = (
    "SELECT id, platform, session_id, text, message_json, attempts, received_at FROM chatflow_inbox "
    "WHERE session_id = ? AND status = 'pending' AND id >= ? ORDER BY id LIMIT ?"
)
_PENDING_COLUMNS = (
    InboxRow.id,
    InboxRow.platform,
    InboxRow.session_id,
    InboxRow.text,
    InboxRow.message_json,
    InboxRow.attempts,
    InboxRow.received_at,
)


def _pending(
    row_id: int, platform: str, session_id: str, text: str | None, stored: Any, attempts: int, at: datetime
) -> Pending:
    message = InboundMessage.from_dict(
        stored if isinstance(stored, dict) else {}, platform=platform, session_id=session_id
    )
    return Pending(ClaimedMessage(row_id, platform, session_id, text, message, attempts), at)


async def pending_from(db: Database, session_id: str, first_id: int, limit: int) -> list[Pending]:
    """The conversation's pending rows from id `first_id` on, oldest first, at most `limit` (one probe of
    the pending rows' partial index)."""

    def on_file(conn: sqlite3.Connection) -> list[Pending]:
        rows = conn.execute(_PENDING_FROM, (session_id, first_id, limit)).fetchall()
        return [
            _pending(i, p, s, t, json.loads(m) if m is not None else None, a, from_sqlite_datetime(r))
            for i, p, s, t, m, a, r in rows
        ]

    async def on_engine(conn: AsyncConnection) -> list[Pending]:
        rows = await conn.execute(
            select(*_PENDING_COLUMNS)
            .where(InboxRow.session_id == session_id, InboxRow.status == "pending", InboxRow.id >= first_id)
            .order_by(InboxRow.id)
            .limit(limit)
        )
        return [_pending(*row) for row in rows]

    return await db.read(on_file, on_engine)


@functools.cache
def _marks(count: int) -> str:
    return ", ".join("?" * count)


async def take_over(db: Database, head_id: int, ids: Sequence[int], owner: str, lease: timedelta) -> set[int]:
    """Lease pending rows `ids` (behind head row `head_id`) to `owner` until `lease` from now, if `owner`
    still holds the head row; the ids leased (none when it does not)."""
    if not ids:
        return set()
    until = utcnow() + lease
    statement = (
        f"UPDATE chatflow_inbox SET lease_owner = ?, lease_until = ? WHERE id IN ({_marks(len(ids))}) "
        "AND status = 'pending' AND EXISTS (SELECT 1 FROM chatflow_inbox AS head WHERE head.id = ? "
        "AND head.lease_owner = ? AND head.status = 'pending') RETURNING id"
    )
    params = (owner, to_sqlite_datetime(until), *ids, head_id, owner)

    def on_file(conn: sqlite3.Connection) -> set[int]:
        return {row_id for (row_id,) in conn.execute(statement, params)}

    async def on_engine(conn: AsyncConnection) -> set[int]:
        head = aliased(InboxRow)
        held = exists().where(and_(head.id == head_id, head.lease_owner == owner, head.status == "pending"))
        taken = await conn.execute(
            update(InboxRow)
            .where(InboxRow.id.in_(sorted(ids)), InboxRow.status == "pending", held)
            .values(lease_owner=owner, lease_until=until)
            .returning(InboxRow.id)
        )
        return {row_id for (row_id,) in taken}

    return await db.write(on_file, on_engine)


def _settle_sql(assignments: str, count: int) -> str:
    return (
        f"UPDATE chatflow_inbox SET {assignments} WHERE id IN ({_marks(count)}) AND lease_owner = ? "
        "AND status = 'pending'"
    )


_DONE = "status = 'done', finished_at = ?, lease_owner = NULL, lease_until = NULL"


def complete_on_file(conn: sqlite3.Connection, ids: Sequence[int], owner: str, now: datetime) -> None:
    """Mark the run's rows `ids` done if `owner` holds every one; LeaseLostError otherwise (the turn's
    transaction then keeps nothing)."""
    done = conn.execute(_settle_sql(_DONE, len(ids)), (to_sqlite_datetime(now), *ids, owner)).rowcount
    if done != len(ids):
        raise LeaseLostError(f"inbox rows {list(ids)} are not all held by {owner}")


async def complete_on_engine(conn: AsyncConnection, ids: Sequence[int], owner: str, now: datetime) -> None:
    done = await conn.execute(
        update(InboxRow)
        .where(InboxRow.id.in_(sorted(ids)), InboxRow.lease_owner == owner, InboxRow.status == "pending")
        .values(status="done", finished_at=now, lease_owner=None, lease_until=None)
    )
    if done.rowcount != len(ids):
        raise LeaseLostError(f"inbox rows {list(ids)} are not all held by {owner}")


async def fail(
    db: Database,
    ids: Sequence[int],
    owner: str,
    *,
    attempts: int,
    error: str,
    retry_at: datetime,
    dead: bool,
) -> int:
    """Record a failed run on each of its rows still held by `owner` (inbox.fail for several rows, in
    one statement): retried at `retry_at`, or `dead`. The rows it changed."""
    values = failure_values(attempts=attempts, error=error, retry_at=retry_at, dead=dead)
    assignments = ", ".join(f"{name} = ?" for name in values)
    params = tuple(to_sqlite_datetime(v) if isinstance(v, datetime) else v for v in values.values())

    def on_file(conn: sqlite3.Connection) -> int:
        return int(conn.execute(_settle_sql(assignments, len(ids)), (*params, *ids, owner)).rowcount)

    async def on_engine(conn: AsyncConnection) -> int:
        failed = await conn.execute(
            update(InboxRow)
            .where(InboxRow.id.in_(sorted(ids)), InboxRow.lease_owner == owner, InboxRow.status == "pending")
            .values(values)
        )
        return int(failed.rowcount)

    return await db.write(on_file, on_engine)
