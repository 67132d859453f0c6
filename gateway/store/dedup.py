"""Expiry of platform message keys: deleted in bounded batches, each its own short transaction."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.tables import ProcessedMessageRow

PURGE_BATCH_SIZE = 1000


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
