"""Accepted replies are recorded in batches: each row only while its owner holds it."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from sqlalchemy import insert, select

from gateway.store import migrations
from gateway.store.database import Database
from gateway.store.sent_replies import Recorded, SentReplies
from gateway.store.tables import OutboxRow


async def add_leased(db: Database, owners: list[str]) -> list[int]:
    now = datetime.now(UTC)
    async with db.begin() as conn:
        ids = await conn.execute(
            insert(OutboxRow).returning(OutboxRow.id),
            [
                {
                    "inbox_id": None,
                    "platform": "telegram",
                    "session_id": f"telegram:{n}",
                    "kind": "text",
                    "text": "hi",
                    "target_json": {"chat_id": str(n)},
                    "status": "pending",
                    "attempts": 0,
                    "next_attempt_at": now,
                    "lease_owner": owner,
                    "lease_until": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for n, owner in enumerate(owners)
            ],
        )
        return sorted(ids.scalars())


async def test_replies_recorded_together_each_written_only_while_its_owner_holds_it(
    database: Database,
) -> None:
    await migrations.upgrade(database)
    owners = ["me"] * 30 + ["other"] * 5 + ["me"] * 5
    ids = await add_leased(database, owners)
    recorder = SentReplies(database)
    results: list[int] = await asyncio.gather(
        *(
            recorder.record(row_id, "me", "sent" if n % 2 else "dry_run", f"m{n}" if n % 2 else None)
            for n, row_id in enumerate(ids)
        )
    )
    assert results == [owner == "me" for owner in owners]
    async with database.connect() as conn:
        rows = (
            await conn.execute(
                select(OutboxRow.status, OutboxRow.platform_message_id, OutboxRow.lease_owner).order_by(
                    OutboxRow.id
                )
            )
        ).all()
    for n, (owner, row) in enumerate(zip(owners, rows, strict=True)):
        if owner == "me":
            assert tuple(row) == (("sent", f"m{n}", None) if n % 2 else ("dry_run", None, None))
        else:
            assert tuple(row) == ("pending", None, "other")
    assert await recorder.record(ids[0], "me", "sent", "again") is Recorded.NOT_OURS  # settled rows stay
