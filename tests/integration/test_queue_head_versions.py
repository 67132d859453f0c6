"""A push that changes nothing writes nothing (migration 0013).

A conversation with a message waiting gets another: its queue head already points at the older one,
and must not be rewritten. Every version written is one a held snapshot keeps for every later look-up
of that head to walk (benchmarks/soak.py). On PostgreSQL the head row's `xmin` (the transaction that
wrote its current version) says whether it was written; the SQLite file counts the rows changed.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, text, update

from gateway.store import inbox
from gateway.store.database import Database
from gateway.store.tables import InboxRow
from tests.integration.test_claim_hints import inbox_row

HEAD_VERSION = {
    "postgresql": "SELECT xmin::text FROM chatflow_queue_heads WHERE queue = 'chatflow_inbox' "
    "AND session_id = 'telegram:a'",
    "sqlite": "SELECT total_changes()",
}


@pytest.fixture
def db(migrated_database: Database) -> Database:
    return migrated_database


async def test_a_newer_message_leaves_the_head_as_it_was(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row("a", 0, now)])
    if db.dialect == "postgresql":
        async with db.begin() as conn:
            before = (await conn.execute(text(HEAD_VERSION["postgresql"]))).scalar_one()
            await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
        async with db.connect() as conn:
            after = (await conn.execute(text(HEAD_VERSION["postgresql"]))).scalar_one()
        assert after == before
    else:
        async with db.begin() as conn:  # one connection: total_changes() counts its own writes
            before = (await conn.execute(text(HEAD_VERSION["sqlite"]))).scalar_one()
            await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
            after = (await conn.execute(text(HEAD_VERSION["sqlite"]))).scalar_one()
        assert after - before == 1  # the inbox row; the head was not written
    claimed = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert [row.text for row in claimed] == ["a/0"]


async def test_an_older_row_back_in_the_queue_is_the_head_again(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row("a", 0, now)])
    (first,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    async with db.begin() as conn:
        await conn.execute(
            update(InboxRow).where(InboxRow.id == first.id).values(status="dead", lease_owner=None)
        )
        await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
        await conn.execute(update(InboxRow).where(InboxRow.id == first.id).values(status="pending"))
    claimed = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert [row.text for row in claimed] == ["a/0"]  # the requeued older row goes first
