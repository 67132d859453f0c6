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

__all__ = ["SentReplies"]

_COLUMNS = ("status", "platform_message_id", "lease_owner", "lease_until", "updated_at")
_ON_FILE = (
    "UPDATE chatflow_outbox SET status = ?, platform_message_id = ?, lease_owner = NULL, lease_until = NULL, "
    "updated_at = ? WHERE id = ? AND lease_owner = ? AND status = 'pending'"
)
_ON_POSTGRES = Statement(
    # By primary key only: with `status = 'pending'` in a scan's condition PostgreSQL read the whole
    # pending index (its statistics say few rows are pending; during a burst it holds thousands of
    # dead entries): 2.8 ms a call. The rows are locked first, then checked: ours and still pending.
    text(
        "WITH v AS (SELECT * FROM unnest(:ids, :owners, :statuses, :message_ids) AS v(id, owner, status, "
        "message_id)), "
        "locked AS MATERIALIZED (SELECT o.id, o.lease_owner, o.status FROM chatflow_outbox AS o "
        "WHERE o.id = ANY(:ids) ORDER BY o.id FOR UPDATE), "
        "mine AS (SELECT v.* FROM v JOIN locked AS l ON l.id = v.id AND l.lease_owner = v.owner "
        "AND l.status = 'pending') "
        "UPDATE chatflow_outbox AS o SET status = mine.status, platform_message_id = mine.message_id, "
        "lease_owner = NULL, lease_until = NULL, updated_at = :now FROM mine WHERE o.id = mine.id "
        "RETURNING o.id"
    ).bindparams(
        bindparam("ids", type_=ARRAY(BigInteger)),
        bindparam("owners", type_=ARRAY(String)),
        bindparam("statuses", type_=ARRAY(String)),
        bindparam("message_ids", type_=ARRAY(String)),
        bindparam("now", type_=DateTime(timezone=True)),
    )
)


@dataclass(frozen=True, slots=True)
class _Sent:
    row_id: int
    owner: str
    status: str  # sent, or dry_run (no token: the gateway only logged it)
    platform_message_id: str | None


class SentReplies:
    """The recorder of one process's accepted replies (built by its delivery worker)."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._batcher: GroupCommit[_Sent] = db.batcher(self._on_file, self._on_engine)

    async def record(self, row_id: int, owner: str, status: str, platform_message_id: str | None) -> bool:
        """Mark the row `status` with the platform's message id and end its lease, if `owner` still
        holds it; False (nothing written) when another process took it over."""
        recorded: bool = await self._batcher.submit(_Sent(row_id, owner, status, platform_message_id))
        return recorded

    def _on_file(self, items: list[_Sent]) -> Callable[[sqlite3.Connection], list[Outcome]]:
        stamp = to_sqlite_datetime(utcnow())
        rows = [(i.status, i.platform_message_id, stamp, i.row_id, i.owner) for i in items]

        def work(conn: sqlite3.Connection) -> list[Outcome]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                outcomes: list[Outcome] = [(True, conn.execute(_ON_FILE, row).rowcount == 1) for row in rows]
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
                "now": now,
            }
            written = {row_id for (row_id,) in await self._db.postgres.fetch(_ON_POSTGRES, params)}
            return [(True, i.row_id in written) for i in items]

        async def one_by_one(conn: AsyncConnection) -> list[Outcome]:  # in-memory SQLite
            settled: dict[int, bool] = {}
            for i in sorted(items, key=lambda i: i.row_id):  # the renewals' lock order
                values = dict(zip(_COLUMNS, (i.status, i.platform_message_id, None, None, now), strict=True))
                settled[i.row_id] = await leases.settle_on_engine(conn, OutboxRow, i.row_id, i.owner, values)
            return [(True, settled[i.row_id]) for i in items]

        return await self._db.write(engine_only, one_by_one)
