"""Platform message keys (`chatflow_processed_messages`): every spelling of the dedup rule lives here.

The rule: a key is live until its `expires_at` (the TTL after it was claimed); claiming inserts it, or
takes over one whose TTL has passed, and leaves a live one alone. So a claim changes a row (rowcount 1,
or a RETURNING row) only for the caller that claimed it, even under concurrency. Expired keys are
deleted in bounded batches, each its own short transaction.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.messages import utcnow
from gateway.store.database import Database
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import ProcessedMessageRow

PURGE_BATCH_SIZE = 1000
DEFAULT_TTL_HOURS = 192  # 8 days: longer than WhatsApp's 7-day retry window

# A claim's parameters per key, on the file: message_key, platform, processed_at (now), expires_at.
ClaimParams = tuple[str, str, str, str]
# What a claim does with a key that is already there: take it over only once it expired.
_TAKE_OVER = (
    "ON CONFLICT (message_key) DO UPDATE SET platform = excluded.platform, "
    "processed_at = excluded.processed_at, expires_at = excluded.expires_at "
    "WHERE chatflow_processed_messages.expires_at <= excluded.processed_at"
)
# The claim of one key inside the ingest trigger (gateway/store/ingest.py), from the trigger's NEW row.
TRIGGER_CLAIM = (
    "INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
    f"VALUES (NEW.message_key, NEW.platform, NEW.processed_at, NEW.expires_at) {_TAKE_OVER}"
)


def expires_at(now: datetime, ttl: timedelta) -> datetime:
    return now + ttl


def claim_params(key: str, platform: str, now: datetime, ttl: timedelta) -> ClaimParams:
    return (key, platform, to_sqlite_datetime(now), to_sqlite_datetime(expires_at(now, ttl)))


@functools.cache
def claim_sql(count: int) -> str:
    """Claim `count` keys in one statement (parameters: ClaimParams per key)."""
    rows = ", ".join(["(?, ?, ?, ?)"] * count)
    return (
        "INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
        f"VALUES {rows} {_TAKE_OVER}"
    )


@functools.cache
def live_keys_sql(count: int) -> str:
    """Which of `count` keys are held and not expired (parameters: now, then the keys)."""
    marks = ", ".join("?" * count)
    return (
        "SELECT message_key FROM chatflow_processed_messages "
        f"WHERE expires_at > ? AND message_key IN ({marks})"
    )


def claim_keys(db: Database, rows: Sequence[dict[str, Any]]) -> Any:
    """The claim in SQLAlchemy, for distinct keys; rows of message_key, platform, processed_at, expires_at."""
    statement = db.insert(ProcessedMessageRow).values(list(rows))
    return statement.on_conflict_do_update(
        index_elements=[ProcessedMessageRow.message_key],
        set_={
            "platform": statement.excluded.platform,
            "processed_at": statement.excluded.processed_at,
            "expires_at": statement.excluded.expires_at,
        },
        where=ProcessedMessageRow.expires_at <= statement.excluded.processed_at,
    )


def claim_rows(keys: Sequence[tuple[str, str]], now: datetime, ttl: timedelta) -> list[dict[str, Any]]:
    """`claim_keys`' rows for (key, platform) pairs."""
    expires = expires_at(now, ttl)
    return [
        {"message_key": key, "platform": platform, "processed_at": now, "expires_at": expires}
        for key, platform in keys
    ]


async def mark(db: Database, key: str, platform: str, ttl: timedelta) -> bool:
    """Claim one key; True when this call inserted it or took it over."""
    now = utcnow()
    params = claim_params(key, platform, now, ttl)

    def on_file(conn: sqlite3.Connection) -> bool:
        return bool(conn.execute(claim_sql(1), params).rowcount == 1)

    async def on_engine(conn: AsyncConnection) -> bool:
        result = await conn.execute(claim_keys(db, claim_rows([(key, platform)], now, ttl)))
        return bool(result.rowcount)

    return await db.write(on_file, on_engine)


async def is_processed(db: Database, key: str) -> bool:
    """Whether the key is live."""
    now = utcnow()
    stamp = to_sqlite_datetime(now)

    def on_file(conn: sqlite3.Connection) -> bool:
        return conn.execute(live_keys_sql(1), (stamp, key)).fetchone() is not None

    async def on_engine(conn: AsyncConnection) -> bool:
        found = await conn.scalar(
            select(ProcessedMessageRow.message_key).where(
                ProcessedMessageRow.message_key == key, ProcessedMessageRow.expires_at > now
            )
        )
        return found is not None

    return await db.read(on_file, on_engine)


async def purge_expired(db: Database, batch_size: int = PURGE_BATCH_SIZE) -> int:
    """Delete keys whose TTL has passed; return how many. Short batches keep webhooks' writes flowing."""
    now = utcnow()
    total = 0
    while True:
        batch = (
            select(ProcessedMessageRow.message_key)
            .where(ProcessedMessageRow.expires_at <= now)
            .limit(batch_size)
            .scalar_subquery()
        )
        async with db.begin() as conn:
            result = await conn.execute(
                delete(ProcessedMessageRow).where(ProcessedMessageRow.message_key.in_(batch))
            )
        total += result.rowcount
        if result.rowcount < batch_size:
            return total
