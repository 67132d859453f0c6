"""Claims that look where work is known to be (the conversations a process stored rows for, or just
finished a row of), and the scan of every due head that finds the rest.

A hint narrows where a claim looks, never what it may take: a hinted claim takes only due heads, in
order, exactly as a scan does. On PostgreSQL it looks at the hinted heads alone (by primary key, which
a held snapshot does not slow down); the SQLite file looks at every due head all the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.domain.outbound import ReplyTarget
from gateway.store import inbox, outbox
from gateway.store.database import Database
from gateway.store.tables import InboxRow
from gateway.worker.inbox import InboxWorker
from tests.integration.test_leases import add_replies

LEASE = timedelta(seconds=30)
TARGETS = {"telegram": ReplyTarget}


@pytest.fixture
def db(migrated_database: Database) -> Database:
    return migrated_database


def inbox_row(chat: str, number: int, due: datetime) -> dict[str, object]:
    return {
        "dedup_key": f"telegram:{chat}:{number}",
        "platform": "telegram",
        "session_id": f"telegram:{chat}",
        "message_id": str(number),
        "kind": "text",
        "text": f"{chat}/{number}",
        "message_json": {},
        "status": "pending",
        "attempts": 0,
        "next_attempt_at": due,
        "received_at": due,
    }


async def store(db: Database, rows: Sequence[dict[str, object]]) -> None:
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), list(rows))


async def test_a_hinted_claim_takes_the_hinted_conversations_heads_in_order(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row(chat, n, now) for n in range(2) for chat in ("a", "b", "c")])
    claimed = await inbox.claim(db, "w", LEASE, 10, ["telegram:a", "telegram:b"])
    texts = sorted(row.text or "" for row in claimed)
    if db.dialect == "postgresql":
        assert texts == ["a/0", "b/0"]  # only the hinted conversations, each its oldest row
    else:
        assert texts == ["a/0", "b/0", "c/0"]  # the file looks at every due head all the same
    # Their heads are leased now: hinted again, nothing more is taken until they are settled.
    assert await inbox.claim(db, "w", LEASE, 10, ["telegram:a", "telegram:b"]) == []
    assert await inbox.claim(db, "w", LEASE, 10, []) == []


async def test_a_hinted_claim_takes_nothing_that_is_not_due(db: Database) -> None:
    later = datetime.now(UTC) + timedelta(minutes=5)
    await store(db, [inbox_row("a", 0, later)])  # a retry, due in five minutes
    assert await inbox.claim(db, "w", LEASE, 10, ["telegram:a"]) == []
    assert await inbox.claim(db, "w", LEASE, 10) == []


async def test_a_hinted_claim_respects_its_limit(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row(chat, 0, now) for chat in "abcdef"])
    first = await inbox.claim(db, "w", LEASE, 2, [f"telegram:{chat}" for chat in "abcdef"])
    assert len(first) == 2
    rest = await inbox.claim(db, "w", LEASE, 10, [f"telegram:{chat}" for chat in "abcdef"])
    assert len(rest) == 4
    assert {row.id for row in first}.isdisjoint(row.id for row in rest)


async def test_the_outbox_claim_takes_hints_too(db: Database) -> None:
    await add_replies(db, 2)  # telegram:0 and telegram:1
    claimed = await outbox.claim(db, "d", LEASE, 10, TARGETS, ["telegram:1"])
    postgresql = db.dialect == "postgresql"
    assert [row.session_id for row in claimed] == (
        ["telegram:1"] if postgresql else ["telegram:0", "telegram:1"]
    )


class Echo:
    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        return Message(Role.MODEL, f"echo {history[-1].content}")


async def test_the_worker_finds_rows_nobody_told_it_of(db: Database) -> None:
    """Rows another process stored (no wake here) are found by the scan at the next poll, while the
    worker is also kept busy by hinted work: no conversation waits for a hint that never comes."""
    done: list[str] = []
    all_done = asyncio.Event()

    def committed(session_id: str) -> None:
        done.append(session_id)
        if len(done) == 3:
            all_done.set()

    worker = InboxWorker(db, Runner(Agent("A", "a", model=Echo()), SQLSessionStore(db)))
    worker.on_committed = committed
    running = asyncio.create_task(worker.run())
    try:
        now = datetime.now(UTC) - timedelta(seconds=1)
        await store(db, [inbox_row("told", 0, now)])
        worker.wake(["telegram:told"])
        await store(db, [inbox_row("untold", 0, now), inbox_row("untold", 1, now)])  # another process's
        async with asyncio.timeout(20):
            await all_done.wait()
        assert sorted(done) == ["telegram:told", "telegram:untold", "telegram:untold"]
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
