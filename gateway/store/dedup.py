"""Expiry of platform message keys: deleted in bounded batches, each its own short transaction."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.tables import ProcessedMessageRow

PURGE_BATCH_SIZE = 1000

# Claim a key: insert it, or take over one whose TTL has passed; a live key is left alone, so the
# statement changes a row (rowcount 1, or a RETURNING row) only for the caller that claimed it.
# Parameters: message_key, platform, processed_at, expires_at, now.
CLAIM_KEY_SQLITE = (
    "INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (message_key) DO UPDATE SET platform = excluded.platform, "
    "processed_at = excluded.processed_at, expires_at = excluded.expires_at "
    "WHERE chatflow_processed_messages.expires_at <= ?"
)


def claim_keys(dialect: str, rows: list[dict[str, Any]], now: datetime) -> Any:
    """The same claim as CLAIM_KEY_SQLITE, as SQLAlchemy Core for `dialect` (distinct keys only)."""
    dialect_insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = dialect_insert(ProcessedMessageRow).values(rows)
    return statement.on_conflict_do_update(
        index_elements=[ProcessedMessageRow.message_key],
        set_={
            "platform": statement.excluded.platform,
            "processed_at": statement.excluded.processed_at,
            "expires_at": statement.excluded.expires_at,
        },
        where=ProcessedMessageRow.expires_at <= now,
    )


async def purge_expired(engine: AsyncEngine, batch_size: int = PURGE_BATCH_SIZE) -> int:
    """Delete keys whose TTL has passed; return how many. Short batches keep webhooks' writes flowing."""
    now = datetime.now(UTC)
    total = 0
    while True:
        batch = (
            select(ProcessedMessageRow.message_key)
            .where(ProcessedMessageRow.expires_at <= now)
            .limit(batch_size)
            .scalar_subquery()
        )
        async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            result = await conn.execute(
                delete(ProcessedMessageRow).where(ProcessedMessageRow.message_key.in_(batch))
            )
        total += result.rowcount
        if result.rowcount < batch_size:
            return total
