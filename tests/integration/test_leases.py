"""Leases under faults: kept while a turn or a paced send takes long, taken over after a crash, never
held by an owner id that does not fit its column; and outcomes recorded only by the lease's holder.

Two `Database`s on one URL stand for two gateway processes (on an SQLite file, two writer threads).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.domain.outbound import OutboundMessage, ReplyTarget
from gateway.platforms.spec import Limit
from gateway.store import inbox, leases, migrations, outbox
from gateway.store.database import Database
from gateway.store.tables import InboxRow, OutboxRow
from gateway.worker.claim_loop import owner_id
from gateway.worker.inbox import InboxWorker
from gateway.worker.outbound import OutboxDelivery
from gateway.worker.pacing import PacingLimits

LEASE = 3.0  # seconds: short, so a test sees several leases pass


@pytest.fixture
async def two_processes(database_url: str) -> AsyncIterator[tuple[Database, Database]]:
    first = Database.open(database_url)
    await migrations.upgrade(first)
    second = Database.open(database_url)
    yield first, second
    await second.aclose()
    await first.aclose()


async def add_replies(db: Database, chats: int) -> None:
    now = datetime.now(UTC)
    async with db.begin() as conn:
        await conn.execute(
            insert(OutboxRow),
            [
                {
                    "platform": "telegram",
                    "session_id": f"telegram:{chat}",
                    "kind": "text",
                    "text": f"reply {chat}",
                    "target_json": {"chat_id": str(chat)},
                    "status": "pending",
                    "attempts": 0,
                    "next_attempt_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for chat in range(chats)
            ],
        )


class CountingSender:
    """Accepts every message and counts them per chat: a chat that gets two was sent a duplicate."""

    def __init__(self) -> None:
        self.sends: Counter[str] = Counter()

    async def send(self, message: OutboundMessage) -> str | None:
        await asyncio.sleep(0)
        self.sends[message.target.chat_id] += 1
        return f"{message.target.chat_id}:{self.sends[message.target.chat_id]}"

    async def indicate_typing(self, target: ReplyTarget) -> None:
        return None


async def statuses(db: Database, table: Any) -> list[str]:
    async with db.connect() as conn:
        return [status for (status,) in await conn.execute(select(table.status).order_by(table.id))]


async def test_replies_waiting_for_their_pacing_slot_past_the_lease_are_sent_once(
    two_processes: tuple[Database, Database],
) -> None:
    """The finding: a slow global rate made rows wait longer than their lease after being claimed;
    another process claimed them again and both sent them (11 of 24 chats got the reply twice)."""
    first, second = two_processes
    chats = 12
    await add_replies(first, chats)

    def one_global_slot(target: ReplyTarget) -> list[Limit]:
        return [("telegram:global", LEASE / 4)]  # 12 replies take three leases to leave one process

    sender = CountingSender()
    deliveries = [
        OutboxDelivery(
            db, {"telegram": sender}, pacing=PacingLimits({"telegram": one_global_slot}), lease_seconds=LEASE
        )
        for db in (first, second)
    ]
    running = [asyncio.create_task(delivery.run()) for delivery in deliveries]
    try:
        await wait_until_async(lambda: statuses(first, OutboxRow), lambda s: s == ["sent"] * chats, 60)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    assert sender.sends == Counter({str(chat): 1 for chat in range(chats)})


class BlockingModel:
    """Answers once the test lets it; counts the turns it was asked for."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = 0

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        self.calls += 1
        self.entered.set()
        await self.release.wait()
        return Message(Role.MODEL, "done")


async def add_message(db: Database, session_id: str = "telegram:42") -> None:
    now = datetime.now(UTC)
    async with db.begin() as conn:
        await conn.execute(
            insert(InboxRow).values(
                dedup_key=f"k:{session_id}",
                platform="telegram",
                session_id=session_id,
                message_id="1",
                kind="text",
                text="hello",
                message_json={"platform": "telegram", "conversation": {"chat_id": session_id[9:]}},
                status="pending",
                attempts=0,
                next_attempt_at=now,
                received_at=now,
            )
        )


async def lease_until(db: Database) -> datetime | None:
    async with db.connect() as conn:
        value: datetime | None = (await conn.execute(select(InboxRow.lease_until))).scalar_one()
        return value


async def test_a_slow_turn_keeps_its_lease_and_nobody_else_takes_the_row(
    two_processes: tuple[Database, Database],
) -> None:
    """A model call longer than the lease: the heartbeat renews it, so no other process runs the turn
    again meanwhile (before: the lease was never renewed)."""
    first, second = two_processes
    await add_message(first)
    model = BlockingModel()
    store = SQLSessionStore(first)
    worker = InboxWorker(first, Runner(Agent("Slow", "s", model=model), store), lease_seconds=LEASE)
    other = InboxWorker(second, Runner(Agent("Other", "o", model=model), store), lease_seconds=LEASE)
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(30):
            await model.entered.wait()
        claimed_until = await lease_until(first)
        assert claimed_until is not None
        started = time.monotonic()
        # Past two whole leases, the row is still the first worker's, its lease pushed on.
        while time.monotonic() - started < 2 * LEASE:
            assert await other.claim(10) == []
            await asyncio.sleep(0.1)  # polls the other worker's claims (not a synchronization)
        renewed = await lease_until(first)
        assert renewed is not None
        assert renewed > claimed_until + timedelta(seconds=LEASE)
        model.release.set()
        await wait_until_async(lambda: statuses(first, InboxRow), lambda s: s == ["done"], 30)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await store.aclose()
    assert model.calls == 1


async def test_a_crashed_processes_row_is_taken_over_after_its_lease(
    two_processes: tuple[Database, Database],
) -> None:
    """A process that claimed a row and died (it never renews, never releases): another takes the row
    once the lease has run out, and not before."""
    first, second = two_processes
    await add_message(first)
    crashed = owner_id("in")
    claimed = await inbox.claim(first, crashed, timedelta(seconds=LEASE), 10)
    assert [row.session_id for row in claimed] == ["telegram:42"]
    claimed_at = time.monotonic()

    class Answer:
        async def respond(self, *args: Any) -> Message:
            return Message(Role.MODEL, "taken over")

    store = SQLSessionStore(second)
    survivor = InboxWorker(second, Runner(Agent("A", "a", model=Answer()), store), lease_seconds=LEASE)
    running = asyncio.create_task(survivor.run())
    try:
        await wait_until_async(lambda: statuses(second, InboxRow), lambda s: s == ["done"], 30)
        taken_after = time.monotonic() - claimed_at
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await store.aclose()
    assert taken_after >= LEASE * 0.9  # not while the crashed process's lease still ran


def test_owner_ids_fit_their_column_whatever_the_host_name() -> None:
    """The finding: `hostname:pid:hex` overflowed String(64) from ~48-character host names."""
    pod = "chatflow-gateway-7d9f8b6c5d-" + "x" * 35  # Kubernetes pod names reach 63 characters
    assert len(pod) == 63
    for role in ("in", "out"):
        owner = owner_id(role, host=pod)
        assert len(owner) <= leases.MAX_OWNER_LENGTH
        assert owner.endswith(f":{role}")
    assert owner_id("in", host=pod) != owner_id("in", host=pod)  # each start is a new owner
    with pytest.raises(ValueError, match="1 to 64 characters"):
        leases.check_owner("h" * 65)


async def test_a_pod_with_a_63_character_name_claims_and_finishes_rows(database: Database) -> None:
    """On PostgreSQL the overlong owner failed every claim (value too long for varchar(64))."""
    await migrations.upgrade(database)
    await add_message(database)
    await add_replies(database, 1)
    pod = "chatflow-gateway-7d9f8b6c5d-" + "x" * 35
    lease = timedelta(seconds=LEASE)
    claimed = await inbox.claim(database, owner_id("in", host=pod), lease, 10)
    assert len(claimed) == 1
    owner = owner_id("out", host=pod)
    replies = await outbox.claim(database, owner, lease, 10, {})
    assert len(replies) == 1
    assert await outbox.finish(database, replies[0].id, owner, status="sent")


async def test_only_the_leases_holder_records_a_delivery_outcome(database: Database) -> None:
    """The finding: `_finish` updated by id alone, so a process whose lease had expired overwrote the
    outcome recorded by the one that took the row over."""
    await migrations.upgrade(database)
    await add_replies(database, 1)
    lease = timedelta(seconds=LEASE)
    stale, current = owner_id("out"), owner_id("out")
    [row] = await outbox.claim(database, stale, timedelta(seconds=-1), 10, {})  # expired at once
    [again] = await outbox.claim(database, current, lease, 10, {})
    assert again.id == row.id
    assert not await outbox.finish(database, row.id, stale, status="failed", error_code="stale")
    assert await outbox.renew(database, [row.id], stale, lease) == set()
    assert await outbox.renew(database, [row.id], current, lease) == {row.id}
    assert await outbox.finish(database, row.id, current, status="sent", platform_message_id="m1")
    async with database.connect() as conn:
        stored = (await conn.execute(select(OutboxRow.status, OutboxRow.error_code))).one()
    assert tuple(stored) == ("sent", None)


async def wait_until_async(read: Any, done: Any, seconds: float) -> Any:
    """Poll an async read until `done(value)`; the last value, or AssertionError after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        value = await read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still {value!r} after {seconds} s")
        await asyncio.sleep(0.05)


async def test_rows_claimed_as_the_process_stops_are_handed_back_at_once(database: Database) -> None:
    """The fault run's finding: a replica SIGTERMed while its claim ran left the rows that claim leased
    (never started) to wait out their lease; the rest of its rows it handed back at once."""
    await migrations.upgrade(database)
    await add_message(database)
    store = SQLSessionStore(database)
    worker = InboxWorker(database, Runner(Agent("A", "a", model=BlockingModel()), store), lease_seconds=LEASE)
    leased, stopping = asyncio.Event(), asyncio.Event()
    claim = worker.claim

    async def claim_then_stop(limit: int, sessions: Sequence[str] | None = None) -> Any:
        rows = await claim(limit, sessions)  # committed: the rows are leased in the database
        leased.set()
        await stopping.wait()  # the process is told to stop while the claim's answer is on its way
        return rows

    worker.claim = claim_then_stop  # type: ignore[method-assign]
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(30):
            await leased.wait()
        running.cancel()
        stopping.set()
        await asyncio.gather(running, return_exceptions=True)
        async with database.connect() as conn:
            owner = (await conn.execute(select(InboxRow.lease_owner))).scalar_one()
        assert owner is None
        assert [
            row.session_id for row in await inbox.claim(database, owner_id("in"), timedelta(seconds=LEASE), 9)
        ] == ["telegram:42"]
    finally:
        await store.aclose()
