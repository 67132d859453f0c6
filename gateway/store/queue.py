"""Claiming rows of a work table (inbox, outbox) in order, one conversation at a time, with leases;
and the group commit that a process's writes to an SQLite file share.

A row is claimable when it is pending, due, not leased (or its lease expired), and no older row of
its conversation is still pending. A leased row is still pending, so it holds back the younger rows
of its conversation: each conversation advances in order, whatever the number of claimers.

On an SQLite file, every write of a process goes through one connection on one thread
(gateway/store/sqlite_thread.py): two connections of one process would queue for the file's write
lock in SQLite's busy handler, which sleeps. `GroupCommit` runs there, in one hop and one
transaction, whatever the process queued meanwhile (turns, claims, delivery results, session
loads); an operation that fails leaves no trace and does not affect the others (group commit). The
session store attaches its writer to its engine (`attach`); the inbox worker and the delivery find
it there (`writer_for`). Without one (PostgreSQL, in-memory SQLite) they use the engine: on
PostgreSQL a claim locks rows with FOR UPDATE SKIP LOCKED.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from sqlalchemy import JSON, exists, false, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import aliased

from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.sqlite_thread import SQLiteThread, to_sqlite_datetime
from gateway.store.tables import ChatRow

T = TypeVar("T")

MAX_OPERATIONS_PER_COMMIT = 1000  # keeps the write lock short for other processes on the file
HOPS_IN_FLIGHT = 2  # hops handed to the thread at once (see GroupCommit._schedule)


# --- group commit on an SQLite file ---------------------------------------------------------------
@dataclass
class _Operation:
    work: Callable[[sqlite3.Connection], Any]
    writes: bool
    future: asyncio.Future[Any]


class GroupCommit:
    """Operations of many tasks on one SQLiteThread: everything queued runs in the next hop.

    A hop with writes runs in one BEGIN IMMEDIATE ... COMMIT: a write that raises leaves no trace and
    its caller gets the exception; the others commit together and their callers get their results
    only after the COMMIT. If the COMMIT fails, every write of the hop gets that error. An operation
    whose caller was cancelled before its hop began never runs. Operations must depend only on the
    database (see _run_batch: one may run twice, the first run rolled back).
    """

    def __init__(self, thread: SQLiteThread) -> None:
        self.thread = thread
        self._queue: list[_Operation] = []
        self._in_flight = 0
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self._submit(work, writes=False)

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return await self._submit(work, writes=True)

    async def _submit(self, work: Callable[[sqlite3.Connection], T], *, writes: bool) -> T:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (asyncio.run once per call): start afresh
            self._loop, self._queue, self._in_flight, self._scheduled = loop, [], 0, False
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Operation(work, writes, future))
        self._schedule()
        return cast(T, await future)

    def _schedule(self) -> None:
        """Start a hop at the loop's next turn (what ready tasks queue meanwhile joins it), if one may start.

        Up to HOPS_IN_FLIGHT hops are handed to the thread at once: it runs them one after the other,
        going from one to the next without waiting for the event loop to take the first one's results.
        """
        if self._queue and not self._scheduled and self._in_flight < HOPS_IN_FLIGHT and self._loop:
            self._scheduled = True
            self._loop.call_soon(self._start_hop)

    def _start_hop(self) -> None:
        self._scheduled = False
        pending = [op for op in self._queue if not op.future.done()]  # a cancelled caller's never runs
        batch, self._queue = pending[:MAX_OPERATIONS_PER_COMMIT], pending[MAX_OPERATIONS_PER_COMMIT:]
        if not batch:
            return
        try:
            hop = self.thread.submit(functools.partial(_run_batch, batch))
        except Exception as exc:  # e.g. the thread is closed: fail the callers rather than leave them waiting
            for op in batch:
                op.future.set_exception(exc)
            return
        self._in_flight += 1
        hop.add_done_callback(functools.partial(self._finished, batch))
        self._schedule()

    def _finished(self, batch: list[_Operation], hop: asyncio.Future[list[tuple[bool, Any]]]) -> None:
        self._in_flight -= 1
        if hop.cancelled():
            for op in batch:
                op.future.cancel()
        elif (exc := hop.exception()) is not None:
            for op in batch:
                if not op.future.done():
                    op.future.set_exception(exc)
        else:
            for op, (ok, value) in zip(batch, hop.result(), strict=True):
                if op.future.done():
                    continue
                if ok:
                    op.future.set_result(value)
                else:
                    op.future.set_exception(value)
        self._schedule()


def _run_batch(batch: list[_Operation], conn: sqlite3.Connection) -> list[tuple[bool, Any]]:
    """On the SQLite thread: the batch's operations in order, its writes in one transaction.

    Optimistically without savepoints (each statement costs a release and a re-acquisition of the
    GIL); if a write fails, the whole transaction is rolled back and the batch runs again with a
    savepoint around each write. So an operation may run twice, the first run leaving no trace: it
    must depend only on the database.
    """
    if not any(op.writes for op in batch):
        return _run_operations(conn, batch, savepoints=False)
    conn.execute("BEGIN IMMEDIATE")
    outcomes: list[tuple[bool, Any]] = []
    try:
        outcomes = _run_operations(conn, batch, savepoints=False)
        if any(op.writes and not ok for op, (ok, _) in zip(batch, outcomes, strict=True)):
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            outcomes = _run_operations(conn, batch, savepoints=True)
        conn.execute("COMMIT")
    except BaseException as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if not isinstance(exc, Exception):
            raise
        # Nothing was written: every write of the hop shares the failure; the reads that ran stand.
        return [
            outcomes[i] if i < len(outcomes) and not op.writes else (False, exc) for i, op in enumerate(batch)
        ]
    return outcomes


def _run_operations(
    conn: sqlite3.Connection, batch: list[_Operation], *, savepoints: bool
) -> list[tuple[bool, Any]]:
    outcomes: list[tuple[bool, Any]] = []
    for op in batch:
        isolated = savepoints and op.writes
        if isolated:
            conn.execute("SAVEPOINT operation")
        try:
            value = op.work(conn)
        except Exception as exc:
            if isolated:
                conn.execute("ROLLBACK TO operation")
                conn.execute("RELEASE operation")
            outcomes.append((False, exc))
        else:
            if isolated:
                conn.execute("RELEASE operation")
            outcomes.append((True, value))
    return outcomes


_writers: weakref.WeakKeyDictionary[AsyncEngine, GroupCommit] = weakref.WeakKeyDictionary()
_by_thread: weakref.WeakKeyDictionary[SQLiteThread, GroupCommit] = weakref.WeakKeyDictionary()


def group_commit(thread: SQLiteThread) -> GroupCommit:
    """The one GroupCommit of `thread`, shared by everyone who writes through it."""
    writer = _by_thread.get(thread)
    if writer is None:
        writer = _by_thread[thread] = GroupCommit(thread)
    return writer


def attach(engine: AsyncEngine, thread: SQLiteThread) -> GroupCommit:
    """Make `thread` the writer of `engine`'s SQLite file in this process."""
    writer = _writers[engine] = group_commit(thread)
    return writer


def detach(engine: AsyncEngine, thread: SQLiteThread) -> None:
    """Forget `thread` as `engine`'s writer (it is closing), unless another took its place."""
    writer = _writers.get(engine)
    if writer is not None and writer.thread is thread:
        del _writers[engine]


def writer_for(engine: AsyncEngine) -> GroupCommit | None:
    return _writers.get(engine)


def _decode(value: Any, is_json: bool) -> Any:
    return json.loads(value) if is_json and value is not None else value


def _sqlite_value(value: Any) -> Any:
    """A value as SQLAlchemy would store it on SQLite (see sqlite_thread.SQLITE_DATETIME_FORMAT)."""
    if isinstance(value, datetime):
        return to_sqlite_datetime(value)
    if isinstance(value, dict | list):
        return json.dumps(value)
    return value


# --- claiming ------------------------------------------------------------------------------------
async def claim(
    engine: AsyncEngine, table: Any, columns: list[Any], owner: str, lease: timedelta, limit: int
) -> list[Any]:
    """Lease up to `limit` claimable rows of `table` (a mapped class) to `owner`, oldest first.

    Returns rows of (id, *columns).
    """
    if limit <= 0:
        return []
    now = datetime.now(UTC)
    writer = writer_for(engine)
    if writer is not None:
        return await writer.write(_sqlite_claim(table, columns, owner, now, now + lease, limit))
    older = aliased(table)
    oldest_pending = select(func.min(older.id)).where(older.status == "pending").scalar_subquery()
    held_back = exists().where(
        older.session_id == table.session_id,
        older.status == "pending",
        older.id < table.id,
        older.id >= oldest_pending,  # the backlog only, whatever the conversation's history (see _claim_sql)
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
    # SQLite without a writer thread (in memory): look for rows without the write lock, then take
    # the lease in a short write, only on rows still free.
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


def _sqlite_claim(
    table: Any, columns: list[Any], owner: str, now: datetime, lease_until: datetime, limit: int
) -> Callable[[sqlite3.Connection], list[tuple[Any, ...]]]:
    """The claim as one statement: select the claimable rows and lease them, returning them."""
    statement, decode = _claim_sql(table, tuple(c.key for c in columns))
    stamp = to_sqlite_datetime(now)
    params = (owner, to_sqlite_datetime(lease_until), stamp, stamp, limit)

    def work(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
        rows = conn.execute(statement, params).fetchall()
        rows.sort(key=lambda row: row[0])  # RETURNING has no order of its own
        if not any(decode):
            return rows
        return [(row[0], *map(_decode, row[1:], decode)) for row in rows]

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


async def update_row(
    engine: AsyncEngine,
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
    writer = writer_for(engine)
    if writer is not None:
        where = ["id = ?"]
        params = [_sqlite_value(v) for v in values.values()]
        params.append(row_id)
        if lease_owner is not None:
            where.append("lease_owner = ?")
            params.append(lease_owner)
        if status is not None:
            where.append("status = ?")
            params.append(status)
        statement = (
            f"UPDATE {table.__tablename__} SET {', '.join(f'{k} = ?' for k in values)} "
            f"WHERE {' AND '.join(where)}"
        )
        return await writer.write(lambda conn: conn.execute(statement, params).rowcount == 1)
    conditions = [table.id == row_id]
    if lease_owner is not None:
        conditions.append(table.lease_owner == lease_owner)
    if status is not None:
        conditions.append(table.status == status)
    async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
        result = await conn.execute(update(table).where(*conditions).values(**values))
    return bool(result.rowcount == 1)


async def claim_with_chats(
    engine: AsyncEngine, table: Any, columns: list[Any], owner: str, lease: timedelta, limit: int
) -> tuple[list[Any], set[tuple[str, str]]]:
    """`claim`, and which of the claimed rows' chats the bot may no longer send to, as (platform, chat id).

    For a table with `platform` and `target_json` (the outbox); on an SQLite file in one operation.
    """
    keys = [column.key for column in columns]  # (== on SQLAlchemy columns builds expressions)
    platform_at = 1 + keys.index("platform")
    target_at = 1 + keys.index("target_json")

    def chats_of(rows: list[Any]) -> list[tuple[str, str]]:
        return [
            (row[platform_at], str(row[target_at]["chat_id"]))
            for row in rows
            if isinstance(row[target_at], dict) and row[target_at].get("chat_id") is not None
        ]

    writer = writer_for(engine)
    if writer is None:
        rows = await claim(engine, table, columns, owner, lease, limit)
        return rows, await unreachable_chats(engine, chats_of(rows))
    if limit <= 0:
        return [], set()
    now = datetime.now(UTC)
    claim_rows = _sqlite_claim(table, columns, owner, now, now + lease, limit)

    def work(conn: sqlite3.Connection) -> tuple[list[Any], set[tuple[str, str]]]:
        rows = claim_rows(conn)
        return rows, _unreachable_sqlite(conn, chats_of(rows))

    return await writer.write(work)


@functools.cache
def _unreachable_sql(count: int) -> str:
    marks = ", ".join("?" * count)
    return f"SELECT platform, chat_id FROM chatflow_chats WHERE reachable = 0 AND chat_id IN ({marks})"


def _unreachable_sqlite(conn: sqlite3.Connection, chats: list[tuple[str, str]]) -> set[tuple[str, str]]:
    wanted = set(chats)
    if not wanted:
        return set()
    ids = sorted({chat_id for _, chat_id in wanted})
    found = set()
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        found.update(conn.execute(_unreachable_sql(len(chunk)), chunk).fetchall())
    return {(platform, chat_id) for platform, chat_id in found} & wanted


async def unreachable_chats(engine: AsyncEngine, chats: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """Of these (platform, chat id) pairs, those the platform said the bot was removed from or blocked in."""
    wanted = sorted(set(chats))
    if not wanted:
        return set()
    writer = writer_for(engine)
    if writer is not None:
        return await writer.read(lambda conn: _unreachable_sqlite(conn, wanted))
    query = select(ChatRow.platform, ChatRow.chat_id).where(
        ChatRow.reachable == false(), tuple_(ChatRow.platform, ChatRow.chat_id).in_(wanted)
    )
    async with engine.connect() as conn:
        return {(platform, chat_id) for platform, chat_id in await conn.execute(query)}
