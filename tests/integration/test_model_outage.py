"""Outage patience: transient model failures are waited out in order, the user hears once (also after
a takeover by another worker), permanent ones dead-letter at once, and a waiting turn keeps (or,
shutting down, gives back) its lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import TypedDict, Unpack

import pytest
from sqlalchemy import select

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ModelError, ToolSpec
from gateway.agents.models.budget import Grant, ProviderBudget
from gateway.agents.models.openai_compat import OpenAIChatModel
from gateway.domain.outbound import OutboundKind, OutboundMessage, TelegramTarget
from gateway.store import inbox, migrations, outages
from gateway.store.database import Database
from gateway.store.tables import InboxRow, OutboxRow
from gateway.worker.inbox import InboxWorker
from gateway.worker.patience import Patience
from tests.integration.test_inbox_worker import add_rows, table

HOLDING = "Hold on, please."


class Flaky:
    """Fails transiently (503) while `down` or for a text in `down_for`, or with `error` when set;
    else echoes. Records each call."""

    def __init__(self) -> None:
        self.down = 0  # calls still to fail
        self.down_for: set[str] = set()
        self.error: ModelError | None = None
        self.calls: list[str] = []
        self.on_call: list[asyncio.Event] = []

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        text = history[-1].content or ""
        self.calls.append(text)
        if self.error is not None:
            raise self.error
        if text in self.down_for:
            raise ModelError("overloaded", status=503, provider="fake", transient=True)
        if self.down:
            self.down -= 1
            raise ModelError("overloaded", status=503, provider="fake", transient=True)
        return Message(Role.MODEL, f"echo:{text}")


class FakeTime:
    """The patience's clock, moved on by the worker's waits: outages last exactly what was waited.
    `now` is the seconds since the test began; the clock answers the wall-clock time of that."""

    def __init__(self) -> None:
        self.start = datetime.now(UTC)
        self.micros = 0  # whole microseconds, as a datetime holds them: no rounding between the two
        self.waits: list[float] = []

    @property
    def now(self) -> float:
        return self.micros / 1e6

    def clock(self) -> datetime:
        return self.start + timedelta(microseconds=self.micros)

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.micros += round(seconds * 1e6)


@pytest.fixture
async def setup(database: Database) -> AsyncIterator[tuple[Database, Runner, Flaky]]:
    await migrations.upgrade(database)
    model = Flaky()
    store = SQLSessionStore(database)
    yield database, Runner(Agent("Echo", "e", model=model), store), model
    await store.aclose()


def worker_with(
    database: Database, runner: Runner, time: FakeTime, *, retry_s: float, holding_after_s: float = 0
) -> InboxWorker:
    return InboxWorker(
        database,
        runner,
        patience=Patience(retry_s, holding_after_s, clock=time.clock),
        holding_reply=HOLDING,
        sleep=time.sleep,
    )


async def test_an_outage_is_waited_out_in_order_with_one_holding_reply(
    setup: tuple[Database, Runner, Flaky],
) -> None:
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a"), ("telegram:1", "telegram:1/b")])
    model.down = 12  # about two minutes of backoff
    time = FakeTime()
    worker = worker_with(database, runner, time, retry_s=1800, holding_after_s=30)

    assert await worker.run_until_idle() == 2

    assert model.calls == ["telegram:1/a"] * 13 + ["telegram:1/b"]  # b waited behind a
    assert time.now >= 30
    statuses = await table(database, select(InboxRow.text, InboxRow.status, InboxRow.attempts))
    assert statuses == [("telegram:1/a", "done", 0), ("telegram:1/b", "done", 0)]
    replies = await table(database, select(OutboxRow.text).order_by(OutboxRow.id))
    assert [text for (text,) in replies] == [HOLDING, "echo:telegram:1/a", "echo:telegram:1/b"]
    assert len(worker.patience) == 0  # the outage ended with the committed turn


async def test_no_holding_reply_when_off_or_before_its_delay(setup: tuple[Database, Runner, Flaky]) -> None:
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a"), ("telegram:2", "telegram:2/a")])
    model.down = 3
    time = FakeTime()

    assert await worker_with(database, runner, time, retry_s=1800).run_until_idle() == 2

    replies = await table(database, select(OutboxRow.text).order_by(OutboxRow.id))
    assert HOLDING not in [text for (text,) in replies]


async def test_a_turn_gives_up_after_the_patience_and_the_next_message_runs(
    setup: tuple[Database, Runner, Flaky],
) -> None:
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a"), ("telegram:1", "telegram:1/b")])
    model.down_for.add("telegram:1/a")
    time = FakeTime()
    worker = worker_with(database, runner, time, retry_s=60, holding_after_s=10)

    assert await worker.run_until_idle() == 2  # a, dead after 60 s of outage; then b

    assert 60 <= time.now < 61
    rows = await table(
        database, select(InboxRow.text, InboxRow.status, InboxRow.last_error).order_by(InboxRow.id)
    )
    assert [(text, status) for text, status, _ in rows] == [
        ("telegram:1/a", "dead"),
        ("telegram:1/b", "done"),
    ]
    assert "503" in rows[0][2]
    replies = await table(database, select(OutboxRow.text).order_by(OutboxRow.id))
    assert [text for (text,) in replies] == [HOLDING, "echo:telegram:1/b"]


@pytest.mark.parametrize("status", [400, 401, 404])
async def test_a_permanent_model_error_is_dead_at_once(
    setup: tuple[Database, Runner, Flaky], status: int
) -> None:
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a")])
    model.error = ModelError("invalid 'tools[0]' schema", status=status, provider="fake")
    time = FakeTime()

    assert await worker_with(database, runner, time, retry_s=1800, holding_after_s=1).run_until_idle() == 1

    assert model.calls == ["telegram:1/a"]
    assert time.waits == []
    rows = await table(database, select(InboxRow.status, InboxRow.attempts, InboxRow.last_error))
    assert rows == [("dead", 1, f"ModelError: fake answered {status}: invalid 'tools[0]' schema")]
    assert await table(database, select(OutboxRow.id)) == []


async def test_a_waiting_turn_keeps_its_lease_and_gives_it_back_when_cancelled(
    setup: tuple[Database, Runner, Flaky],
) -> None:
    """The claim loop's heartbeat renews the lease of a turn waiting out an outage (another worker
    never gets the row); cancelled while it waits (shutting down), it hands the row back."""
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a")])
    model.down = 1_000_000
    waits = 0
    several_leases_waited = asyncio.Event()

    async def wait(seconds: float) -> None:
        nonlocal waits
        waits += 1
        if waits == 4:
            several_leases_waited.set()
        await asyncio.sleep(0.3)  # real time: the lease (0.5 s) must be renewed to survive this

    worker = InboxWorker(
        database, runner, lease_seconds=0.5, patience=Patience(1800), sleep=wait, owner="patient"
    )
    other = InboxWorker(database, runner, lease_seconds=0.5, owner="other")
    running = asyncio.create_task(worker.run())
    async with asyncio.timeout(30):
        await several_leases_waited.wait()  # 1.2 s of waiting: more than two leases
    assert await other.claim(10) == []
    assert await table(database, select(InboxRow.lease_owner)) == [("patient",)]

    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running

    assert await table(database, select(InboxRow.status, InboxRow.lease_owner)) == [("pending", None)]
    assert [row.id for row in await other.claim(10)] != []


class BudgetLimits(TypedDict, total=False):
    """ProviderBudget's limits, as keywords."""

    max_concurrency: int
    rpm: int
    tpm: int


class WatchedBudget(ProviderBudget):
    """A budget that says when a call arrives at it."""

    def __init__(self, name: str, **limits: Unpack[BudgetLimits]) -> None:
        super().__init__(name, **limits)
        self.arrived = asyncio.Event()

    @asynccontextmanager
    async def call(self, tokens: int = 1) -> AsyncIterator[Grant]:
        self.arrived.set()
        async with super().call(tokens) as grant:
            yield grant


async def test_a_turn_waiting_for_its_provider_budget_keeps_its_lease(
    setup: tuple[Database, Runner, Flaky],
) -> None:
    """A turn queued behind a full provider budget holds its row (renewed by the heartbeat, here six
    times: two leases) and hands it back when cancelled; the call it waited for was never made."""
    database, _, _ = setup
    await add_rows(database, [("telegram:1", "telegram:1/a")])
    budget = WatchedBudget("openai", max_concurrency=1)
    model = OpenAIChatModel("gpt-test", "http://127.0.0.1:9/v1", budget=budget)  # never reached
    store = SQLSessionStore(database)
    runner = Runner(Agent("Echo", "e", model=model), store)
    worker = InboxWorker(database, runner, lease_seconds=0.5, owner="patient")
    other = InboxWorker(database, runner, lease_seconds=0.5, owner="other")
    renewals = 0
    two_leases = asyncio.Event()
    renew = worker.loop.renew

    async def counted(ids: list[int]) -> set[int]:
        nonlocal renewals
        held = await renew(ids)
        renewals += 1
        if renewals >= 6:
            two_leases.set()
        return held

    worker.loop.renew = counted
    try:
        async with budget.call():  # another call holds the only slot
            budget.arrived.clear()
            running = asyncio.create_task(worker.run())
            async with asyncio.timeout(30):
                await budget.arrived.wait()  # the turn reached the budget
                await two_leases.wait()
            assert budget.waiting == 1
            assert await other.claim(10) == []
            assert await table(database, select(InboxRow.lease_owner)) == [("patient",)]
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
    finally:
        await model.aclose()
        await store.aclose()

    assert await table(database, select(InboxRow.status, InboxRow.lease_owner)) == [("pending", None)]
    assert budget.in_flight == budget.waiting == 0


@pytest.mark.parametrize("stop", ["handed back", "lease expired"])
async def test_a_takeover_goes_on_with_the_outage_and_sends_no_second_holding_reply(
    setup: tuple[Database, Runner, Flaky], stop: str
) -> None:
    """Worker A waits out 45 s of outage and sends the holding reply, then stops: shutting down (its
    lease handed back) or stalled until its lease expired. Worker B, a new object with a patience of
    its own (as after a restart, or on another replica), takes the row: it sends no second holding
    reply and gives up 120 s after the outage's first failure, not 120 s after its own."""
    database, runner, model = setup
    await add_rows(database, [("telegram:1", "telegram:1/a")])
    model.down = 1_000_000
    time = FakeTime()
    parked = asyncio.Event()

    async def wait_then_stop(seconds: float) -> None:
        await time.sleep(seconds)
        if time.now >= 45:
            parked.set()
            await asyncio.Event().wait()  # A stops here: cancelled, or stalled past its lease

    first = InboxWorker(
        database,
        runner,
        patience=Patience(120, 30, clock=time.clock),
        holding_reply=HOLDING,
        sleep=wait_then_stop,
        owner="first",
        lease_seconds=30 if stop == "handed back" else -1,  # -1: A's lease has expired at once
    )
    (row,) = await first.claim(10)
    running = asyncio.create_task(first.process(row))
    async with asyncio.timeout(30):
        await parked.wait()
    if stop == "handed back":
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await table(database, select(InboxRow.lease_owner)) == [(None,)]
    assert await table(database, select(OutboxRow.text)) == [(HOLDING,)]
    taken_over_at = time.now

    second = InboxWorker(
        database,
        runner,
        patience=Patience(120, 30, clock=time.clock),
        holding_reply=HOLDING,
        sleep=time.sleep,
        owner="second",
    )
    assert await second.run_until_idle() == 1

    assert 120 <= time.now < 121
    assert time.now - taken_over_at < 120 - 45 + 1
    rows = await table(database, select(InboxRow.status, InboxRow.lease_owner, InboxRow.last_error))
    assert [(status, owner) for status, owner, _ in rows] == [("dead", None)]
    assert "503" in rows[0][2]
    assert await table(database, select(OutboxRow.text)) == [(HOLDING,)]  # still the one from A
    if not running.done():  # the stalled A, stopped now: its row is B's outcome, not A's to hand back
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    assert await table(database, select(InboxRow.status)) == [("dead",)]

    # An operator's requeue gives the row a patience anew.
    assert await inbox.retry(database, row.id)
    outage = await table(database, select(InboxRow.outage_started_at, InboxRow.holding_reply_at))
    assert outage == [(None, None)]


async def test_the_holding_reply_is_queued_once_per_row_and_only_by_its_holder(
    setup: tuple[Database, Runner, Flaky],
) -> None:
    database, _, _ = setup
    await add_rows(database, [("telegram:1", "telegram:1/a")])
    (row,) = await inbox.claim(database, "holder", timedelta(seconds=30), 10)
    reply = OutboundMessage("telegram", row.session_id, OutboundKind.TEXT, TelegramTarget("1"), HOLDING)
    now = datetime.now(UTC)

    assert not await outages.queue_holding_reply(database, row.id, "someone else", [reply], now)
    assert await outages.queue_holding_reply(database, row.id, "holder", [reply], now)
    assert not await outages.queue_holding_reply(database, row.id, "holder", [reply], now)

    assert await table(database, select(OutboxRow.inbox_id, OutboxRow.text)) == [(row.id, HOLDING)]
    assert await outages.begin(database, row.id, "holder", now) == outages.Recorded(now, holding_queued=True)
    later = await outages.begin(database, row.id, "holder", now + timedelta(seconds=5))
    assert later == outages.Recorded(now, holding_queued=True)  # it began before: kept
    assert await outages.begin(database, row.id, "someone else", now) is None
