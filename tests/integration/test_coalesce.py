"""Coalescing (GATEWAY_COALESCE_MS) on SQLite and PostgreSQL: a burst of one conversation's messages is
one turn and one reply, every inbox row ends done once, and order and exactly-once hold with two
workers, a lost lease and a worker that stalled past its lease."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.bootstrap import build_services
from gateway.store import migrations
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage
from gateway.store.tables import InboxRow, OutboxRow, QueueHeadRow, TurnUsageRow
from gateway.worker.coalesce import Coalescer
from gateway.worker.inbox import InboxWorker
from tests.helpers import gateway_settings
from tests.integration.test_inbox_worker import table

WINDOW_MS = 1000
_numbers = itertools.count()


class Model:
    """Answers each turn with the user messages it was given since the last reply, and keeps them.
    While `gate` is set, a call waits for it to open (and says so with `waiting`)."""

    def __init__(self) -> None:
        self.turns: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        since = list(itertools.takewhile(lambda m: m.role is Role.USER, reversed(history)))
        texts = [m.content or "" for m in reversed(since)]
        self.turns.append(texts)
        if self.gate is not None:
            gate, self.gate = self.gate, None
            self.waiting.set()
            await gate.wait()
        return Message(Role.MODEL, "re:" + "+".join(texts))


class Clock:
    """The coalescer's wall clock, moved on by its waits; `on_wait` runs after each (a message that
    arrives meanwhile)."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.waits: list[float] = []
        self.on_wait: Callable[[], Awaitable[None]] | None = None

    def clock(self) -> datetime:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(round(seconds, 3))
        self.now += timedelta(seconds=seconds)
        if self.on_wait is not None:
            await self.on_wait()


@pytest.fixture
async def setup(database: Database) -> AsyncIterator[tuple[Database, Runner, Model]]:
    await migrations.upgrade(database)
    model = Model()
    store = SQLSessionStore(database)
    yield database, Runner(Agent("Echo", "e", model=model), store), model
    await store.aclose()


async def arrive(db: Database, session: str, texts_at: list[tuple[str, datetime]]) -> None:
    """Messages of one conversation, received at the given times (and due at once)."""
    due = datetime.now(UTC)
    async with db.begin() as conn:
        for text, at in texts_at:
            number = next(_numbers)
            await conn.execute(
                insert(InboxRow).values(
                    dedup_key="k:" + hashlib.sha256(f"{session}/{text}/{number}".encode()).hexdigest(),
                    platform="telegram",
                    session_id=session,
                    message_id=f"m{number}",
                    kind="text",
                    text=text,
                    message_json={
                        "platform": "telegram",
                        "conversation": {"platform": "telegram", "chat_id": session.split(":")[1]},
                        "user_id": "7",
                        "message_id": f"m{number}",
                    },
                    status="pending",
                    attempts=0,
                    next_attempt_at=due,
                    received_at=at,
                )
            )


def coalescing(
    db: Database, runner: Runner, clock: Clock, *, owner: str = "w", **options: Any
) -> InboxWorker:
    coalescer = Coalescer(WINDOW_MS, clock=clock.clock, sleep=clock.sleep, **options)
    return InboxWorker(db, runner, owner=owner, coalescer=coalescer)


async def history(runner: Runner, session: str) -> list[str]:
    stored = await runner.session_store.get(session)
    assert stored is not None
    return [m.content or "" for m in stored.history]


def seconds(base: datetime, offset: float) -> datetime:
    return base + timedelta(seconds=offset)


async def test_a_burst_within_the_window_is_one_turn_with_one_reply(
    setup: tuple[Database, Runner, Model],
) -> None:
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("hi", base), ("order 1001", seconds(base, 0.3))])
    await arrive(db, "telegram:2", [("other chat", seconds(base, 0.4))])
    await arrive(db, "telegram:1", [("where is it?", seconds(base, 0.6))])
    clock = Clock(seconds(base, 0.6))  # just after the last message arrived

    assert await coalescing(db, runner, clock).run_until_idle() == 2  # two conversations, two turns

    # The turns waited until a window had passed since each conversation's newest message.
    assert clock.now == seconds(base, 1.6)
    assert sum(clock.waits) == pytest.approx(1.0)
    assert sorted(model.turns) == [["hi", "order 1001", "where is it?"], ["other chat"]]
    assert await history(runner, "telegram:1") == [
        "hi",
        "order 1001",
        "where is it?",
        "re:hi+order 1001+where is it?",
    ]
    rows = await table(db, select(InboxRow.text, InboxRow.status, InboxRow.lease_owner).order_by(InboxRow.id))
    assert rows == [
        ("hi", "done", None),
        ("order 1001", "done", None),
        ("other chat", "done", None),
        ("where is it?", "done", None),
    ]
    replies = await table(
        db,
        select(OutboxRow.inbox_id, OutboxRow.text, OutboxRow.target_json).where(
            OutboxRow.session_id == "telegram:1"
        ),
    )
    newest = (await table(db, select(InboxRow.id).where(InboxRow.text == "where is it?")))[0][0]
    assert [(inbox_id, text) for inbox_id, text, _ in replies] == [(newest, "re:hi+order 1001+where is it?")]
    assert replies[0][2]["reply_to"] != "m0"  # it answers the newest message
    usage = await table(db, select(TurnUsageRow.inbox_id).where(TurnUsageRow.session_id == "telegram:1"))
    assert usage == [(newest,)]


async def test_messages_further_apart_than_the_window_are_separate_turns(
    setup: tuple[Database, Runner, Model],
) -> None:
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("first", base), ("second", seconds(base, 2.5))])
    clock = Clock(seconds(base, 3))

    assert await coalescing(db, runner, clock).run_until_idle() == 2

    assert model.turns == [["first"], ["second"]]
    assert clock.waits == [0.5]  # "first" had nothing to wait for; "second" its own window (to 3.5 s)
    assert await history(runner, "telegram:1") == ["first", "re:first", "second", "re:second"]
    assert await table(db, select(InboxRow.status)) == [("done",), ("done",)]


async def test_a_backlog_that_chains_within_the_window_is_taken_at_once(
    setup: tuple[Database, Runner, Model],
) -> None:
    """Each message within a window of the one before: one run, though it spans 1.5 windows."""
    db, runner, model = setup
    base = datetime.now(UTC) - timedelta(minutes=1)
    await arrive(db, "telegram:1", [(f"m{i}", seconds(base, 0.5 * i)) for i in range(4)])
    clock = Clock(datetime.now(UTC))

    assert await coalescing(db, runner, clock).run_until_idle() == 1

    assert model.turns == [["m0", "m1", "m2", "m3"]]
    assert clock.waits == []


async def test_coalescing_off_answers_every_message_on_its_own(setup: tuple[Database, Runner, Model]) -> None:
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("a", base), ("b", seconds(base, 0.1)), ("c", seconds(base, 0.2))])

    assert await InboxWorker(db, runner).run_until_idle() == 3

    assert model.turns == [["a"], ["b"], ["c"]]
    assert len(await table(db, select(OutboxRow.id))) == 3


async def test_messages_that_arrive_while_the_worker_waits_join_the_run(
    setup: tuple[Database, Runner, Model],
) -> None:
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("hi", base)])
    clock = Clock(base)
    arrivals = iter([("my order", 0.8)])

    async def one_more() -> None:  # during the first wait, a message arrives 0.8 s after the first
        for text, offset in arrivals:
            await arrive(db, "telegram:1", [(text, seconds(base, offset))])
            return

    clock.on_wait = one_more

    assert await coalescing(db, runner, clock).run_until_idle() == 1

    assert clock.waits == [1.0, 0.8]  # a window after "hi", then a window after "my order"
    assert model.turns == [["hi", "my order"]]
    assert await table(db, select(InboxRow.status)) == [("done",), ("done",)]


async def test_a_chatty_user_is_answered_within_ten_windows(setup: tuple[Database, Runner, Model]) -> None:
    """A message every 0.9 s, each within the window of the one before: the first turn starts ten
    windows after the first message; the rest wait for the next turn, in order, each answered once."""
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("m0", base)])
    clock = Clock(base)
    sent = 1

    async def keep_talking() -> None:
        nonlocal sent
        while sent < 16 and seconds(base, 0.9 * sent) <= clock.now:
            await arrive(db, "telegram:1", [(f"m{sent}", seconds(base, 0.9 * sent))])
            sent += 1

    clock.on_wait = keep_talking
    worker = coalescing(db, runner, clock)

    assert await worker.run_until_idle() == 1
    assert clock.now == seconds(base, 10)  # ten windows after m0, though m11 came at 9.9 s
    assert model.turns == [[f"m{i}" for i in range(12)]]

    clock.now = seconds(base, 15)  # the user went on meanwhile: the next turn answers the rest
    await keep_talking()
    assert await worker.run_until_idle() == 1
    assert model.turns[1] == [f"m{i}" for i in range(12, 16)]
    replies = [text for (text,) in await table(db, select(OutboxRow.text).order_by(OutboxRow.id))]
    assert replies == ["re:" + "+".join(turn) for turn in model.turns]
    user = [text for text in await history(runner, "telegram:1") if not text.startswith("re:")]
    assert user == [f"m{i}" for i in range(16)]
    assert {status for (status,) in await table(db, select(InboxRow.status))} == {"done"}


async def test_a_run_takes_at_most_its_row_cap(setup: tuple[Database, Runner, Model]) -> None:
    db, runner, model = setup
    base = datetime.now(UTC) - timedelta(minutes=1)
    await arrive(db, "telegram:1", [(f"m{i}", seconds(base, 0.1 * i)) for i in range(7)])

    assert await coalescing(db, runner, Clock(datetime.now(UTC)), max_rows=3).run_until_idle() == 3

    assert model.turns == [["m0", "m1", "m2"], ["m3", "m4", "m5"], ["m6"]]


async def test_two_workers_keep_order_and_answer_every_message_once(
    setup: tuple[Database, Runner, Model],
) -> None:
    db, runner, model = setup
    base = datetime.now(UTC) - timedelta(minutes=1)
    for s in range(4):  # bursts of three, five seconds apart
        await arrive(
            db, f"telegram:{s}", [(f"{s}/{i}", seconds(base, 5 * (i // 3) + 0.2 * i)) for i in range(9)]
        )
    clock = Clock(datetime.now(UTC))
    workers = [coalescing(db, runner, clock, owner=f"w{n}") for n in range(2)]

    turns = await asyncio.gather(*(worker.run_until_idle() for worker in workers))

    assert sum(turns) == 12
    for s in range(4):
        user = [text for text in await history(runner, f"telegram:{s}") if not text.startswith("re:")]
        assert user == [f"{s}/{i}" for i in range(9)]
        own = [turn for turn in model.turns if turn[0].startswith(f"{s}/")]
        assert own == [[f"{s}/{i}" for i in range(b, b + 3)] for b in (0, 3, 6)]
    assert {status for (status,) in await table(db, select(InboxRow.status))} == {"done"}
    assert len(await table(db, select(OutboxRow.id))) == 12


async def test_a_worker_that_stalled_past_its_lease_commits_nothing_and_the_run_is_answered_once(
    setup: tuple[Database, Runner, Model],
) -> None:
    """Worker A took a run of three, then stalled in its model call past its lease (a crash, for the
    others). Worker B, another process's store, takes the conversation and the rows A had leased,
    and answers them in one turn; when A wakes up, its commit finds the rows gone and writes nothing."""
    db, runner, model = setup
    base = datetime.now(UTC) - timedelta(minutes=1)
    await arrive(db, "telegram:1", [("a", base), ("b", seconds(base, 0.2)), ("c", seconds(base, 0.4))])
    clock = Clock(datetime.now(UTC))
    stalled = InboxWorker(
        db,
        runner,
        owner="stalled",
        lease_seconds=-1,  # its leases have expired by the time anyone looks
        coalescer=Coalescer(WINDOW_MS, clock=clock.clock, sleep=clock.sleep),
    )
    gate = model.gate = asyncio.Event()
    (head,) = await stalled.claim(10)
    running = asyncio.create_task(stalled.process(head))
    async with asyncio.timeout(30):
        await model.waiting.wait()
    leased = await table(db, select(InboxRow.lease_owner).order_by(InboxRow.id))
    assert leased == [("stalled",)] * 3  # the whole run was A's

    other_store = SQLSessionStore(db)  # another process: its own session lock and cache
    try:
        other = InboxWorker(
            db,
            Runner(Agent("Echo", "e", model=model), other_store),
            owner="other",
            coalescer=Coalescer(WINDOW_MS, clock=clock.clock, sleep=clock.sleep),
        )
        assert await other.run_until_idle() == 1
    finally:
        await other_store.aclose()
    assert model.turns == [["a", "b", "c"], ["a", "b", "c"]]  # A's call, still open, and B's

    gate.set()  # A wakes up: its commit finds the rows done by B
    async with asyncio.timeout(30):
        await running

    assert await table(db, select(InboxRow.status, InboxRow.lease_owner)) == [("done", None)] * 3
    assert [text for (text,) in await table(db, select(OutboxRow.text))] == ["re:a+b+c"]
    fresh = SQLSessionStore(db)
    try:
        stored = await fresh.get("telegram:1")
    finally:
        await fresh.aclose()
    assert stored is not None
    assert [m.content for m in stored.history] == ["a", "b", "c", "re:a+b+c"]
    assert len(await table(db, select(TurnUsageRow.id))) == 1


async def test_a_commit_keeps_nothing_when_one_row_of_its_run_was_taken(
    setup: tuple[Database, Runner, Model],
) -> None:
    db, runner, model = setup
    base = datetime.now(UTC) - timedelta(minutes=1)
    await arrive(db, "telegram:1", [("a", base), ("b", seconds(base, 0.2)), ("c", seconds(base, 0.4))])
    worker = coalescing(db, runner, Clock(datetime.now(UTC)))
    gate = model.gate = asyncio.Event()
    (head,) = await worker.claim(10)
    running = asyncio.create_task(worker.process(head))
    async with asyncio.timeout(30):
        await model.waiting.wait()
    async with db.begin() as conn:  # the middle row is someone else's now
        await conn.execute(update(InboxRow).where(InboxRow.text == "b").values(lease_owner="thief"))

    gate.set()
    async with asyncio.timeout(30):
        await running

    statuses = await table(db, select(InboxRow.text, InboxRow.status).order_by(InboxRow.id))
    assert statuses == [("a", "pending"), ("b", "pending"), ("c", "pending")]
    assert await table(db, select(OutboxRow.id)) == []
    assert await table(db, select(TurnUsageRow.id)) == []
    assert await runner.session_store.get("telegram:1") is None


async def test_the_heartbeat_renews_every_row_of_a_run_and_a_lost_one_stops_it(
    setup: tuple[Database, Runner, Model],
) -> None:
    """While the worker waits for the burst to end, the claim loop's heartbeat renews the lease of the
    row it took besides the claimed one (past two leases here). When the claimed row is lost (taken
    by another worker), the waiting task is cancelled and hands back the row it took; no turn runs."""
    db, runner, model = setup
    base = datetime.now(UTC)
    await arrive(db, "telegram:1", [("a", base), ("b", seconds(base, 0.3))])
    follower = (await table(db, select(InboxRow.id).where(InboxRow.text == "b")))[0][0]
    renewed_twice = asyncio.Event()
    cancelled = asyncio.Event()
    renewals = 0

    async def wait_for_good(seconds: float) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = InboxWorker(
        db,
        runner,
        owner="w",
        lease_seconds=0.6,  # a heartbeat every 0.2 s
        coalescer=Coalescer(WINDOW_MS, clock=lambda: seconds(base, 0.3), sleep=wait_for_good),
    )
    renew = worker.loop.renew

    async def counted(ids: list[int]) -> set[int]:
        nonlocal renewals
        held = await renew(ids)
        if follower in held:
            renewals += 1
            if renewals == 6:  # two leases
                renewed_twice.set()
        return held

    worker.loop.renew = counted
    processed = asyncio.Event()
    process = worker.process

    async def watched(row: ClaimedMessage) -> None:
        try:
            await process(row)
        finally:
            processed.set()

    worker.process = watched  # type: ignore[method-assign]
    running = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(30):
            await renewed_twice.wait()
        (lease_until,) = (await table(db, select(InboxRow.lease_until).where(InboxRow.id == follower)))[0]
        assert lease_until > datetime.now(UTC)
        async with db.begin() as conn:  # another worker took the conversation and its claimed row
            later = datetime.now(UTC) + timedelta(minutes=5)
            await conn.execute(update(InboxRow).where(InboxRow.text == "a").values(lease_owner="thief"))
            await conn.execute(update(QueueHeadRow).values(lease_owner="thief", due_at=later))
        async with asyncio.timeout(30):
            await cancelled.wait()
            await processed.wait()  # the cancelled task has handed its other row back
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    assert model.turns == []
    owners = await table(
        db, select(InboxRow.text, InboxRow.status, InboxRow.lease_owner).order_by(InboxRow.id)
    )
    assert owners == [("a", "pending", "thief"), ("b", "pending", None)]


async def test_the_setting_turns_coalescing_on_and_off(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    off = build_services(gateway_settings(database_url=url))
    on = build_services(gateway_settings(database_url=url, coalesce_ms=1500))
    try:
        assert off.worker.coalescer is None
        assert on.worker.coalescer is not None
        assert on.worker.coalescer.window == timedelta(milliseconds=1500)
        assert on.worker.coalescer.max_wait == timedelta(seconds=15)
    finally:
        await off.aclose()
        await on.aclose()
