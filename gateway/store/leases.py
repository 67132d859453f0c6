"""Leases on the rows of a work table (the inbox, the outbox): claim in order, update while held, release.

A row is claimable when it is pending, due, not leased (or its lease expired), and no older row of
its conversation is still pending. A leased row is still pending, so it holds back the younger rows
of its conversation: each conversation advances in order, whatever the number of claimers. On
PostgreSQL a claim locks the rows it takes with FOR UPDATE SKIP LOCKED, so replicas never take one
row twice; on SQLite one writer at a time makes the claim's single statement atomic.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, exists, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.orm import aliased

from gateway.domain.messages import utcnow
from gateway.store.database import Database
from gateway.store.sqlite_thread import to_sqlite_datetime

Row = tuple[Any, ...]  # (id, *the claimed columns)
MAX_OWNER_LENGTH = 64  # the lease_owner columns' width


def check_owner(owner: str) -> str:
    """An owner id that fits its column: a longer one would fail every claim in the database (PostgreSQL)
    rather than here, with a message naming it."""
    if not owner or len(owner) > MAX_OWNER_LENGTH:
        raise ValueError(f"a lease owner id has 1 to {MAX_OWNER_LENGTH} characters, got {len(owner)}")
    return owner


async def claim(
    db: Database, table: Any, columns: tuple[str, ...], owner: str, lease: timedelta, limit: int
) -> list[Row]:
    """Lease up to `limit` claimable rows of `table` (a mapped class) to `owner`, oldest first."""
    check_owner(owner)
    if limit <= 0:
        return []
    now = utcnow()
    return await db.write(
        claim_on_file(table, columns, owner, now, now + lease, limit),
        claim_on_engine(table, columns, owner, now, now + lease, limit),
    )


def claim_on_file(
    table: Any, columns: tuple[str, ...], owner: str, now: datetime, lease_until: datetime, limit: int
) -> Callable[[sqlite3.Connection], list[Row]]:
    """The claim as one statement: select the claimable rows and lease them, returning them."""
    statement, decode = _claim_sql(table, columns)
    stamp = to_sqlite_datetime(now)
    params = (owner, to_sqlite_datetime(lease_until), stamp, stamp, limit)

    def work(conn: sqlite3.Connection) -> list[Row]:
        rows = conn.execute(statement, params).fetchall()
        rows.sort(key=lambda row: row[0])  # RETURNING has no order of its own
        if not any(decode):
            return rows
        return [(row[0], *map(_decode, row[1:], decode)) for row in rows]

    return work


def claim_on_engine(
    table: Any, columns: tuple[str, ...], owner: str, now: datetime, lease_until: datetime, limit: int
) -> Callable[[AsyncConnection], Any]:
    """The same claim in SQLAlchemy: select (locking the rows on PostgreSQL, skipping those others are
    claiming), then lease what was selected, in one transaction. Built only when run: building the
    statement costs more than running the file's spelling."""

    async def work(conn: AsyncConnection) -> list[Row]:
        older = aliased(table)
        oldest_pending = select(func.min(older.id)).where(older.status == "pending").scalar_subquery()
        held_back = exists().where(
            older.session_id == table.session_id,
            older.status == "pending",
            older.id < table.id,
            older.id
            >= oldest_pending,  # the backlog only, whatever the conversation's history (see _claim_sql)
        )
        free = or_(table.lease_until.is_(None), table.lease_until < now)
        query = (
            select(table.id, *(getattr(table, c) for c in columns))
            .where(table.status == "pending", table.next_attempt_at <= now, free, ~held_back)
            .order_by(table.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=table)
        )
        rows = [tuple(row) for row in await conn.execute(query)]
        if rows:
            await conn.execute(
                update(table)
                .where(table.id.in_([r[0] for r in rows]))
                .values(lease_owner=owner, lease_until=lease_until)
            )
        return rows

    return work


@functools.cache
def _claim_sql(table: Any, columns: tuple[str, ...]) -> tuple[str, list[bool]]:
    name = table.__tablename__
    json_columns = {c.key for c in table.__table__.columns if isinstance(c.type, JSON)}
    by_status = any([c.name for c in index.columns] == ["status", "id"] for index in table.__table__.indexes)
    oldest_pending = f"(SELECT min(id) FROM {name} WHERE status = 'pending')"
    # Candidates in id order: through the (status, id) index where there is one, else through the
    # table from its oldest pending row on (never through an index in another order: every pending
    # row would be checked and sorted at each claim).
    candidates = f"{name} AS c" if by_status else f"{name} AS c NOT INDEXED"
    from_oldest = "" if by_status else f"AND c.id >= {oldest_pending} "
    # Whether an older row of the conversation is pending is read through the (session_id, id) index
    # from the oldest pending row of the table on: the conversation's rows within the backlog, not
    # its whole history. (SQLite would otherwise pick the (status, id) index and read every older
    # pending row of every conversation.)
    statement = (
        f"UPDATE {name} SET lease_owner = ?, lease_until = ? WHERE id IN ("
        f"SELECT c.id FROM {candidates} WHERE c.status = 'pending' {from_oldest}"
        "AND c.next_attempt_at <= ? AND (c.lease_until IS NULL OR c.lease_until < ?) "
        f"AND NOT EXISTS (SELECT 1 FROM {name} AS o INDEXED BY ix_{name}_session_id_id "
        f"WHERE o.session_id = c.session_id AND o.id < c.id AND o.id >= {oldest_pending} "
        "AND o.status = 'pending') "
        f"ORDER BY c.id LIMIT ?) RETURNING id, {', '.join(columns)}"
    )
    return statement, [column in json_columns for column in columns]


def _decode(value: Any, is_json: bool) -> Any:
    return json.loads(value) if is_json and value is not None else value


async def update_row(
    db: Database,
    table: Any,
    row_id: int,
    values: dict[str, Any],
    *,
    lease_owner: str | None = None,
    status: str | None = None,
) -> bool:
    """Set `values` on row `row_id` (only while `lease_owner` holds it and it has `status`, when given).

    True when the row was updated.
    """
    unknown = set(values) - set(table.__table__.columns.keys())
    if unknown:
        raise ValueError(f"{table.__tablename__} has no column {sorted(unknown)[0]!r}")
    where = ["id = ?"]
    params = [_sqlite_value(v) for v in values.values()]
    params.append(row_id)
    if lease_owner is not None:
        where.append("lease_owner = ?")
        params.append(lease_owner)
    if status is not None:
        where.append("status = ?")
        params.append(status)
    assignments = ", ".join(f"{k} = ?" for k in values)
    statement = f"UPDATE {table.__tablename__} SET {assignments} WHERE {' AND '.join(where)}"

    def on_file(conn: sqlite3.Connection) -> bool:
        return bool(conn.execute(statement, params).rowcount == 1)

    async def on_engine(conn: AsyncConnection) -> bool:
        conditions = [table.id == row_id]
        if lease_owner is not None:
            conditions.append(table.lease_owner == lease_owner)
        if status is not None:
            conditions.append(table.status == status)
        result = await conn.execute(update(table).where(*conditions).values(**values))
        return bool(result.rowcount == 1)

    return await db.write(on_file, on_engine)


async def renew(db: Database, table: Any, ids: list[int], owner: str, lease: timedelta) -> set[int]:
    """Extend `owner`'s leases on rows `ids` to `lease` from now; the ids it still held (and now holds
    longer). A row missing from the answer was taken over after its lease expired, or is finished."""
    if not ids:
        return set()
    lease_until = utcnow() + lease
    name = table.__tablename__
    marks = ", ".join("?" * len(ids))
    statement = (
        f"UPDATE {name} SET lease_until = ? WHERE id IN ({marks}) AND lease_owner = ? AND status = 'pending' "
        "RETURNING id"
    )
    params = (to_sqlite_datetime(lease_until), *ids, owner)

    def on_file(conn: sqlite3.Connection) -> set[int]:
        return {row_id for (row_id,) in conn.execute(statement, params)}

    async def on_engine(conn: AsyncConnection) -> set[int]:
        renewed = await conn.execute(
            update(table)
            .where(table.id.in_(ids), table.lease_owner == owner, table.status == "pending")
            .values(lease_until=lease_until)
            .returning(table.id)
        )
        return {row_id for (row_id,) in renewed}

    return await db.write(on_file, on_engine)


async def release(db: Database, table: Any, row_id: int, owner: str) -> bool:
    """Hand a pending row back now rather than when its lease expires (shutting down)."""
    return await update_row(
        db, table, row_id, {"lease_owner": None, "lease_until": None}, lease_owner=owner, status="pending"
    )


async def release_many(db: Database, table: Any, ids: list[int], owner: str) -> None:
    """`release` for rows claimed but never started (a claim that finished as the process stopped)."""
    if not ids:
        return
    marks = ", ".join("?" * len(ids))
    statement = (
        f"UPDATE {table.__tablename__} SET lease_owner = NULL, lease_until = NULL "
        f"WHERE id IN ({marks}) AND lease_owner = ? AND status = 'pending'"
    )

    def on_file(conn: sqlite3.Connection) -> None:
        conn.execute(statement, (*ids, owner))

    async def on_engine(conn: AsyncConnection) -> None:
        await conn.execute(
            update(table)
            .where(table.id.in_(ids), table.lease_owner == owner, table.status == "pending")
            .values(lease_owner=None, lease_until=None)
        )

    await db.write(on_file, on_engine)


def _sqlite_value(value: Any) -> Any:
    """A value as SQLAlchemy would store it on SQLite (see sqlite_thread.SQLITE_DATETIME_FORMAT)."""
    if isinstance(value, datetime):
        return to_sqlite_datetime(value)
    if isinstance(value, dict | list):
        return json.dumps(value)
    return value
