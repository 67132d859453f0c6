"""A turn's unit of work: the session's changes, its inbox row (or coalesced run of rows) done and its
replies, in one transaction.

The worker's turn must leave all three or none: a crash before the commit leaves the inbox row to be
claimed again; a lost lease (another worker took the row) or a deleted session writes nothing.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.outbound import OutboundMessage
from gateway.domain.usage import TurnUsage
from gateway.store import inbox, outbox, runs, sessions, usage
from gateway.store.database import Database
from gateway.store.inbox import LeaseLostError

__all__ = ["LeaseLostError", "TurnCompletion", "commit"]


@dataclass(frozen=True)
class TurnCompletion:
    """Marks inbox row `inbox_id` done, if `lease_owner` still holds it, queues `outbound` and records
    what its model calls cost (`usage`, per model). `also_done`: the other rows of a coalesced run
    (store/runs.py), answered by the same turn and marked done with it, each if still held."""

    inbox_id: int
    lease_owner: str
    outbound: list[OutboundMessage] = field(default_factory=list)
    usage: list[TurnUsage] = field(default_factory=list)
    also_done: tuple[int, ...] = ()


async def commit(db: Database, turn: sessions.TurnWrite, completion: TurnCompletion | None = None) -> bool:
    """Write the turn; False when its session was deleted meanwhile, LeaseLostError when the inbox row
    is no longer ours (nothing written either way)."""
    now = turn.fields.updated_at
    save_file = sessions.save_on_file(turn)
    replies_file = (
        None if completion is None else outbox.insert_on_file(completion.inbox_id, completion.outbound, now)
    )
    usage_file = (
        None
        if completion is None
        else usage.insert_on_file(completion.inbox_id, turn.session_id, completion.usage, now)
    )

    def on_file(conn: sqlite3.Connection) -> bool:
        if not save_file(conn):
            return False
        if completion is not None and replies_file is not None and usage_file is not None:
            inbox.complete_on_file(conn, completion.inbox_id, completion.lease_owner, now)
            if completion.also_done:
                runs.complete_on_file(conn, completion.also_done, completion.lease_owner, now)
            replies_file(conn)
            usage_file(conn)
        return True

    async def on_engine(conn: AsyncConnection) -> bool:
        if not await sessions.save_on_engine(conn, turn):
            await conn.rollback()
            return False
        if completion is not None:
            await inbox.complete_on_engine(conn, completion.inbox_id, completion.lease_owner, now)
            if completion.also_done:
                await runs.complete_on_engine(conn, completion.also_done, completion.lease_owner, now)
            await outbox.insert_on_engine(conn, completion.inbox_id, completion.outbound, now)
            await usage.insert_on_engine(conn, completion.inbox_id, turn.session_id, completion.usage, now)
        return True

    return await db.write(on_file, on_engine)
