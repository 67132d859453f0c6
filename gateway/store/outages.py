"""A turn's model outage, kept on its inbox row (`outage_started_at`, `holding_reply_at`).

Why on the row: the retry budget (GATEWAY_MODEL_RETRY_S) counts from the outage's first failure, and
the holding reply goes out at most once per outage, whichever process runs the row's turn. After a
restart, or when another replica takes the row over (its lease expired or was handed back), the outage
goes on where it was instead of starting again. Only the row's lease holder writes these columns; an
operator's requeue of a dead row clears them (gateway/store/inbox.py), so the row gets a patience anew.
Neither column is in the queue-head triggers' column lists, so these writes never move a head.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, bindparam, func, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.outbound import OutboundMessage
from gateway.store import outbox
from gateway.store.database import Database
from gateway.store.sqlite_thread import from_sqlite_datetime, to_sqlite_datetime
from gateway.store.tables import InboxRow

__all__ = ["Recorded", "begin", "queue_holding_reply"]


@dataclass(frozen=True)
class Recorded:
    """What an inbox row holds of its outage."""

    started: datetime
    holding_queued: bool


_HELD = "id = ? AND lease_owner = ? AND status = 'pending'"
_BEGIN = (
    "UPDATE chatflow_inbox SET outage_started_at = COALESCE(outage_started_at, ?) "
    f"WHERE {_HELD} RETURNING outage_started_at, holding_reply_at"
)
_MARK_HOLDING = f"UPDATE chatflow_inbox SET holding_reply_at = ? WHERE {_HELD} AND holding_reply_at IS NULL"


def _held(inbox_id: int, owner: str) -> tuple[ColumnElement[bool], ...]:
    """_HELD in SQLAlchemy: the row is pending and `owner` holds its lease."""
    return (InboxRow.id == inbox_id, InboxRow.lease_owner == owner, InboxRow.status == "pending")


async def begin(db: Database, inbox_id: int, owner: str, started: datetime) -> Recorded | None:
    """The row's outage: begun at `started` unless the row says it began before (in a process that ran
    the turn earlier). None when the row is not `owner`'s any more: nothing is written."""

    def on_file(conn: sqlite3.Connection) -> Recorded | None:
        row = conn.execute(_BEGIN, (to_sqlite_datetime(started), inbox_id, owner)).fetchone()
        if row is None:
            return None
        return Recorded(from_sqlite_datetime(row[0]), row[1] is not None)

    async def on_engine(conn: AsyncConnection) -> Recorded | None:
        statement = (
            update(InboxRow)
            .where(*_held(inbox_id, owner))
            .values(
                outage_started_at=func.coalesce(
                    InboxRow.outage_started_at,
                    bindparam("started", started, type_=InboxRow.outage_started_at.type),
                )
            )
            .returning(InboxRow.outage_started_at, InboxRow.holding_reply_at)
        )
        row = (await conn.execute(statement)).one_or_none()
        return None if row is None else Recorded(row[0] or started, row[1] is not None)

    return await db.write(on_file, on_engine)


async def queue_holding_reply(
    db: Database, inbox_id: int, owner: str, replies: Sequence[OutboundMessage], now: datetime
) -> bool:
    """Queue the holding reply (attached to the row, like its turn's replies) and mark it on the row, in
    one transaction, so no crash can send it twice. True when queued now; False when it was queued
    before (by whichever process) or the row is not `owner`'s any more: then nothing is written."""
    insert_file = outbox.insert_on_file(inbox_id, replies, now)

    def on_file(conn: sqlite3.Connection) -> bool:
        if conn.execute(_MARK_HOLDING, (to_sqlite_datetime(now), inbox_id, owner)).rowcount != 1:
            return False
        insert_file(conn)
        return True

    async def on_engine(conn: AsyncConnection) -> bool:
        statement = (
            update(InboxRow)
            .where(*_held(inbox_id, owner), InboxRow.holding_reply_at.is_(None))
            .values(holding_reply_at=now)
        )
        if (await conn.execute(statement)).rowcount != 1:
            return False
        await outbox.insert_on_engine(conn, inbox_id, replies, now)
        return True

    return await db.write(on_file, on_engine)
