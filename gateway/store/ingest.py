"""Durable acknowledgements with group commit: dedup keys and inbox rows, many requests per transaction.

A webhook may answer 200 only once its messages are stored, and one SQLite transaction per request
caps ingest near a thousand requests per second. So webhooks hand their items to one writer task,
which takes everything queued while earlier commits ran, writes it in one transaction, and then
answers every waiting request. If the commit fails, they all get the error (and the platform retries).

On an SQLite file the commits run on the sqlite thread (gateway/store/sqlite_thread.py), ahead of
the other work waiting there (turns, claims), two batches at a time: one commits while the next
waits on the thread, so the thread never waits for the event loop between them. A batch is a few
multi-row statements (see _commit_sqlite), because every statement costs the thread a wait for the
GIL, while the event loop keeps it busy.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import structlog
from sqlalchemy import update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store import dedup
from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.sqlite_thread import SQLiteThread, to_sqlite_datetime
from gateway.store.sqlite_thread import in_transaction as _in_transaction
from gateway.store.tables import ChatRow, InboxRow, OutboxRow, ProcessedMessageRow

log = structlog.get_logger(__name__)
MAX_BATCH_ITEMS = 2000
# Requests waiting for a commit that make the writer `busy` (a flood): a steady 800 webhooks/s from 32
# connections, turns running, stayed under it (at 8, turns held back there fell 2.6 s behind); a
# flood from 64 connections stays above it.
BUSY_WAITING_REQUESTS = 24
SWITCH_INTERVAL_SECONDS = 0.001  # the interpreter's GIL switch interval while the writer runs (see start)
# Rows per multi-row statement (10 parameters per inbox row: far below SQLite's 32,766). A batch of
# up to this many is one statement of each kind; bigger batches are rare (one request per connection).
MAX_ROWS_PER_STATEMENT = 64


@dataclass(frozen=True)
class InboxEntry:
    """The inbox row written for a new message key."""

    platform: str
    session_id: str
    message_id: str
    kind: str
    text: str | None
    message: dict[str, Any]
    status: str  # "pending" when a turn is due, "recorded" when it is only kept


@dataclass(frozen=True)
class IngestItem:
    """One dedup key to claim; `inbox` or `delivery` is written only when the key is new."""

    dedup_key: str
    platform: str
    inbox: InboxEntry | None = None
    delivery: DeliveryStatus | None = None
    chat: ChatState | None = None


@dataclass(frozen=True)
class ChatState:
    """Whether the bot may send to a chat, as of `changed_at` (a later change always wins)."""

    chat_id: str
    reachable: bool
    membership: str
    changed_at: datetime


@dataclass(frozen=True)
class DeliveryStatus:
    """A platform's status of a reply we sent, applied to its outbox row (found by platform message id)."""

    platform_message_id: str
    status: str  # sent, delivered, read, played, failed
    error_code: str | None = None
    error_message: str | None = None


# A status only moves a row forward: a late "delivered" does not undo "read"; "failed" always applies.
_STATUS_RANK = {"sent": 1, "delivered": 2, "read": 3, "played": 3}


@dataclass(slots=True)
class _Request:
    items: list[IngestItem]
    done: asyncio.Future[list[bool]]


class IngestWriter:
    """Commits dedup keys and inbox rows for many webhook requests at once.

    `write(items)` returns, per item, whether its key was new (False: a re-delivery, nothing written).
    """

    def __init__(self, engine: AsyncEngine, sqlite_file: SQLiteThread | None, dedup_ttl_hours: float) -> None:
        self.engine = engine
        self._sqlite = sqlite_file
        self._ttl_seconds = dedup_ttl_hours * 3600
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        # The sqlite thread runs commits one after the other, in the order they were handed over, so
        # a second batch may wait there while the first commits: the thread goes from one to the
        # next without waiting for the event loop. Through the engine (PostgreSQL), one at a time, so
        # inbox ids keep the order of arrival.
        self._max_in_flight = 2 if sqlite_file is not None else 1
        self._waiting = 0  # requests queued or being committed
        self._switch_interval: float | None = None  # the interpreter's, while start() lowered it

    @property
    def busy(self) -> bool:
        """Whether webhooks arrive faster than they commit (a flood): work that can wait (turns) may
        hold back. Some requests wait for every commit at any steady rate; a flood queues many."""
        return self._waiting >= BUSY_WAITING_REQUESTS

    async def start(self) -> None:
        if self._sqlite is not None and self._switch_interval is None:
            # Each statement of a commit releases the GIL on the sqlite thread, which then waits for
            # it while the event loop runs: up to a whole switch interval (5 ms by default) per
            # statement, which a busy loop always makes it wait. 1 ms gave ~15% more acks/s.
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_SECONDS))
        self._task = asyncio.create_task(self._run(), name="ingest-writer")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    async def write(self, items: list[IngestItem]) -> list[bool]:
        if not items:
            return []
        if self._task is None or self._task.done():
            raise RuntimeError("the ingest writer is not running")
        done: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Request(items, done))
        self._waiting += 1
        try:
            return await done
        finally:
            self._waiting -= 1

    async def _run(self) -> None:
        slots = asyncio.Semaphore(self._max_in_flight)
        while True:
            first = await self._queue.get()
            await slots.acquire()
            # Everything that queued meanwhile (while earlier commits ran) joins this batch.
            batch = [first]
            count = len(first.items)
            while count < MAX_BATCH_ITEMS and not self._queue.empty():
                request = self._queue.get_nowait()
                batch.append(request)
                count += len(request.items)
            try:
                self._start_commit(
                    [item for request in batch for item in request.items],
                    functools.partial(self._committed, batch, slots),
                )
            except Exception as exc:
                self._committed(batch, slots, None, exc)

    def _committed(
        self,
        batch: list[_Request],
        slots: asyncio.Semaphore,
        results: list[bool] | None,
        exc: BaseException | None,
    ) -> None:
        """Answer every request of `batch`: its slice of `results`, or `exc` for all."""
        slots.release()
        if exc is not None:
            count = sum(len(request.items) for request in batch)
            log.error("ingest_commit_failed", items=count, error=type(exc).__name__, detail=str(exc)[:300])
        offset = 0
        for request in batch:
            size = len(request.items)
            if not request.done.done():
                if exc is not None:
                    request.done.set_exception(exc)
                else:
                    assert results is not None
                    request.done.set_result(results[offset : offset + size])
            offset += size
            self._queue.task_done()

    def _start_commit(
        self, items: list[IngestItem], done: Callable[[list[bool] | None, BaseException | None], None]
    ) -> None:
        """Start committing `items`; `done(results, exception)` runs on the loop when it is over."""
        now = datetime.now(UTC)
        if self._sqlite is not None:
            batch = _sqlite_batch(items, now, self._ttl_seconds)
            self._sqlite.post(lambda conn: _ingest_sqlite(conn, batch), done, urgent=True)
            return
        task = asyncio.ensure_future(self._commit_engine(items, now))

        def finished(task: asyncio.Future[list[bool]]) -> None:
            if task.cancelled():
                done(None, asyncio.CancelledError())
            else:
                exc = task.exception()
                done(None if exc is not None else task.result(), exc)

        task.add_done_callback(finished)

    async def _commit_engine(self, items: list[IngestItem], now: datetime) -> list[bool]:
        expires = now + timedelta(seconds=self._ttl_seconds)
        first: dict[str, int] = {}
        for index, item in enumerate(items):
            first.setdefault(item.dedup_key, index)
        rows = [
            {
                "message_key": items[i].dedup_key,
                "platform": items[i].platform,
                "processed_at": now,
                "expires_at": expires,
            }
            for i in first.values()
        ]
        dialect = self.engine.dialect.name
        claim = dedup.claim_keys(dialect, rows, now).returning(ProcessedMessageRow.message_key)
        dialect_insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        async with self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            claimed = set((await conn.execute(claim)).scalars())
            new = [
                first.get(item.dedup_key) == i and item.dedup_key in claimed for i, item in enumerate(items)
            ]
            inbox = [
                _inbox_values(item, now)
                for item, is_new in zip(items, new, strict=True)
                if is_new and item.inbox
            ]
            if inbox:
                # A key re-claimed after its TTL keeps its old inbox row: never fail the batch on it.
                await conn.execute(dialect_insert(InboxRow).on_conflict_do_nothing(), inbox)
            for item, is_new in zip(items, new, strict=True):
                if is_new and item.delivery is not None:
                    await conn.execute(_status_update(item.platform, item.delivery, now))
                if is_new and item.chat is not None:
                    await conn.execute(_chat_upsert(dialect_insert, item.platform, item.chat))
        return new


def _allowed_before(status: str) -> list[str]:
    """The outbox statuses a new `status` may replace."""
    if status == "failed":
        return ["pending", "sent", "delivered", "read"]
    rank = _STATUS_RANK.get(status, 0)
    return ["pending", *(s for s, r in _STATUS_RANK.items() if r < rank)]


def _status_update(platform: str, delivery: DeliveryStatus, now: datetime) -> Any:
    return (
        update(OutboxRow)
        .where(
            OutboxRow.platform == platform,
            OutboxRow.platform_message_id == delivery.platform_message_id,
            OutboxRow.status.in_(_allowed_before(delivery.status)),
        )
        .values(
            status=delivery.status,
            error_code=delivery.error_code,
            error_message=delivery.error_message,
            updated_at=now,
        )
    )


def _chat_upsert(dialect_insert: Any, platform: str, chat: ChatState) -> Any:
    statement = dialect_insert(ChatRow).values(
        platform=platform,
        chat_id=chat.chat_id,
        reachable=chat.reachable,
        membership=chat.membership,
        updated_at=chat.changed_at,
    )
    return statement.on_conflict_do_update(
        index_elements=[ChatRow.platform, ChatRow.chat_id],
        set_={
            "reachable": statement.excluded.reachable,
            "membership": statement.excluded.membership,
            "updated_at": statement.excluded.updated_at,
        },
        where=ChatRow.updated_at <= statement.excluded.updated_at,
    )


_UPSERT_CHAT = (
    "INSERT INTO chatflow_chats (platform, chat_id, reachable, membership, updated_at) "
    "VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (platform, chat_id) DO UPDATE SET reachable = excluded.reachable, "
    "membership = excluded.membership, updated_at = excluded.updated_at "
    "WHERE chatflow_chats.updated_at <= excluded.updated_at"
)


def _inbox_values(item: IngestItem, now: datetime) -> dict[str, Any]:
    entry = item.inbox
    assert entry is not None
    return {
        "dedup_key": item.dedup_key,
        "platform": entry.platform,
        "session_id": entry.session_id,
        "message_id": entry.message_id,
        "kind": entry.kind,
        "text": entry.text,
        "message_json": entry.message,
        "status": entry.status,
        "attempts": 0,
        "next_attempt_at": now,
        "received_at": now,
    }


def _value_chunks(count: int) -> list[tuple[int, int]]:
    """(start, size) chunks of `count` rows, at most MAX_ROWS_PER_STATEMENT each.

    A batch is written with one multi-row statement of each kind instead of one statement per row:
    the sqlite3 module releases the GIL around every statement, and each time the sqlite thread
    wants it back while the event loop is busy it can wait a whole switch interval (5 ms). The
    SQL texts, one per size, stay few enough for the connection's statement cache
    (sqlite_thread.STATEMENT_CACHE_SIZE).
    """
    return [
        (start, min(MAX_ROWS_PER_STATEMENT, count - start))
        for start in range(0, count, MAX_ROWS_PER_STATEMENT)
    ]


@functools.cache
def _live_keys_sql(count: int) -> str:
    """Which of `count` keys are held and not expired (parameters: now, then the keys)."""
    marks = ", ".join("?" * count)
    return (
        "SELECT message_key FROM chatflow_processed_messages "
        f"WHERE expires_at > ? AND message_key IN ({marks})"
    )


@functools.cache
def _claim_sql(count: int) -> str:
    """CLAIM_KEY_SQLITE for `count` rows (parameters: 4 per row, then now)."""
    rows = ", ".join(["(?, ?, ?, ?)"] * count)
    return (
        "INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
        f"VALUES {rows} ON CONFLICT (message_key) DO UPDATE SET platform = excluded.platform, "
        "processed_at = excluded.processed_at, expires_at = excluded.expires_at "
        "WHERE chatflow_processed_messages.expires_at <= ?"
    )


@functools.cache
def _inbox_sql(count: int) -> str:
    """Inbox rows, a re-claimed key's old row kept (parameters: 10 per row)."""
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)"] * count)
    return (
        "INSERT OR IGNORE INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
        f"message_json, status, attempts, next_attempt_at, received_at) VALUES {rows}"
    )


def _claim(conn: sqlite3.Connection, claims: list[tuple[str, str, str, str]], stamp: str) -> bool:
    """Claim every key of `claims`; whether each one of them changed a row (so was new)."""
    claimed = 0
    for start, size in _value_chunks(len(claims)):
        params = [value for claim in claims[start : start + size] for value in claim]
        params.append(stamp)
        claimed += conn.execute(_claim_sql(size), params).rowcount
    return claimed == len(claims)


@dataclass
class _SQLiteBatch:
    """A batch's parameters, built on the event loop so the sqlite thread only runs statements."""

    items: list[IngestItem]
    stamp: str
    keys: list[str]  # distinct, in order of first appearance
    first: list[bool]  # per item: the first item of the batch with its key
    claims: dict[str, tuple[str, str, str, str]]  # key -> claim parameters
    inbox: list[tuple[Any, ...] | None]  # per item: its inbox row's parameters, if it has one
    number: int  # tells this batch's rows in the claimed-keys table of the one-statement path


def _sqlite_batch(items: list[IngestItem], now: datetime, ttl: float) -> _SQLiteBatch:
    stamp = to_sqlite_datetime(now)
    expires = to_sqlite_datetime(now + timedelta(seconds=ttl))
    claims: dict[str, tuple[str, str, str, str]] = {}
    first = []
    inbox: list[tuple[Any, ...] | None] = []
    for item in items:
        key = item.dedup_key
        is_first = key not in claims
        first.append(is_first)
        if is_first:
            claims[key] = (key, item.platform, stamp, expires)
        entry = item.inbox
        inbox.append(
            None
            if entry is None or not is_first
            else (
                key,
                entry.platform,
                entry.session_id,
                entry.message_id,
                entry.kind,
                entry.text,
                _json_text(entry.message),
                entry.status,
                stamp,
                stamp,
            )
        )
    return _SQLiteBatch(items, stamp, list(claims), first, claims, inbox, next(_batch_numbers))


def _json_text(value: dict[str, Any]) -> str:
    """orjson, a tenth of json.dumps' time on the webhook path; json.dumps for what orjson refuses
    (a lone surrogate from a "\\ud800" escape, an integer over 64 bits), so any JSON is stored."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value)


_batch_numbers = itertools.count(1)
# Temporary objects of the sqlite thread's connection (not of the database: no migration, nothing
# on disk), for committing a batch in one statement. Inserting into the view runs the trigger once
# per key: claim it, note it when it was claimed (changes() = 1), then write its inbox row if so.
_ONE_STATEMENT_OBJECTS = (
    "CREATE TEMP TABLE IF NOT EXISTS gateway_ingest_claimed "
    "(batch INTEGER NOT NULL, message_key TEXT NOT NULL)",
    "CREATE TEMP VIEW IF NOT EXISTS gateway_ingest AS SELECT NULL AS batch, NULL AS message_key, "
    "NULL AS platform, NULL AS processed_at, NULL AS expires_at, NULL AS inbox, "
    "NULL AS inbox_platform, NULL AS session_id, NULL AS message_id, NULL AS kind, NULL AS text, "
    "NULL AS message_json, NULL AS status",
    "CREATE TEMP TRIGGER IF NOT EXISTS gateway_ingest_row INSTEAD OF INSERT ON gateway_ingest BEGIN "
    "INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
    "VALUES (NEW.message_key, NEW.platform, NEW.processed_at, NEW.expires_at) "
    "ON CONFLICT (message_key) DO UPDATE SET platform = excluded.platform, "
    "processed_at = excluded.processed_at, expires_at = excluded.expires_at "
    "WHERE chatflow_processed_messages.expires_at <= excluded.processed_at; "
    "INSERT INTO gateway_ingest_claimed SELECT NEW.batch, NEW.message_key WHERE changes() = 1; "
    "INSERT OR IGNORE INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
    "message_json, status, attempts, next_attempt_at, received_at) SELECT NEW.message_key, "
    "NEW.inbox_platform, NEW.session_id, NEW.message_id, NEW.kind, NEW.text, NEW.message_json, NEW.status, "
    "0, NEW.processed_at, NEW.processed_at WHERE NEW.inbox AND changes() = 1; "
    "END",
)
_CLAIMED_KEPT_BATCHES = 32  # the claimed-keys table is emptied of older batches this often


@functools.cache
def _one_statement_sql(count: int) -> str:
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"] * count)
    return f"INSERT INTO gateway_ingest VALUES {rows}"


def _ingest_sqlite(conn: sqlite3.Connection, batch: _SQLiteBatch) -> list[bool]:
    """On the sqlite thread, outside any transaction: commit `batch`, return which items were new.

    A batch of message keys only (no delivery statuses, no membership changes) of up to
    MAX_ROWS_PER_STATEMENT keys is one INSERT into a temporary view, whose trigger does the rest:
    one statement, atomic on its own, so one wait for the GIL instead of four (BEGIN, two INSERTs,
    COMMIT). When every key changed a row (the common case: nothing was a re-delivery) the
    connection's change count says so; otherwise the keys claimed are read back. If the statement
    cannot take the write lock at once (another process wrote since it began), nothing was written
    and the batch is committed the usual way, in BEGIN IMMEDIATE, which waits for the lock.
    """
    if len(batch.keys) <= MAX_ROWS_PER_STATEMENT and not any(
        item.delivery is not None or item.chat is not None for item in batch.items
    ):
        try:
            return _commit_in_one_statement(conn, batch)
        except sqlite3.OperationalError as exc:
            if "gateway_ingest" not in str(exc):
                return _in_transaction(conn, lambda conn: _commit_sqlite(conn, batch))
        for statement in _ONE_STATEMENT_OBJECTS:  # this connection's first batch
            conn.execute(statement)
        return _commit_in_one_statement(conn, batch)
    return _in_transaction(conn, lambda conn: _commit_sqlite(conn, batch))


def _commit_in_one_statement(conn: sqlite3.Connection, batch: _SQLiteBatch) -> list[bool]:
    keys = batch.keys
    first_items = {item.dedup_key: index for index, item in reversed(list(enumerate(batch.items)))}
    params: list[Any] = []
    with_inbox = 0
    for key in keys:
        claim = batch.claims[key]
        row = batch.inbox[first_items[key]]
        with_inbox += row is not None
        params += (batch.number, key, claim[1], claim[2], claim[3], row is not None)
        params += (None,) * 7 if row is None else row[1:8]
    before = conn.total_changes
    conn.execute(_one_statement_sql(len(keys)), params)
    # Each key claimed changes two rows (its key, its note), three with an inbox row written.
    if conn.total_changes - before == 2 * len(keys) + with_inbox:
        claimed = set(keys)
    else:
        found = conn.execute(
            "SELECT message_key FROM gateway_ingest_claimed WHERE batch = ?", (batch.number,)
        )
        claimed = {row[0] for row in found}
    if batch.number % _CLAIMED_KEPT_BATCHES == 0:
        conn.execute("DELETE FROM gateway_ingest_claimed WHERE batch <= ?", (batch.number,))
    return [first and item.dedup_key in claimed for item, first in zip(batch.items, batch.first, strict=True)]


def _commit_sqlite(conn: sqlite3.Connection, batch: _SQLiteBatch) -> list[bool]:
    """Claim the batch's keys and write inbox rows of the new ones; runs inside BEGIN IMMEDIATE.

    Every statement is one multi-row statement (per chunk of MAX_ROWS_PER_STATEMENT rows). First
    optimistically: all keys are claimed at once (inserted, or taken over once expired), and when
    every one of them changed a row they were all new, the common case. Otherwise (a re-delivery, a
    duplicate in the batch) the transaction starts over, still holding the write lock: the keys still
    live are read, and only the others are claimed.
    """
    stamp = batch.stamp
    keys = batch.keys
    live: set[str] = set()
    if not _claim(conn, [batch.claims[key] for key in keys], stamp):
        conn.execute("ROLLBACK")
        conn.execute("BEGIN IMMEDIATE")
        for start, size in _value_chunks(len(keys)):
            chunk = keys[start : start + size]
            live.update(row[0] for row in conn.execute(_live_keys_sql(size), (stamp, *chunk)))
        # Under the write lock every key not live is claimable: never acknowledge one that was not.
        if not _claim(conn, [batch.claims[key] for key in keys if key not in live], stamp):
            raise RuntimeError("a dedup key could not be claimed under the write lock")
    results = [
        first and item.dedup_key not in live for item, first in zip(batch.items, batch.first, strict=True)
    ]
    inbox = [row for row, is_new in zip(batch.inbox, results, strict=True) if is_new and row is not None]
    for start, size in _value_chunks(len(inbox)):
        conn.execute(_inbox_sql(size), [value for row in inbox[start : start + size] for value in row])
    for item, is_new in zip(batch.items, results, strict=True):
        if is_new and item.delivery is not None:
            allowed = _allowed_before(item.delivery.status)
            placeholders = ", ".join("?" * len(allowed))
            conn.execute(
                "UPDATE chatflow_outbox SET status = ?, error_code = ?, error_message = ?, updated_at = ? "
                f"WHERE platform = ? AND platform_message_id = ? AND status IN ({placeholders})",
                (
                    item.delivery.status,
                    item.delivery.error_code,
                    item.delivery.error_message,
                    stamp,
                    item.platform,
                    item.delivery.platform_message_id,
                    *allowed,
                ),
            )
        if is_new and item.chat is not None:
            chat = item.chat
            values = (
                item.platform,
                chat.chat_id,
                chat.reachable,
                chat.membership,
                to_sqlite_datetime(chat.changed_at),
            )
            conn.execute(_UPSERT_CHAT, values)
    return results
