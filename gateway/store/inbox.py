"""Reading and requeueing inbox rows, for operators (`gateway inbox …`, later the admin API)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.tables import InboxRow, OutboxRow

STATUSES = ("pending", "recorded", "done", "dead")
MAX_ID = 2**63 - 1  # ids are BIGINT on PostgreSQL


@dataclass(frozen=True)
class InboxItem:
    id: int
    platform: str
    session_id: str
    kind: str
    status: str
    attempts: int
    text: str | None
    last_error: str | None
    received_at: datetime


_ITEM_COLUMNS = (
    InboxRow.id,
    InboxRow.platform,
    InboxRow.session_id,
    InboxRow.kind,
    InboxRow.status,
    InboxRow.attempts,
    InboxRow.text,
    InboxRow.last_error,
    InboxRow.received_at,
)


async def list_items(engine: AsyncEngine, status: str | None = None, limit: int = 50) -> list[InboxItem]:
    """Newest first, optionally of one status."""
    query = select(*_ITEM_COLUMNS).order_by(InboxRow.id.desc())
    if status is not None:
        query = query.where(InboxRow.status == status)
    async with engine.connect() as conn:
        return [InboxItem(*row) for row in await conn.execute(query.limit(limit))]


async def get_item(engine: AsyncEngine, inbox_id: int) -> InboxItem | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(*_ITEM_COLUMNS).where(InboxRow.id == inbox_id))).one_or_none()
    return None if row is None else InboxItem(*row)


async def retry(engine: AsyncEngine, inbox_id: int) -> bool:
    """Put a dead row back in the queue with fresh attempts; False if there is no dead row with that id."""
    return await requeue(engine, inbox_id) is not None


async def requeue(engine: AsyncEngine, inbox_id: int) -> InboxItem | None:
    """Like `retry`, answering the row as the requeue left it (None if there is no dead row with that id)."""
    statement = (
        update(InboxRow)
        .where(InboxRow.id == inbox_id, InboxRow.status == "dead")
        .values(
            status="pending",
            attempts=0,
            next_attempt_at=datetime.now(UTC),
            lease_owner=None,
            lease_until=None,
        )
        .returning(*_ITEM_COLUMNS)
    )
    async with engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
        row = (await conn.execute(statement)).one_or_none()
    return None if row is None else InboxItem(*row)


@dataclass(frozen=True)
class Outcome:
    """Where a message stands: its inbox row's status, and the replies its turn put in the outbox."""

    status: str
    last_error: str | None
    replies: list[str]


async def outcome(engine: AsyncEngine, dedup_key: str) -> Outcome | None:
    """None while no inbox row has that key; the replies are there once the status is `done`."""
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(InboxRow.id, InboxRow.status, InboxRow.last_error).where(
                    InboxRow.dedup_key == dedup_key
                )
            )
        ).first()
        if row is None:
            return None
        texts = await conn.execute(
            select(OutboxRow.text)
            .where(OutboxRow.inbox_id == row.id, OutboxRow.kind == "text")
            .order_by(OutboxRow.id)
        )
        return Outcome(row.status, row.last_error, [text or "" for (text,) in texts])
