"""What a webhook stores before its 200, for many requests per transaction (group commit).

A webhook may answer 200 only once what it carried is stored, and one SQLite transaction per request
caps ingest near a thousand requests per second. So webhooks submit their parsed updates to one
batcher (gateway/store/group_commit.py), which commits whatever queued while earlier commits ran and
then answers every waiting request. If the commit fails, they all get the error (and the platform
retries). Per item of an update: its dedup key is claimed (gateway/store/dedup.py), and only when the
key is new is its effect written: a message's inbox row (inbox.py), a status's outbox update
(outbox.py), a membership change (chats.py).

On an SQLite file the commits run on the writer thread, ahead of the other work waiting there (turns,
claims), two batches at a time. A batch is a few multi-row statements (see _commit_on_file), because
every statement costs the thread a wait for the GIL while the event loop keeps it busy.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gateway.domain.inbound import InboundMessage, MembershipChange, ParsedUpdate, StatusUpdate
from gateway.domain.messages import utcnow
from gateway.errors import GatewayError
from gateway.store import chats, dedup, inbox, outbox, postgres_ingest, storable
from gateway.store.database import Database
from gateway.store.group_commit import Outcome
from gateway.store.sqlite_thread import in_transaction, to_sqlite_datetime
from gateway.store.tables import ProcessedMessageRow

# Requests waiting for a commit that make the writer `busy` (a flood): a steady 800 webhooks/s from 32
# connections, turns running, stayed under it (at 8, turns held back there fell 2.6 s behind); a
# flood from 64 connections stays above it.
BUSY_WAITING_REQUESTS = 24
# Rows per multi-row statement (10 parameters per inbox row: far below SQLite's 32,766). A batch of
# up to this many is one statement of each kind; bigger batches are rare (one request per connection).
MAX_ROWS_PER_STATEMENT = 64


@dataclass(frozen=True, slots=True)
class _Item:
    """One dedup key of an update; what it writes when the key is new."""

    key: str
    platform: str
    message: InboundMessage | None = None
    pending: bool = False  # the message starts a turn
    status: StatusUpdate | None = None
    membership: MembershipChange | None = None


DEFAULT_TIMEOUT_SECONDS = 5.0  # the longest a webhook waits for its commit before answering 503
DEFAULT_MAX_WAITING = 2000  # webhooks waiting for a commit at once; more are refused at once (503)


class OverloadedError(GatewayError):
    """More webhooks are waiting for a commit than the process takes (the database is slow or away)."""


class Ingest:
    """`write(update, pending)` stores a parsed webhook; per item (messages, then statuses, then
    membership changes) whether its key was new (False: a re-delivery, nothing written).

    Bounded in time and memory: a write waits at most `timeout` seconds for its commit (TimeoutError;
    the commit may still land, and the platform's retry is then a re-delivery), and with `max_waiting`
    writes already waiting a new one is refused at once (OverloadedError). A frozen database thus
    answers 503s in seconds instead of piling requests up without bound.
    """

    def __init__(
        self,
        db: Database,
        dedup_ttl: timedelta,
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        self._db = db
        self._ttl = dedup_ttl
        self._timeout = timeout
        self._max_waiting = max_waiting
        self._batcher = db.batcher(self._commit_on_file, self._commit_on_engine, urgent=True)

    @property
    def busy(self) -> bool:
        """Whether webhooks arrive faster than they commit (a flood): work that can wait (turns) may
        hold back. Some requests wait for every commit at any steady rate; a flood queues many."""
        return self._batcher.waiting >= BUSY_WAITING_REQUESTS

    async def write(self, update: ParsedUpdate, pending: Sequence[bool]) -> list[bool]:
        """`pending`: per message of `update`, whether it starts a turn. Its values are made storable
        first (gateway/store/storable.py), so one bad value cannot fail the batch it joins."""
        update = storable.update(update)
        items = [
            _Item(m.dedup_key, m.platform, message=m, pending=p)
            for m, p in zip(update.messages, pending, strict=True)
        ]
        items += [_Item(s.dedup_key, s.platform, status=s) for s in update.statuses]
        items += [_Item(c.dedup_key, c.platform, membership=c) for c in update.memberships]
        if not items:
            return []
        if self._batcher.waiting >= self._max_waiting:
            raise OverloadedError(f"{self._batcher.waiting} webhooks are waiting for the database")
        async with asyncio.timeout(self._timeout):
            result: list[bool] = await self._batcher.submit(items)
        return result

    # --- SQLAlchemy (PostgreSQL, in-memory SQLite) -----------------------------------------------
    async def _commit_on_engine(self, requests: list[list[_Item]]) -> list[Outcome]:
        items = [item for request in requests for item in request]
        now = utcnow()
        first: dict[str, int] = {}
        for index, item in enumerate(items):
            first.setdefault(item.key, index)
        db = self._db
        # Several batches commit at once on PostgreSQL: each takes its row locks in one order (keys,
        # then the conversations' queue heads, which the inbox's trigger moves in session order, then
        # delivery statuses), so two batches never wait for each other in a cycle.
        distinct = sorted((items[i].key, items[i].platform) for i in first.values())
        if db.postgres is not None and not any(item.status or item.membership for item in items):
            firsts = [items[i].message for i in sorted(first.values())]
            pending = [items[i].pending for i in sorted(first.values())]
            claimed = await postgres_ingest.store_messages(
                db.postgres, distinct, firsts, pending, now, dedup.expires_at(now, self._ttl)
            )
            return _per_request(
                requests, [first[i.key] == n and i.key in claimed for n, i in enumerate(items)]
            )
        rows = dedup.claim_rows(distinct, now, self._ttl)
        claim = dedup.claim_keys(db, rows).returning(ProcessedMessageRow.message_key)
        async with db.begin() as conn:
            claimed = set((await conn.execute(claim)).scalars())
            new = [first.get(item.key) == i and item.key in claimed for i, item in enumerate(items)]
            fresh = [item for item, is_new in zip(items, new, strict=True) if is_new]
            inbox_rows = [inbox.insert_values(i.message, i.pending, now) for i in fresh if i.message]
            if inbox_rows:
                await conn.execute(inbox.insert(db, inbox_rows))
            for status in sorted((i.status for i in fresh if i.status), key=lambda s: s.dedup_key):
                await conn.execute(outbox.apply_status(status, now))
            for change in sorted((i.membership for i in fresh if i.membership), key=lambda c: c.dedup_key):
                await conn.execute(chats.upsert(db, change))
        return _per_request(requests, new)

    # --- the SQLite file ---------------------------------------------------------------------------
    def _commit_on_file(self, requests: list[list[_Item]]) -> Callable[[sqlite3.Connection], list[Outcome]]:
        """The batch's parameters, built on the event loop; the work the writer thread runs with them."""
        batch = _file_batch([item for request in requests for item in request], utcnow(), self._ttl)
        return lambda conn: _per_request(requests, _ingest_on_file(conn, batch))


def _per_request(requests: list[list[_Item]], new: list[bool]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    offset = 0
    for request in requests:
        outcomes.append((True, new[offset : offset + len(request)]))
        offset += len(request)
    return outcomes


def _value_chunks(count: int) -> list[tuple[int, int]]:
    """(start, size) chunks of `count` rows, at most MAX_ROWS_PER_STATEMENT each.

    A batch is written with one multi-row statement of each kind instead of one statement per row:
    the sqlite3 module releases the GIL around every statement, and each time the writer thread
    wants it back while the event loop is busy it can wait a whole switch interval. The SQL texts,
    one per size, stay few enough for the connection's statement cache
    (sqlite_thread.STATEMENT_CACHE_SIZE).
    """
    return [
        (start, min(MAX_ROWS_PER_STATEMENT, count - start))
        for start in range(0, count, MAX_ROWS_PER_STATEMENT)
    ]


def _claim(conn: sqlite3.Connection, claims: list[dedup.ClaimParams]) -> bool:
    """Claim every key of `claims`; whether each one of them changed a row (so was new)."""
    claimed = 0
    for start, size in _value_chunks(len(claims)):
        params = [value for claim in claims[start : start + size] for value in claim]
        claimed += conn.execute(dedup.claim_sql(size), params).rowcount
    return claimed == len(claims)


@dataclass
class _FileBatch:
    items: list[_Item]
    now: datetime
    stamp: str
    keys: list[str]  # distinct, in order of first appearance
    first: list[bool]  # per item: the first item of the batch with its key
    claims: dict[str, dedup.ClaimParams]  # key -> claim parameters
    inbox: list[inbox.InsertParams | None]  # per item: its inbox row's parameters, if it has one
    number: int  # tells this batch's rows in the claimed-keys table of the one-statement path


def _file_batch(items: list[_Item], now: datetime, ttl: timedelta) -> _FileBatch:
    stamp = to_sqlite_datetime(now)
    claims: dict[str, dedup.ClaimParams] = {}
    first = []
    rows: list[inbox.InsertParams | None] = []
    for item in items:
        is_first = item.key not in claims
        first.append(is_first)
        if is_first:
            claims[item.key] = dedup.claim_params(item.key, item.platform, now, ttl)
        message = item.message
        rows.append(
            None if message is None or not is_first else inbox.insert_params(message, item.pending, stamp)
        )
    return _FileBatch(items, now, stamp, list(claims), first, claims, rows, next(_batch_numbers))


_batch_numbers = itertools.count(1)
# Temporary objects of the writer thread's connection (not of the database: no migration, nothing on
# disk), for committing a batch in one statement. Inserting into the view runs the trigger once per
# key: claim it, note it when it was claimed (changes() = 1), then write its inbox row if so.
_ONE_STATEMENT_OBJECTS = (
    "CREATE TEMP TABLE IF NOT EXISTS gateway_ingest_claimed "
    "(batch INTEGER NOT NULL, message_key TEXT NOT NULL)",
    "CREATE TEMP VIEW IF NOT EXISTS gateway_ingest AS SELECT NULL AS batch, NULL AS message_key, "
    "NULL AS platform, NULL AS processed_at, NULL AS expires_at, NULL AS inbox, "
    "NULL AS inbox_platform, NULL AS session_id, NULL AS message_id, NULL AS kind, NULL AS text, "
    "NULL AS message_json, NULL AS status",
    "CREATE TEMP TRIGGER IF NOT EXISTS gateway_ingest_row INSTEAD OF INSERT ON gateway_ingest BEGIN "
    f"{dedup.TRIGGER_CLAIM}; "
    "INSERT INTO gateway_ingest_claimed SELECT NEW.batch, NEW.message_key WHERE changes() = 1; "
    f"{inbox.TRIGGER_INSERT}; "
    "END",
)
_CLAIMED_KEPT_BATCHES = 32  # the claimed-keys table is emptied of older batches this often


@functools.cache
def _one_statement_sql(count: int) -> str:
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"] * count)
    return f"INSERT INTO gateway_ingest VALUES {rows}"


def _ingest_on_file(conn: sqlite3.Connection, batch: _FileBatch) -> list[bool]:
    """On the writer thread, outside any transaction: commit `batch`, return which items were new.

    A batch of message keys only (no delivery statuses, no membership changes) of up to
    MAX_ROWS_PER_STATEMENT keys is one INSERT into a temporary view, whose trigger does the rest:
    one statement, atomic on its own, so one wait for the GIL instead of four (BEGIN, two INSERTs,
    COMMIT). When every key changed a row (the common case: nothing was a re-delivery) the
    connection's change count says so; otherwise the keys claimed are read back. If the statement
    cannot take the write lock at once (another process wrote since it began), nothing was written
    and the batch is committed the usual way, in BEGIN IMMEDIATE, which waits for the lock.
    """
    if len(batch.keys) <= MAX_ROWS_PER_STATEMENT and not any(
        item.status is not None or item.membership is not None for item in batch.items
    ):
        try:
            return _commit_in_one_statement(conn, batch)
        except sqlite3.OperationalError as exc:
            if "gateway_ingest" not in str(exc):
                return in_transaction(conn, lambda conn: _commit_on_file(conn, batch))
        for statement in _ONE_STATEMENT_OBJECTS:  # this connection's first batch
            conn.execute(statement)
        return _commit_in_one_statement(conn, batch)
    return in_transaction(conn, lambda conn: _commit_on_file(conn, batch))


def _commit_in_one_statement(conn: sqlite3.Connection, batch: _FileBatch) -> list[bool]:
    keys = batch.keys
    first_items = {item.key: index for index, item in reversed(list(enumerate(batch.items)))}
    params: list[Any] = []
    with_inbox = 0
    for key in keys:
        claim = batch.claims[key]
        row = batch.inbox[first_items[key]]
        with_inbox += 0 if row is None else 2 if row[7] == "pending" else 1
        params += (batch.number, key, claim[1], claim[2], claim[3], row is not None)
        params += (None,) * 7 if row is None else row[1:8]
    before = conn.total_changes
    conn.execute(_one_statement_sql(len(keys)), params)
    # Each key claimed changes two rows (its key, its note), three with an inbox row written, four when
    # that row is pending (its queue head, by the inbox's trigger: migration 0007).
    if conn.total_changes - before == 2 * len(keys) + with_inbox:
        claimed = set(keys)
    else:
        found = conn.execute(
            "SELECT message_key FROM gateway_ingest_claimed WHERE batch = ?", (batch.number,)
        )
        claimed = {row[0] for row in found}
    if batch.number % _CLAIMED_KEPT_BATCHES == 0:
        conn.execute("DELETE FROM gateway_ingest_claimed WHERE batch <= ?", (batch.number,))
    return [first and item.key in claimed for item, first in zip(batch.items, batch.first, strict=True)]


def _commit_on_file(conn: sqlite3.Connection, batch: _FileBatch) -> list[bool]:
    """Claim the batch's keys and write what the new ones carry; runs inside BEGIN IMMEDIATE.

    Every statement is one multi-row statement (per chunk of MAX_ROWS_PER_STATEMENT rows). First
    optimistically: all keys are claimed at once (inserted, or taken over once expired), and when
    every one of them changed a row they were all new, the common case. Otherwise (a re-delivery, a
    duplicate in the batch) the transaction starts over, still holding the write lock: the keys still
    live are read, and only the others are claimed.
    """
    keys = batch.keys
    live: set[str] = set()
    if not _claim(conn, [batch.claims[key] for key in keys]):
        conn.execute("ROLLBACK")
        conn.execute("BEGIN IMMEDIATE")
        for start, size in _value_chunks(len(keys)):
            chunk = keys[start : start + size]
            live.update(row[0] for row in conn.execute(dedup.live_keys_sql(size), (batch.stamp, *chunk)))
        # Under the write lock every key not live is claimable: never acknowledge one that was not.
        if not _claim(conn, [batch.claims[key] for key in keys if key not in live]):
            raise RuntimeError("a dedup key could not be claimed under the write lock")
    results = [first and item.key not in live for item, first in zip(batch.items, batch.first, strict=True)]
    rows = [row for row, is_new in zip(batch.inbox, results, strict=True) if is_new and row is not None]
    for start, size in _value_chunks(len(rows)):
        conn.execute(inbox.insert_sql(size), [value for row in rows[start : start + size] for value in row])
    for item, is_new in zip(batch.items, results, strict=True):
        if is_new and item.status is not None:
            outbox.apply_status_on_file(conn, item.status, batch.now)
        if is_new and item.membership is not None:
            chats.upsert_on_file(conn, item.membership)
    return results
