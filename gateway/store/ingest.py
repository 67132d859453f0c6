"""Durable acknowledgements with group commit: dedup keys and inbox rows, many requests per transaction.

A webhook may answer 200 only once its messages are stored, and one SQLite transaction per request
caps ingest near a thousand requests per second. So webhooks hand their items to one writer task,
which takes everything queued while the previous commit ran, writes it in one transaction, and then
answers every waiting request. If the commit fails, they all get the error (and the platform retries).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store import dedup
from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.sqlite_thread import SQLiteThread, to_sqlite_datetime
from gateway.store.tables import ChatRow, InboxRow, OutboxRow, ProcessedMessageRow

log = structlog.get_logger(__name__)
MAX_BATCH_ITEMS = 2000


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


@dataclass
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

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ingest-writer")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def write(self, items: list[IngestItem]) -> list[bool]:
        if not items:
            return []
        if self._task is None or self._task.done():
            raise RuntimeError("the ingest writer is not running")
        done: asyncio.Future[list[bool]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(items, done))
        return await done

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            count = len(batch[0].items)
            while count < MAX_BATCH_ITEMS and not self._queue.empty():
                request = self._queue.get_nowait()
                batch.append(request)
                count += len(request.items)
            try:
                results = await self._commit([item for request in batch for item in request.items])
            except Exception as exc:
                log.error(
                    "ingest_commit_failed", items=count, error=type(exc).__name__, detail=str(exc)[:300]
                )
                for request in batch:
                    if not request.done.done():
                        request.done.set_exception(exc)
            else:
                offset = 0
                for request in batch:
                    size = len(request.items)
                    if not request.done.done():
                        request.done.set_result(results[offset : offset + size])
                    offset += size
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, items: list[IngestItem]) -> list[bool]:
        now = datetime.now(UTC)
        if self._sqlite is not None:
            return await self._sqlite.write(lambda conn: _commit_sqlite(conn, items, now, self._ttl_seconds))
        return await self._commit_engine(items, now)

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


_INSERT_INBOX = (
    "INSERT OR IGNORE INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
    "message_json, status, attempts, next_attempt_at, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)"
)


def _commit_sqlite(
    conn: sqlite3.Connection, items: list[IngestItem], now: datetime, ttl: float
) -> list[bool]:
    stamp = to_sqlite_datetime(now)
    expires = to_sqlite_datetime(now + timedelta(seconds=ttl))
    results = []
    inbox = []
    for item in items:
        claim = (item.dedup_key, item.platform, stamp, expires, stamp)
        is_new = conn.execute(dedup.CLAIM_KEY_SQLITE, claim).rowcount == 1
        results.append(is_new)
        entry = item.inbox
        if is_new and entry is not None:
            inbox.append(
                (
                    item.dedup_key,
                    entry.platform,
                    entry.session_id,
                    entry.message_id,
                    entry.kind,
                    entry.text,
                    json.dumps(entry.message),
                    entry.status,
                    stamp,
                    stamp,
                )
            )
    conn.executemany(_INSERT_INBOX, inbox)
    for item, is_new in zip(items, results, strict=True):
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
