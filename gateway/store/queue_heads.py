"""Queue heads (`chatflow_queue_heads`): per work table and conversation, its oldest pending row and lease.

Why: a claim must cost the same whatever the backlog. Claiming rows meant reading every pending row of
every busy conversation to find one whose conversation was free (3.6 s per empty claim on PostgreSQL
at 100,000 waiting rows). A claim reads heads instead: one row per conversation with work, found due
first through a partial index; what waits behind a head is never read.

Who moves a head:
- the database itself, by triggers on the inbox and the outbox (migrations/versions/0007), whoever
  writes the rows (this code, an older replica, an operator's SQL): a row that becomes pending is
  made the head when it is older than the head or there is none (never recomputed: on PostgreSQL
  another transaction's rows may not be visible yet, and the smaller id is right whatever order the
  transactions commit in); a row that leaves pending or is handed back (its lease ended) makes its
  conversation's head point at the oldest pending row again and ends the head's lease. On
  PostgreSQL that recomputation first locks the head, then reads in a statement of its own, so it
  sees every push committed before (a push holds the head's lock until its commit).
- a claim (here): it leases due heads (FOR UPDATE SKIP LOCKED on PostgreSQL) and then their rows. A
  leased head's `due_at` is its lease's end, so `due_at <= now` alone means claimable, and a crashed
  owner's heads come back when their leases end. A renewal extends heads with rows.

Lock order: every writer changes rows first and heads after them (the triggers, a renewal), each in
id or session order, so writers never wait for each other in a cycle. A claim alone goes the other way
(heads, then their rows); it can only meet a writer on a row whose lease has expired while its old
holder settles it, and PostgreSQL then cancels one of the two, which retries.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, and_, any_, bindparam, literal_column, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import QueueHeadRow as Head

_LEASE_SQL = (
    "UPDATE chatflow_queue_heads SET lease_owner = ?, due_at = ? WHERE queue = ? AND session_id IN ("
    "SELECT session_id FROM chatflow_queue_heads WHERE queue = ? AND next_id IS NOT NULL AND due_at <= ? "
    "ORDER BY due_at LIMIT ?) RETURNING session_id, next_id"
)


def lease_on_file(
    conn: sqlite3.Connection, queue: str, owner: str, now: datetime, lease_until: datetime, limit: int
) -> dict[int, str]:
    """Lease up to `limit` due heads to `owner`, oldest due first; their rows' ids -> their sessions."""
    params = (owner, to_sqlite_datetime(lease_until), queue, queue, to_sqlite_datetime(now), limit)
    return {row_id: session for session, row_id in conn.execute(_LEASE_SQL, params)}


async def lease_on_engine(
    conn: AsyncConnection, queue: str, owner: str, now: datetime, lease_until: datetime, limit: int
) -> dict[int, str]:
    params = {"b_queue": queue, "owner": owner, "now": now, "until": lease_until, "limit": limit}
    leased = await conn.execute(lease_statement(), params)
    return {row_id: session for session, row_id in leased if row_id is not None}


@functools.cache
def lease_statement(hinted: bool = False, postgres: bool = False) -> Any:
    """Built once per kind (building it cost more than running it). The heads are picked once, in a
    materialized CTE: as `IN (subquery)`, PostgreSQL may run the subquery again when it rechecks a row
    another transaction changed, and lease more heads than `limit`.

    `hinted`: only the heads of the conversations in the array `sessions`. With a dozen of them (the
    claim loop names at most MAX_HINTS_PER_CLAIM) the planner finds them by primary key; with 128 it
    read the due index, and the whole table to find the locked versions (docs/postgres-performance.md).
    The due index is ordered by time, and a snapshot held open (a long report, pg_dump, an idle
    replication slot) keeps every head version written meanwhile in it, in front of the due heads,
    for every claim to step over; so does the primary key for each head's own versions.

    `postgres`: the lease updates the head versions the CTE locked, by `ctid`, instead of looking each
    head up by its key again, past the versions a held snapshot keeps (as the settle triggers do,
    migration 0017). Should another transaction have changed a head after this statement's snapshot
    was taken, the lock returns the newer version, which that snapshot does not see: the head is then
    left as it is, for a later claim."""
    where = [
        Head.queue == bindparam("b_queue"),
        Head.next_id.is_not(None),
        Head.due_at <= bindparam("now", type_=Head.due_at.type),
    ]
    if hinted:
        where.append(Head.session_id == any_(bindparam("sessions", type_=ARRAY(Head.session_id.type))))
    picked = [Head.session_id, literal_column("ctid").label("at")] if postgres else [Head.session_id]
    due = (
        select(*picked)
        .where(*where)
        .order_by(Head.due_at)
        .limit(bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("due")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    locked = (
        literal_column(f"{Head.__tablename__}.ctid") == due.c.at
        if postgres
        else and_(Head.queue == bindparam("b_queue"), Head.session_id == due.c.session_id)
    )
    return (
        update(Head)
        .where(locked)
        .values(lease_owner=bindparam("owner"), due_at=bindparam("until", type_=Head.due_at.type))
        .returning(Head.session_id, Head.next_id)
    )


def renew_on_file(
    conn: sqlite3.Connection, queue: str, sessions: Sequence[str], owner: str, lease_until: datetime
) -> None:
    """`owner`'s heads of `sessions` stay leased until `lease_until`."""
    if sessions:
        marks = ", ".join("?" * len(sessions))
        conn.execute(
            f"UPDATE chatflow_queue_heads SET due_at = ? WHERE queue = ? AND session_id IN ({marks}) "
            "AND lease_owner = ?",
            (to_sqlite_datetime(lease_until), queue, *sessions, owner),
        )


async def renew_on_engine(
    conn: AsyncConnection, queue: str, sessions: Sequence[str], owner: str, lease_until: datetime
) -> None:
    if sessions:
        await conn.execute(
            update(Head)
            .where(Head.queue == queue, Head.session_id.in_(sorted(set(sessions))), Head.lease_owner == owner)
            .values(due_at=lease_until)
        )
