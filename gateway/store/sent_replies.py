"""Replies the platform accepted, recorded in batches: one statement marks many outbox rows sent.

Why: a reply's outcome was a statement of its own, and on PostgreSQL a statement outside a transaction
is a round trip and a WAL flush; one per reply made recording outcomes a third of the database's work
in the end-to-end benchmark. What the delivery tasks record meanwhile joins one batch (the group
commit of `Database.batcher`), written on PostgreSQL by one UPDATE over unnest()ed arrays that locks
its rows in id order first (a heartbeat's renewal locks them in that order too, so the two never wait
for each other in a cycle). On an SQLite file the batch is one transaction on the writer thread.

As with `outbox.finish`, a row is written only while `owner` still holds it: the answer says, per
reply, whether it was.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum

from sqlalchemy import BigInteger, DateTime, String, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.store import leases
from gateway.store.database import Database, engine_only
from gateway.store.group_commit import GroupCommit, Outcome
from gateway.store.postgres_lanes import Statement
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import OutboxRow

__all__ = ["Recorded", "SentReplies"]

_COLUMNS = ("status", "platform_message_id", "lease_owner", "lease_until", "updated_at")
_ON_FILE = (
    "UPDATE chatflow_outbox SET status = ?, platform_message_id = ?, lease_owner = NULL, lease_until = NULL, "
    "updated_at = ? WHERE id = ? AND lease_owner = ? AND status = 'pending'"
)
_ON_POSTGRES = Statement(
    # By primary key only: with `status = 'pending'` in a scan's condition PostgreSQL read the whole
    # pending index (its statistics say few rows are pending; during a burst it holds thousands of
    # dead entries): 2.8 ms a call. The rows are locked first, then checked: ours and still pending.
    # A reply's next one waiting (`status = 'pending'` spelled out for the pending index) keeps the
    # lease when the recorder asked for a hand-on (migration 0016).
    text(
        "WITH v AS (SELECT * FROM unnest(:ids, :owners, :statuses, :message_ids, :untils) AS v(id, owner, "
        "status, message_id, until)), "
        "locked AS MATERIALIZED (SELECT o.id, o.session_id, o.lease_owner, o.status "
        "FROM chatflow_outbox AS o WHERE o.id = ANY(:ids) ORDER BY o.id FOR UPDATE), "
        "mine AS (SELECT v.*, v.until IS NOT NULL AND EXISTS (SELECT FROM chatflow_outbox AS p "
        "WHERE p.session_id = l.session_id AND p.status = 'pending' AND p.id > l.id) AS hand_on "
        "FROM v JOIN locked AS l ON l.id = v.id AND l.lease_owner = v.owner AND l.status = 'pending') "
        "UPDATE chatflow_outbox AS o SET status = mine.status, platform_message_id = mine.message_id, "
        "lease_owner = CASE WHEN mine.hand_on THEN mine.owner END, "
        "lease_until = CASE WHEN mine.hand_on THEN mine.until END, updated_at = :now "
        "FROM mine WHERE o.id = mine.id RETURNING o.id, mine.hand_on"
    ).bindparams(
        bindparam("ids", type_=ARRAY(BigInteger)),
        bindparam("owners", type_=ARRAY(String)),
        bindparam("statuses", type_=ARRAY(String)),
        bindparam("message_ids", type_=ARRAY(String)),
        bindparam("untils", type_=ARRAY(DateTime(timezone=True))),
        bindparam("now", type_=DateTime(timezone=True)),
    )
)


class Recorded(IntEnum):
    """A reply's record: false when the row was not `owner`'s any more (nothing written)."""

    NOT_OURS = 0
    WRITTEN = 1
    HANDED_ON = 2  # and the conversation's next reply may be leased to `owner` (take_handed_on)


@dataclass(frozen=True, slots=True)
class _Sent:
    row_id: int
    owner: str
    status: str  # sent, or dry_run (no token: the gateway only logged it)
    platform_message_id: str | None
    hand_on_until: datetime | None


class SentReplies:
    """The recorder of one process's accepted replies (built by its delivery worker)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._batcher: GroupCommit[_Sent] = db.batcher(self._on_file, self._on_engine)

    async def record(
        self,
        row_id: int,
        owner: str,
        status: str,
        platform_message_id: str | None,
        hand_on_until: datetime | None = None,
    ) -> Recorded:
        """Mark the row `status` with the platform's message id and end its lease, if `owner` still
        holds it (NOT_OURS: another process took it over). `hand_on_until` (PostgreSQL): when the
        statement sees the conversation's next reply waiting, the lease is kept and ends then
        instead, and the settle hands that reply on to `owner` (migration 0016): HANDED_ON."""
        recorded: Recorded = await self._batcher.submit(
            _Sent(row_id, owner, status, platform_message_id, hand_on_until)
        )
        return recorded

    def _on_file(self, items: list[_Sent]) -> Callable[[sqlite3.Connection], list[Outcome]]:
        stamp = to_sqlite_datetime(utcnow())
        rows = [(i.status, i.platform_message_id, stamp, i.row_id, i.owner) for i in items]

        def work(conn: sqlite3.Connection) -> list[Outcome]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                outcomes: list[Outcome] = [
                    (True, Recorded(conn.execute(_ON_FILE, row).rowcount == 1)) for row in rows
                ]
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return outcomes

        return work

    async def _on_engine(self, items: list[_Sent]) -> list[Outcome]:
        now = utcnow()
        if self._db.postgres is not None:
            params = {
                "ids": [i.row_id for i in items],
                "owners": [i.owner for i in items],
                "statuses": [i.status for i in items],
                "message_ids": [i.platform_message_id for i in items],
                "untils": [i.hand_on_until for i in items],
                "now": now,
            }
            rows = await self._db.postgres.fetch(_ON_POSTGRES, params)
            written = {
                row_id: Recorded.HANDED_ON if hand_on else Recorded.WRITTEN for row_id, hand_on in rows
            }
            return [(True, written.get(i.row_id, Recorded.NOT_OURS)) for i in items]

        async def one_by_one(conn: AsyncConnection) -> list[Outcome]:  # in-memory SQLite
            settled: dict[int, bool] = {}
            for i in sorted(items, key=lambda i: i.row_id):  # the renewals' lock order
                values = dict(zip(_COLUMNS, (i.status, i.platform_message_id, None, None, now), strict=True))
                settled[i.row_id] = await leases.settle_on_engine(conn, OutboxRow, i.row_id, i.owner, values)
            return [(True, Recorded(settled[i.row_id])) for i in items]

        return await self._db.write(engine_only, one_by_one)
