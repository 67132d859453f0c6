"""Leases on the rows of a work table (the inbox, the outbox): claim in order, update while held, release.

Each conversation advances in order, whatever the number of claimers: only its oldest pending row,
its head (gateway/store/queue_heads.py), can be claimed, and a claim leases the head with the row, so
the rows behind it wait until the holder settles it. A claim reads due heads only, so it costs the
same whatever the backlog. On PostgreSQL a claim locks the heads it takes with FOR UPDATE SKIP
LOCKED, so replicas never take one twice; on SQLite one writer at a time makes the claim atomic.
Every change to a held row is conditional on its lease owner; the table's triggers move the heads.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, bindparam, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.store import queue_heads
from gateway.store.database import Database
from gateway.store.postgres_lanes import PostgresLanes, Statement
from gateway.store.sqlite_thread import from_sqlite_datetime, to_sqlite_datetime
from gateway.store.storable import json_text
from gateway.store.tables import SessionRow, pending_by_row

Row = tuple[Any, ...]  # (id, *the claimed columns)
MAX_OWNER_LENGTH = 64  # the lease_owner columns' width
# Claimable besides a table's own columns: the updated_at of the row's session (None: it has none),
# read in the claim's statement, so a worker that remembers that version of the session may skip
# reading it again (one statement per turn fewer on PostgreSQL: agents/stores/sql.py).
SESSION_VERSION = "session_version"
SESSION_VERSION_SQL = "(SELECT updated_at FROM chatflow_sessions WHERE session_id = {queue}.session_id)"


def check_owner(owner: str) -> str:
    """An owner id that fits its column: a longer one would fail every claim in the database (PostgreSQL)
    rather than here, with a message naming it."""
    if not owner or len(owner) > MAX_OWNER_LENGTH:
        raise ValueError(f"a lease owner id has 1 to {MAX_OWNER_LENGTH} characters, got {len(owner)}")
    return owner


async def claim(
    db: Database,
    table: Any,
    columns: tuple[str, ...],
    owner: str,
    lease: timedelta,
    limit: int,
    sessions: Sequence[str] | None = None,
) -> list[Row]:
    """Lease up to `limit` claimable rows of `table` (a mapped class) to `owner`, oldest first.

    `sessions`: conversations worth a look (new work arrived there). On PostgreSQL the claim then
    takes from their heads alone (by primary key for a dozen: queue_heads.py); the SQLite file,
    whose claim never meets dead row versions, looks at every due head all the same. Whatever it
    takes is claimable either way: the hint narrows the look-up, not the rule."""
    check_owner(owner)
    if limit <= 0 or (sessions is not None and not sessions):
        return []
    now = utcnow()
    if db.postgres is not None:
        return await claim_on_postgres(db.postgres, table, columns, owner, now, now + lease, limit, sessions)
    return await db.write_alone(
        claim_on_file(table, columns, owner, now, now + lease, limit),
        claim_on_engine(table, columns, owner, now, now + lease, limit),
    )


def claim_on_file(
    table: Any, columns: tuple[str, ...], owner: str, now: datetime, lease_until: datetime, limit: int
) -> Callable[[sqlite3.Connection], list[Row]]:
    """Lease the due heads, then their rows, returning the rows in id order."""
    queue = table.__tablename__
    decode = _file_decoders(table, columns)
    stamp = to_sqlite_datetime(lease_until)

    def work(conn: sqlite3.Connection) -> list[Row]:
        heads = queue_heads.lease_on_file(conn, queue, owner, now, lease_until, limit)
        if not heads:
            return []
        rows = conn.execute(_lease_rows_sql(queue, columns, len(heads)), (owner, stamp, *heads)).fetchall()
        rows.sort(key=lambda row: row[0])  # RETURNING has no order of its own
        if not any(decode):
            return rows
        return [(row[0], *map(_decode, decode, row[1:])) for row in rows]

    return work


async def claim_on_postgres(
    lanes: PostgresLanes,
    table: Any,
    columns: tuple[str, ...],
    owner: str,
    now: datetime,
    lease_until: datetime,
    limit: int,
    sessions: Sequence[str] | None = None,
) -> list[Row]:
    """The claim on PostgreSQL: one statement, heads then rows (one round trip instead of four with
    BEGIN and COMMIT), only the heads of `sessions` when given (see `claim`)."""
    queue = table.__tablename__
    params = {"b_queue": queue, "owner": owner, "now": now, "until": lease_until, "limit": limit}
    if sessions is not None:
        params["sessions"] = sorted(set(sessions))
    leased = await lanes.fetch(_claim_statement(table, columns, hinted=sessions is not None), params)
    return sorted((tuple(row) for row in leased), key=lambda row: row[0])


def claim_on_engine(
    table: Any, columns: tuple[str, ...], owner: str, now: datetime, lease_until: datetime, limit: int
) -> Callable[[AsyncConnection], Any]:
    """The same claim in SQLAlchemy for in-memory SQLite: two statements, outside a transaction
    (`Database.write_alone`), on the one connection nobody else uses meanwhile."""
    queue = table.__tablename__

    async def work(conn: AsyncConnection) -> list[Row]:
        heads = await queue_heads.lease_on_engine(conn, queue, owner, now, lease_until, limit)
        if not heads:
            return []
        leased = await conn.execute(
            _lease_rows_statement(table, columns),
            {"ids": sorted(heads), "owner": owner, "until": lease_until},
        )
        return sorted((tuple(row) for row in leased), key=lambda row: row[0])

    return work


@functools.cache
def _claim_statement(table: Any, columns: tuple[str, ...], hinted: bool) -> Statement:
    """PostgreSQL: the heads' lease (queue_heads.py) as a CTE, and the rows they point at, named with
    their conversations (by id alone PostgreSQL read the whole pending index: see store/turns.py)."""
    heads = queue_heads.lease_statement(hinted, postgres=True).cte("leased")
    return Statement(
        update(table)
        .where(
            tuple_(table.session_id, table.id).in_(select(heads.c.session_id, heads.c.next_id)),
            table.status == "pending",
        )
        .values(lease_owner=bindparam("owner"), lease_until=bindparam("until", type_=table.lease_until.type))
        .returning(table.id, *_returned(table, columns))
    )


@functools.cache
def _lease_rows_statement(table: Any, columns: tuple[str, ...]) -> Any:
    return (
        update(table)
        .where(table.id.in_(bindparam("ids", expanding=True)), table.status == "pending")
        .values(lease_owner=bindparam("owner"), lease_until=bindparam("until", type_=table.lease_until.type))
        .returning(table.id, *_returned(table, columns))
    )


def _returned(table: Any, columns: tuple[str, ...]) -> list[Any]:
    """The claimed columns as SQLAlchemy expressions (SESSION_VERSION: a subquery by primary key)."""
    version = select(SessionRow.updated_at).where(SessionRow.session_id == table.session_id)
    return [version.scalar_subquery() if c == SESSION_VERSION else getattr(table, c) for c in columns]


@functools.cache
def _lease_rows_sql(queue: str, columns: tuple[str, ...], count: int) -> str:
    marks = ", ".join("?" * count)
    returned = [SESSION_VERSION_SQL.format(queue=queue) if c == SESSION_VERSION else c for c in columns]
    return (
        f"UPDATE {queue} SET lease_owner = ?, lease_until = ? WHERE id IN ({marks}) AND status = 'pending' "
        f"RETURNING id, {', '.join(returned)}"
    )


def _decode(decoder: Callable[[Any], Any] | None, value: Any) -> Any:
    return value if decoder is None or value is None else decoder(value)


@functools.cache
def _file_decoders(table: Any, columns: tuple[str, ...]) -> list[Callable[[Any], Any] | None]:
    """How each claimed column's stored value is read on the SQLite file (None: as it is)."""
    json_columns = {c.key for c in table.__table__.columns if isinstance(c.type, JSON)}
    return [
        from_sqlite_datetime if c == SESSION_VERSION else json.loads if c in json_columns else None
        for c in columns
    ]


async def settle(db: Database, table: Any, row_id: int, owner: str, values: dict[str, Any]) -> bool:
    """Set `values` on pending row `row_id` while `owner` holds it (its outcome, a later attempt, or
    its lease handed back: the table's trigger then moves its conversation's head). False when the
    row is not `owner`'s any more: nothing is written."""
    unknown = set(values) - set(table.__table__.columns.keys())
    if unknown:
        raise ValueError(f"{table.__tablename__} has no column {sorted(unknown)[0]!r}")
    queue = table.__tablename__
    assignments = ", ".join(f"{k} = ?" for k in values)
    statement = f"UPDATE {queue} SET {assignments} WHERE id = ? AND lease_owner = ? AND status = 'pending'"
    params = (*(_sqlite_value(v) for v in values.values()), row_id, owner)

    def on_file(conn: sqlite3.Connection) -> bool:
        return bool(conn.execute(statement, params).rowcount == 1)

    async def on_engine(conn: AsyncConnection) -> bool:
        return await settle_on_engine(conn, table, row_id, owner, values)

    return await db.write_alone(on_file, on_engine)


async def settle_on_engine(
    conn: AsyncConnection, table: Any, row_id: int, owner: str, values: dict[str, Any]
) -> bool:
    statement = _settle_statement(table, tuple(values))
    params = {f"v_{name}": value for name, value in values.items()}
    settled = await conn.execute(statement, {"row_id": row_id, "owner": owner, **params})
    return bool(settled.rowcount == 1)


@functools.cache
def _settle_statement(table: Any, names: tuple[str, ...]) -> Any:
    """One per table and set of columns (a handful of call sites), built once."""
    columns = table.__table__.columns
    return (
        update(table)
        .where(
            table.id == bindparam("row_id"),
            table.lease_owner == bindparam("owner"),
            table.status == "pending",
        )
        .values({name: bindparam(f"v_{name}", type_=columns[name].type) for name in names})
    )


async def renew(db: Database, table: Any, ids: list[int], owner: str, lease: timedelta) -> set[int]:
    """Extend `owner`'s leases on rows `ids`, and on their heads, to `lease` from now; the ids it still
    held (and now holds longer). A row missing from the answer was taken over after its lease expired,
    or is finished."""
    if not ids:
        return set()
    lease_until = utcnow() + lease
    queue = table.__tablename__
    marks = ", ".join("?" * len(ids))
    statement = (
        f"UPDATE {queue} SET lease_until = ? WHERE id IN ({marks}) AND lease_owner = ? "
        "AND status = 'pending' RETURNING id, session_id"
    )
    params = (to_sqlite_datetime(lease_until), *ids, owner)

    def on_file(conn: sqlite3.Connection) -> set[int]:
        renewed = conn.execute(statement, params).fetchall()
        queue_heads.renew_on_file(conn, queue, [session for _, session in renewed], owner, lease_until)
        return {row_id for row_id, _ in renewed}

    async def on_engine(conn: AsyncConnection) -> set[int]:
        renewed = list(
            await conn.execute(
                update(table)
                .where(table.id.in_(sorted(ids)), table.lease_owner == owner, pending_by_row(table.status))
                .values(lease_until=lease_until)
                .returning(table.id, table.session_id)
            )
        )
        await queue_heads.renew_on_engine(
            conn, queue, [session for _, session in renewed], owner, lease_until
        )
        return {row_id for row_id, _ in renewed}

    return await db.write(on_file, on_engine)


async def release(db: Database, table: Any, row_id: int, owner: str) -> bool:
    """Hand a pending row back now rather than when its lease expires (shutting down)."""
    return await settle(db, table, row_id, owner, {"lease_owner": None, "lease_until": None})


async def release_many(db: Database, table: Any, ids: list[int], owner: str) -> None:
    """`release` for rows claimed but never started (a claim that finished as the process stopped)."""
    if not ids:
        return
    queue = table.__tablename__
    marks = ", ".join("?" * len(ids))
    statement = (
        f"UPDATE {queue} SET lease_owner = NULL, lease_until = NULL "
        f"WHERE id IN ({marks}) AND lease_owner = ? AND status = 'pending'"
    )

    def on_file(conn: sqlite3.Connection) -> None:
        conn.execute(statement, (*ids, owner))

    async def on_engine(conn: AsyncConnection) -> None:
        await conn.execute(
            update(table)
            .where(table.id.in_(sorted(ids)), table.lease_owner == owner, table.status == "pending")
            .values(lease_owner=None, lease_until=None)
        )

    await db.write_alone(on_file, on_engine)


def _sqlite_value(value: Any) -> Any:
    """A value as SQLAlchemy would store it on SQLite (see sqlite_thread.SQLITE_DATETIME_FORMAT)."""
    if isinstance(value, datetime):
        return to_sqlite_datetime(value)
    if isinstance(value, dict | list):
        return json_text(value)
    return value
