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

On PostgreSQL every write of a head is a new `ver`, the last column of its key, and every look-up
of one conversation's head reads that key backwards with `LIMIT 1` (migration 0019): a snapshot held
open (a long report, pg_dump, an idle replication slot) keeps every version written meanwhile, and a
look-up by `(queue, session_id)` alone visited each of them before the one it sees. A head is created
only under an advisory lock of its conversation, after looking for it again, so there is one per
conversation without a unique index on `(queue, session_id)` (whose check would walk the versions).

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

from sqlalchemy import ARRAY, and_, bindparam, func, literal_column, select, true, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import aliased

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

    `hinted` (PostgreSQL only): only the heads of the conversations in the array `sessions`, each
    found newest version first (`newest_versions`) and locked where that version is (by `ctid`, its
    `ver` checked), so a claim never walks the versions a held snapshot keeps. Unhinted, the due index
    is read, ordered by time; a held snapshot keeps every head version written meanwhile in it, in
    front of the due heads, for the claim to step over (docs/postgres-performance.md).

    `postgres`: the lease updates the head versions the CTE locked, by `ctid`, as a new `ver`
    (migration 0019). Should another transaction have changed a head after this statement's snapshot
    was taken, the lock meets a newer version: a hinted look-up then no longer matches its `ver`, and
    an unhinted one's update does not see it; either way the head is left as it is, for a later claim."""
    queue = bindparam("b_queue", type_=Head.queue.type)
    now = bindparam("now", type_=Head.due_at.type)
    picked = [Head.session_id, _ctid(Head.__tablename__).label("at")] if postgres else [Head.session_id]
    if hinted:
        # Due or not by the newest version itself: a condition on the locked table's `due_at` would
        # let the planner go by the due index, through every version a held snapshot keeps.
        newest = newest_versions(queue, bindparam("sessions", type_=ARRAY(Head.session_id.type)))
        due = (
            select(*picked)
            .join_from(newest, Head, and_(_ctid(Head.__tablename__) == newest.c.at, Head.ver == newest.c.ver))
            .where(newest.c.next_id.is_not(None), newest.c.due_at <= now)
            .order_by(newest.c.due_at)
        )
    else:
        due = select(*picked).where(Head.queue == queue, Head.next_id.is_not(None), Head.due_at <= now)
        due = due.order_by(Head.due_at)
    due_cte = (
        due.limit(bindparam("limit"))
        .with_for_update(skip_locked=True, of=Head if postgres else None)
        .cte("due")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    values: dict[str, Any] = {
        "lease_owner": bindparam("owner"),
        "due_at": bindparam("until", type_=Head.due_at.type),
    }
    if postgres:
        values["ver"] = Head.ver + 1
        locked = _ctid(Head.__tablename__) == due_cte.c.at
    else:
        locked = and_(Head.queue == queue, Head.session_id == due_cte.c.session_id)
    return update(Head).where(locked).values(values).returning(Head.session_id, Head.next_id)


def _ctid(table: str) -> Any:
    return literal_column(f"{table}.ctid")


def newest_versions(queue: Any, sessions: Any) -> Any:
    """PostgreSQL: the heads of `sessions` in their newest versions, as `(session_id, at, ver, next_id,
    due_at)` (`at`: the version's ctid): a backward scan of the key with `LIMIT 1` stops at the first
    version this statement sees. A statement locking or updating the head goes to it by `at` and checks
    `ver` (a TID scan's recheck after a concurrent update does not compare the ctid)."""
    asked = func.unnest(sessions).table_valued("session_id").render_derived(name="asked")
    versions = aliased(Head, name="versions")
    latest = (
        select(_ctid("versions").label("at"), versions.ver, versions.next_id, versions.due_at)
        .where(versions.queue == queue, versions.session_id == asked.c.session_id)
        .order_by(versions.ver.desc())
        .limit(1)
        .lateral("latest")
    )
    return (
        select(asked.c.session_id, latest.c.at, latest.c.ver, latest.c.next_id, latest.c.due_at)
        .select_from(asked)
        .join(latest, true())
        .subquery("newest")
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
    if not sessions:
        return
    asked = sorted(set(sessions))
    if conn.dialect.name != "postgresql":
        await conn.execute(
            update(Head)
            .where(Head.queue == queue, Head.session_id.in_(asked), Head.lease_owner == owner)
            .values(due_at=lease_until)
        )
        return
    await conn.execute(
        _RENEW_NEWEST, {"b_queue": queue, "sessions": asked, "owner": owner, "until": lease_until}
    )


def _renew_newest() -> Any:
    """PostgreSQL: the renewal by the heads' newest versions (`newest_versions`), each a new `ver`."""
    queue = bindparam("b_queue", type_=Head.queue.type)
    newest = newest_versions(queue, bindparam("sessions", type_=ARRAY(Head.session_id.type)))
    return (
        update(Head)
        .where(
            _ctid(Head.__tablename__) == newest.c.at,
            Head.ver == newest.c.ver,
            Head.lease_owner == bindparam("owner"),
        )
        .values(due_at=bindparam("until", type_=Head.due_at.type), ver=Head.ver + 1)
    )


_RENEW_NEWEST = _renew_newest()
