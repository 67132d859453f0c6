"""A turn's commit hands its conversation on to its own worker (PostgreSQL, migration 0015), and a
sent reply the conversation's next reply to its delivery worker (0016).

Under load a conversation's next message is usually waiting when its turn ends; the commit leases it
to the same worker, with the head, instead of letting the head go for a claim to lease again: one
head version instead of two, and no claim walking them while a snapshot is held. Order and
exactly-once stay as they are: the rule that moves the head is the same, only who holds it next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import insert, select, text, update

from gateway.agents import Agent, Role, Runner, SQLSessionStore
from gateway.domain.outbound import ReplyTarget
from gateway.store import inbox, outbox
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage
from gateway.store.outbox import ClaimedReply
from gateway.store.sent_replies import Recorded, SentReplies
from gateway.store.tables import ChatRow, InboxRow, OutboxRow
from gateway.worker.inbox import InboxWorker
from gateway.worker.outbound import OutboxDelivery
from tests.integration.test_claim_hints import Echo, inbox_row, store
from tests.integration.test_delivery import RecordingSender
from tests.integration.test_leases import statuses

LEASE = timedelta(seconds=30)
TARGETS = {"telegram": ReplyTarget}
HEAD = (
    "SELECT next_id, lease_owner, xmin::text FROM chatflow_queue_heads "
    "WHERE queue = 'chatflow_inbox' AND session_id = :s"
)


@pytest.fixture
def db(migrated_database: Database) -> Database:
    if migrated_database.dialect != "postgresql":
        pytest.skip(
            reason="only PostgreSQL hands a conversation on (the SQLite file's claims meet no old versions)"
        )
    return migrated_database


async def _head(db: Database, session: str) -> tuple[int | None, str | None, str]:
    async with db.connect() as conn:
        next_id, owner, version = (await conn.execute(text(HEAD), {"s": session})).one()
    return next_id, owner, version


async def _done(db: Database, row_id: int, **lease: object) -> str:
    """Mark the row done as a turn's commit does; the id of the transaction that did it."""
    async with db.begin() as conn:
        await conn.execute(update(InboxRow).where(InboxRow.id == row_id).values(status="done", **lease))
        return str((await conn.execute(text("SELECT pg_current_xact_id()::xid::text"))).scalar_one())


async def test_a_done_row_with_its_lease_extended_leases_the_next_one_to_its_owner(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(3)])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    until = datetime.now(UTC) + LEASE + timedelta(seconds=5)
    await _done(db, first.id, lease_owner="w", lease_until=until)
    handed = await inbox.take_handed_on(db, "telegram:a", first.id, "w", until)
    assert handed is not None
    assert handed.text == "a/1"
    next_id, owner, _ = await _head(db, "telegram:a")
    assert (next_id, owner) == (handed.id, "w")
    assert await inbox.claim(db, "x", LEASE, 10) == []  # held: nobody else takes the conversation
    assert await inbox.take_handed_on(db, "telegram:a", first.id, "x", until) is None  # not handed to x


async def test_a_renewal_just_before_the_commit_does_not_undo_the_hand_on(db: Database) -> None:
    """The heartbeat may renew the row's lease after the worker chose `hand_on_until` and before its
    commit runs, so the commit's lease can end sooner than the one it replaces: the conversation is
    handed on all the same (it was let go, and a claim could take its next row while the worker
    took it too)."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(2)])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    until = datetime.now(UTC) + LEASE
    assert await inbox.renew(db, [first.id], "w", LEASE + timedelta(seconds=5)) == {first.id}
    await _done(db, first.id, lease_owner="w", lease_until=until)
    assert await inbox.claim(db, "w", LEASE, 10) == []  # held for the hand-on, not claimable
    handed = await inbox.take_handed_on(db, "telegram:a", first.id, "w", until)
    assert handed is not None
    assert handed.text == "a/1"


async def test_only_the_row_the_commit_handed_on_is_taken(db: Database) -> None:
    """A row the worker's own claim leased is running already: taking it as handed on would run it
    twice (a reply sent twice, a model called twice)."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(2)])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    await _done(db, first.id, lease_owner=None, lease_until=None)  # let go
    (second,) = await inbox.claim(db, "w", LEASE, 10)
    assert second.text == "a/1"
    until = datetime.now(UTC) + LEASE
    assert await inbox.take_handed_on(db, "telegram:a", first.id, "w", until) is None


async def test_one_head_version_for_a_hand_on_two_for_a_claim(db: Database) -> None:
    """The head's xmin names the transaction that wrote its current version."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(3)])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    until = datetime.now(UTC) + 2 * LEASE
    settle = await _done(db, first.id, lease_owner="w", lease_until=until)
    handed = await inbox.take_handed_on(db, "telegram:a", first.id, "w", until)
    assert handed is not None
    assert (await _head(db, "telegram:a"))[2] == settle  # the settle leased it; taking it wrote nothing
    # Letting go, then claiming: a version each.
    let_go = await _done(db, handed.id, lease_owner=None, lease_until=None)
    _, owner, version = await _head(db, "telegram:a")
    assert owner is None
    assert version == let_go
    (third,) = await inbox.claim(db, "w", LEASE, 10)
    assert third.text == "a/2"
    assert (await _head(db, "telegram:a"))[2] != let_go


@pytest.mark.parametrize(
    "lease",
    [
        pytest.param({}, id="an operator's UPDATE leaving the lease as it was"),
        pytest.param({"lease_owner": None, "lease_until": None}, id="the lease cleared"),
    ],
)
async def test_any_other_done_lets_the_conversation_go(db: Database, lease: dict[str, object]) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(2)])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    await _done(db, first.id, **lease)
    assert await inbox.take_handed_on(db, "telegram:a", first.id, "w", datetime.now(UTC) + LEASE) is None
    (second,) = await inbox.claim(db, "x", LEASE, 10)
    assert second.text == "a/1"


async def test_a_next_row_not_due_yet_is_not_handed_on(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", 0, now), inbox_row("a", 1, now + timedelta(minutes=5))])
    (first,) = await inbox.claim(db, "w", LEASE, 10)
    until = datetime.now(UTC) + 2 * LEASE
    await _done(db, first.id, lease_owner="w", lease_until=until)
    assert await inbox.take_handed_on(db, "telegram:a", first.id, "w", until) is None
    next_id, owner, _ = await _head(db, "telegram:a")
    assert owner is None  # due in five minutes, for whoever claims it then
    assert next_id is not None


async def test_the_worker_runs_a_conversations_backlog_with_one_claim(db: Database) -> None:
    """Five waiting messages of one chat: the worker claims the first, and each commit hands it the
    next; every message is answered once, in order."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(5)])
    worker = InboxWorker(db, Runner(Agent("A", "a", model=Echo()), SQLSessionStore(db)))
    claimed: list[int] = []
    claim = worker.claim

    async def counting(limit: int, sessions: Sequence[str] | None = None) -> list[ClaimedMessage]:
        rows = await claim(limit, sessions)
        claimed.extend(row.id for row in rows)
        return rows

    worker.claim = counting  # type: ignore[method-assign]
    committed: list[str] = []
    all_done = asyncio.Event()

    def on_committed(session_id: str) -> None:
        committed.append(session_id)
        if len(committed) == 5:
            all_done.set()

    worker.on_committed = on_committed
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(20):
            await all_done.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    async with db.connect() as conn:
        rows = (await conn.execute(select(InboxRow.id, InboxRow.status).order_by(InboxRow.id))).all()
    session = await SQLSessionStore(db).get("telegram:a")
    assert session is not None
    assert [status for _, status in rows] == ["done"] * 5
    assert claimed == [rows[0][0]]  # the other four were handed on
    assert [m.content for m in session.history if m.role is Role.USER] == [f"a/{n}" for n in range(5)]


async def test_shutting_down_hands_the_conversation_back(db: Database) -> None:
    """A worker stopped while its next row was handed on leaves nothing leased behind."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    await store(db, [inbox_row("a", n, now) for n in range(3)])
    started = asyncio.Event()
    release = asyncio.Event()

    class Slow(Echo):
        async def respond(self, agent, history, tools):  # type: ignore[no-untyped-def]
            if len([m for m in history if m.role is Role.USER]) == 2:  # the handed-on row's turn
                started.set()
                await release.wait()
            return await super().respond(agent, history, tools)

    worker = InboxWorker(db, Runner(Agent("A", "a", model=Slow()), SQLSessionStore(db)))
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(20):
            await started.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    async with db.connect() as conn:
        leased = (
            await conn.execute(
                select(InboxRow.id).where(InboxRow.status == "pending", InboxRow.lease_owner.is_not(None))
            )
        ).all()
    assert leased == []
    claimed = await inbox.claim(db, "x", LEASE, 10)
    assert [row.text for row in claimed] == ["a/1"]


# --- the outbox (migration 0016): a sent reply hands the conversation's next one on ----------------
async def _replies(db: Database, texts: Sequence[str], chat: str = "a") -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(
            insert(OutboxRow),
            [
                {
                    "platform": "telegram",
                    "session_id": f"telegram:{chat}",
                    "kind": "text",
                    "text": body,
                    "target_json": {"chat_id": chat},
                    "status": "pending",
                    "attempts": 0,
                    "next_attempt_at": now,
                    "created_at": now,
                    "updated_at": now,
                }
                for body in texts
            ],
        )


async def test_a_sent_reply_hands_the_next_one_on_when_asked(db: Database) -> None:
    await _replies(db, ["one", "two"])
    (first,) = await outbox.claim(db, "d", LEASE, 10, TARGETS)
    until = datetime.now(UTC) + 2 * LEASE
    assert await SentReplies(db).record(first.id, "d", "sent", "m1", until) is Recorded.HANDED_ON
    handed = await outbox.take_handed_on(db, "telegram:a", first.id, "d", until, TARGETS)
    assert handed is not None
    assert handed.message is not None
    assert handed.message.text == "two"
    assert handed.reachable
    assert await outbox.claim(db, "e", LEASE, 10, TARGETS) == []  # held by d
    # The last one has nothing behind it: written, and the head let go.
    assert await SentReplies(db).record(handed.id, "d", "sent", "m2", until) is Recorded.WRITTEN
    async with db.connect() as conn:
        head = (
            await conn.execute(
                text(
                    "SELECT next_id, lease_owner FROM chatflow_queue_heads "
                    "WHERE queue = 'chatflow_outbox' AND session_id = 'telegram:a'"
                )
            )
        ).one()
    assert tuple(head) == (None, None)


async def test_a_renewal_just_before_the_record_does_not_undo_the_hand_on(db: Database) -> None:
    """As for turns: a heartbeat between choosing `hand_on_until` and the record let the conversation
    go while the recorder was told HANDED_ON; its own claim could then lease the next reply and the
    hand-on take the same reply again: sent twice (the scale-out crash test's extra duplicates)."""
    await _replies(db, ["one", "two"])
    (first,) = await outbox.claim(db, "d", LEASE, 10, TARGETS)
    until = datetime.now(UTC) + LEASE
    assert await outbox.renew(db, [first.id], "d", LEASE + timedelta(seconds=5)) == {first.id}
    assert await SentReplies(db).record(first.id, "d", "sent", "m1", until) is Recorded.HANDED_ON
    assert await outbox.claim(db, "d", LEASE, 10, TARGETS) == []  # held for the hand-on
    handed = await outbox.take_handed_on(db, "telegram:a", first.id, "d", until, TARGETS)
    assert handed is not None
    assert handed.message is not None
    assert handed.message.text == "two"


async def test_a_reply_the_delivery_claimed_itself_is_not_taken_as_handed_on(db: Database) -> None:
    await _replies(db, ["one", "two"])
    (first,) = await outbox.claim(db, "d", LEASE, 10, TARGETS)
    assert await SentReplies(db).record(first.id, "d", "sent", "m1") is Recorded.WRITTEN
    assert len(await outbox.claim(db, "d", LEASE, 10, TARGETS)) == 1  # the next reply, sending
    until = datetime.now(UTC) + LEASE
    assert await outbox.take_handed_on(db, "telegram:a", first.id, "d", until, TARGETS) is None


async def test_a_sent_reply_lets_go_unless_asked(db: Database) -> None:
    await _replies(db, ["one", "two"])
    (first,) = await outbox.claim(db, "d", LEASE, 10, TARGETS)
    assert await SentReplies(db).record(first.id, "d", "sent", "m1") is Recorded.WRITTEN
    until = datetime.now(UTC) + LEASE
    assert await outbox.take_handed_on(db, "telegram:a", first.id, "d", until, TARGETS) is None
    (second,) = await outbox.claim(db, "e", LEASE, 10, TARGETS)
    assert second.message is not None
    assert second.message.text == "two"


async def test_delivery_sends_a_conversations_queue_with_one_claim(db: Database) -> None:
    texts = [f"reply {n}" for n in range(5)]
    await _replies(db, texts)
    sender = RecordingSender(expected=5)
    delivery = OutboxDelivery(db, {"telegram": sender})
    claimed: list[int] = []
    claim = delivery.claim

    async def counting(limit: int, sessions: Sequence[str] | None = None) -> list[ClaimedReply]:
        rows = await claim(limit, sessions)
        claimed.extend(row.id for row in rows)
        return rows

    delivery.claim = counting  # type: ignore[method-assign]
    running = asyncio.create_task(delivery.run())
    try:
        async with asyncio.timeout(20):
            await sender.all_sent.wait()
    finally:
        running.cancel()  # the accepted sends are recorded before it returns
        await asyncio.gather(running, return_exceptions=True)
    assert await statuses(db, OutboxRow) == ["sent"] * 5
    assert sender.sent == {"a": texts}
    assert len(claimed) == 1  # the other four were handed on
    async with db.connect() as conn:
        ids = [m for (m,) in await conn.execute(select(OutboxRow.platform_message_id).order_by(OutboxRow.id))]
    assert ids == [f"a:{n}" for n in range(1, 6)]  # sent in order


async def test_a_reply_handed_on_to_a_chat_that_removed_the_bot_says_so(db: Database) -> None:
    await _replies(db, ["one", "two"])
    (first,) = await outbox.claim(db, "d", LEASE, 10, TARGETS)
    async with db.begin() as conn:  # the bot was removed meanwhile (a membership webhook)
        await conn.execute(
            insert(ChatRow).values(platform="telegram", chat_id="a", reachable=False, membership="kicked")
        )
    until = datetime.now(UTC) + 2 * LEASE
    assert await SentReplies(db).record(first.id, "d", "sent", "m1", until) is Recorded.HANDED_ON
    handed = await outbox.take_handed_on(db, "telegram:a", first.id, "d", until, TARGETS)
    assert handed is not None
    assert not handed.reachable  # delivery marks it failed instead of sending it
