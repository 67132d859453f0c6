"""The inbox worker on SQLite and PostgreSQL: turns in order, committed with their inbox row and replies."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.domain.outbound import TelegramTarget
from gateway.domain.sessions import StoredVersion
from gateway.store import migrations
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage
from gateway.store.tables import InboxRow, OutboxRow, SessionRow
from gateway.worker import claim_loop
from gateway.worker.inbox import InboxWorker


class Echo:
    """Replies 'echo:<text>' and records, per session, the order in which it saw messages."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = defaultdict(list)
        self.fail_on: set[str] = set()

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        text = history[-1].content or ""
        session = text.split("/")[0]
        self.seen[session].append(text)
        await asyncio.sleep(0)  # let other turns interleave if the worker allowed it
        if text in self.fail_on:
            raise RuntimeError(f"model failed on {text}")
        return Message(Role.MODEL, f"echo:{text}")


@pytest.fixture
async def setup(database: Database) -> AsyncIterator[tuple[Database, Runner, Echo]]:
    await migrations.upgrade(database)
    model = Echo()
    store = SQLSessionStore(database)
    yield database, Runner(Agent("Echo", "e", model=model), store), model
    await store.aclose()


async def add_rows(
    engine: Database, rows: list[tuple[str, str]], status: str = "pending", **extra: Any
) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(InboxRow),
            [
                {
                    "dedup_key": "k:" + hashlib.sha256(text.encode()).hexdigest(),
                    "platform": "telegram",
                    "session_id": session,
                    "message_id": f"{session}:{i}",
                    "kind": "text",
                    "text": text,
                    "message_json": {
                        "platform": "telegram",
                        "conversation": {"platform": "telegram", "chat_id": session.split(":")[1]},
                        "user_id": "7",
                        "user_name": "Ann",
                        "message_id": f"{session}:{i}",
                        **extra,
                    },
                    "status": status,
                    "attempts": 0,
                    "next_attempt_at": now,
                    "received_at": now,
                }
                for i, (session, text) in enumerate(rows)
            ],
        )


async def table(engine: Database, query: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list(await conn.execute(query))


async def test_turns_commit_with_their_inbox_row_and_reply(setup: tuple[Database, Runner, Echo]) -> None:
    engine, runner, _ = setup
    await add_rows(
        engine,
        [("telegram:1", "telegram:1/a"), ("telegram:2", "telegram:2/a"), ("telegram:1", "telegram:1/b")],
    )
    await add_rows(engine, [("telegram:3", "telegram:3/reaction")], status="recorded")
    worker = InboxWorker(engine, runner)
    assert await worker.run_until_idle() == 3
    statuses = await table(engine, select(InboxRow.text, InboxRow.status).order_by(InboxRow.id))
    assert statuses == [
        ("telegram:1/a", "done"),
        ("telegram:2/a", "done"),
        ("telegram:1/b", "done"),
        ("telegram:3/reaction", "recorded"),
    ]
    replies = await table(
        engine, select(OutboxRow.session_id, OutboxRow.kind, OutboxRow.text, OutboxRow.target_json)
    )
    assert sorted((s, k, t) for s, k, t, _ in replies) == [
        ("telegram:1", "text", "echo:telegram:1/a"),
        ("telegram:1", "text", "echo:telegram:1/b"),
        ("telegram:2", "text", "echo:telegram:2/a"),
    ]
    assert replies[0][3]["chat_id"] in {"1", "2"}
    session = await runner.session_store.get("telegram:1")
    assert session is not None
    assert [m.content for m in session.history] == [
        "telegram:1/a",
        "echo:telegram:1/a",
        "telegram:1/b",
        "echo:telegram:1/b",
    ]
    assert session.metadata == {"platform": "telegram", "user_id": "7", "user_name": "Ann"}


async def test_two_workers_keep_each_conversation_in_order(setup: tuple[Database, Runner, Echo]) -> None:
    engine, runner, model = setup
    rows = [(f"telegram:{s}", f"telegram:{s}/{i}") for i in range(6) for s in range(4)]
    await add_rows(engine, rows)
    workers = [InboxWorker(engine, runner, concurrency=4, owner=f"w{n}") for n in range(2)]
    done = await asyncio.gather(*(w.run_until_idle() for w in workers))
    assert sum(done) == len(rows)
    for s in range(4):
        assert model.seen[f"telegram:{s}"] == [f"telegram:{s}/{i}" for i in range(6)]
    assert {status for (status,) in await table(engine, select(InboxRow.status))} == {"done"}


async def test_a_failing_turn_is_retried_later_then_dead_lettered(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, model = setup
    await add_rows(engine, [("telegram:1", "telegram:1/x"), ("telegram:1", "telegram:1/y")])
    model.fail_on.add("telegram:1/x")
    worker = InboxWorker(engine, runner, max_attempts=2)
    assert await worker.run_until_idle() == 1  # x failed; y waits behind it
    (attempts, status, error, due) = (
        await table(
            engine,
            select(
                InboxRow.attempts, InboxRow.status, InboxRow.last_error, InboxRow.next_attempt_at
            ).order_by(InboxRow.id),
        )
    )[0]
    assert (attempts, status) == (1, "pending")
    assert "model failed" in error
    assert due > datetime.now(UTC)  # backing off
    assert await worker.run_until_idle() == 0
    async with engine.begin() as conn:  # move time on: make the retry due now
        await conn.execute(update(InboxRow).values(next_attempt_at=datetime.now(UTC)))
    assert await worker.run_until_idle() == 2  # x fails for good, then y runs
    statuses = await table(engine, select(InboxRow.text, InboxRow.status).order_by(InboxRow.id))
    assert statuses == [("telegram:1/x", "dead"), ("telegram:1/y", "done")]
    session = await runner.session_store.get("telegram:1")
    assert session is not None
    assert [m.content for m in session.history] == ["telegram:1/y", "echo:telegram:1/y"]  # x left no trace


async def test_a_worker_that_lost_its_lease_commits_nothing(setup: tuple[Database, Runner, Echo]) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a")])
    worker = InboxWorker(engine, runner, owner="slow")
    (row,) = await worker.claim(10)
    async with engine.begin() as conn:  # its lease expired and another worker took the row
        await conn.execute(update(InboxRow).values(lease_owner="other"))
    await worker.process(row)
    assert await table(engine, select(InboxRow.status, InboxRow.lease_owner)) == [("pending", "other")]
    assert await table(engine, select(OutboxRow.id)) == []
    assert await runner.session_store.get("telegram:1") is None


async def test_a_lost_lease_on_a_known_session_leaves_it_as_it_was(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a")])
    assert await InboxWorker(engine, runner).run_until_idle() == 1
    await add_rows(engine, [("telegram:1", "telegram:1/b")])
    worker = InboxWorker(engine, runner, owner="slow")
    (row,) = await worker.claim(10)
    async with engine.begin() as conn:  # its lease expired and another worker took the row
        await conn.execute(update(InboxRow).where(InboxRow.id == row.id).values(lease_owner="other"))
    await worker.process(row)
    statuses = await table(engine, select(InboxRow.status, InboxRow.lease_owner).order_by(InboxRow.id))
    assert statuses == [("done", None), ("pending", "other")]
    assert len(await table(engine, select(OutboxRow.id))) == 1
    session = await runner.session_store.get("telegram:1")
    assert session is not None
    assert [m.content for m in session.history] == ["telegram:1/a", "echo:telegram:1/a"]


async def test_a_turn_on_a_session_deleted_meanwhile_writes_nothing_and_keeps_its_row(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, model = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a")])
    assert await InboxWorker(engine, runner).run_until_idle() == 1
    await add_rows(engine, [("telegram:1", "telegram:1/b")])
    worker = InboxWorker(engine, runner, owner="w")
    (row,) = await worker.claim(10)
    deleted = False
    respond = model.respond

    async def delete_first(agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        nonlocal deleted
        if not deleted:  # an operator deletes the session while its model call runs
            deleted = await runner.session_store.delete("telegram:1")
        return await respond(agent, history, tools)

    model.respond = delete_first  # type: ignore[method-assign]
    await worker.process(row)
    assert deleted
    statuses = await table(engine, select(InboxRow.status).order_by(InboxRow.id))
    assert statuses == [("done",), ("pending",)]
    assert len(await table(engine, select(OutboxRow.id))) == 1
    assert await runner.session_store.get("telegram:1") is None


async def test_a_leased_row_is_not_claimed_twice(setup: tuple[Database, Runner, Echo]) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a"), ("telegram:2", "telegram:2/a")])
    first = await InboxWorker(engine, runner, owner="a").claim(10)
    second = await InboxWorker(engine, runner, owner="b").claim(10)
    assert len(first) == 2
    assert second == []


async def test_callback_queries_are_always_answered(setup: tuple[Database, Runner, Echo]) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/btn")], callback_query_id="cbq-9")
    assert await InboxWorker(engine, runner).run_until_idle() == 1
    kinds = await table(engine, select(OutboxRow.kind, OutboxRow.target_json).order_by(OutboxRow.id))
    assert [k for k, _ in kinds] == ["answer_callback", "text"]
    assert TelegramTarget.from_json(kinds[0][1]).callback_query_id == "cbq-9"


async def test_a_long_reply_becomes_several_outbox_rows_in_order(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, _ = setup
    long_text = "telegram:1/" + ("word " * 1000).strip() + "\n\n" + ("more " * 300).strip()
    await add_rows(engine, [("telegram:1", long_text)])
    assert await InboxWorker(engine, runner).run_until_idle() == 1
    parts = [text for (text,) in await table(engine, select(OutboxRow.text).order_by(OutboxRow.id))]
    assert len(parts) == 2
    assert all(len(p) <= 4096 for p in parts)
    assert " ".join(parts).split() == f"echo:{long_text}".split()


async def test_a_lost_lease_costs_the_turns_committed_with_it_nothing(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a"), ("telegram:2", "telegram:2/a")])
    worker = InboxWorker(engine, runner, owner="w")
    lost, kept = await worker.claim(10)
    async with engine.begin() as conn:  # the first row's lease expired and another worker took it
        await conn.execute(update(InboxRow).where(InboxRow.id == lost.id).values(lease_owner="other"))
    # Both turns finish together: on an SQLite file their writes share one group commit.
    await asyncio.gather(worker.process(lost), worker.process(kept))
    statuses = await table(engine, select(InboxRow.session_id, InboxRow.status).order_by(InboxRow.id))
    assert statuses == [("telegram:1", "pending"), ("telegram:2", "done")]
    assert await table(engine, select(OutboxRow.session_id)) == [("telegram:2",)]
    assert await runner.session_store.get("telegram:1") is None
    session = await runner.session_store.get("telegram:2")
    assert session is not None
    assert [m.content for m in session.history] == ["telegram:2/a", "echo:telegram:2/a"]


async def test_claims_take_each_conversations_oldest_row_whatever_the_backlog(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, _ = setup
    # History first: conversation 0 has finished rows before its backlog, conversation 1 a dead one.
    await add_rows(engine, [("telegram:0", f"telegram:0/old{i}") for i in range(30)], status="done")
    await add_rows(engine, [("telegram:1", "telegram:1/dead")], status="dead")
    backlog = [(f"telegram:{s}", f"telegram:{s}/{i}") for i in range(8) for s in range(25)]
    await add_rows(engine, backlog)
    worker = InboxWorker(engine, runner, owner="a")
    claimed = await worker.claim(1000)
    assert [row.text for row in claimed] == [f"telegram:{s}/0" for s in range(25)]
    assert [row.id for row in claimed] == sorted(row.id for row in claimed)
    # Leased rows hold their conversations back, for every claimer.
    assert await InboxWorker(engine, runner, owner="b").claim(1000) == []
    async with engine.begin() as conn:  # conversation 3's turn is done: its next row is free
        await conn.execute(update(InboxRow).where(InboxRow.id == claimed[3].id).values(status="done"))
    (next_row,) = await InboxWorker(engine, runner, owner="b").claim(1000)
    assert next_row.text == "telegram:3/1"


async def test_while_webhooks_wait_for_a_commit_few_turns_start_at_a_time_but_all_run(
    setup: tuple[Database, Runner, Echo], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of webhooks holds new turns back (acknowledgements first) without starving them."""
    engine, runner, model = setup
    delay = 0.05
    monkeypatch.setattr(claim_loop, "BUSY_CLAIM_DELAY_SECONDS", delay)
    rows = [("telegram:1", f"telegram:1/{i}") for i in range(3)]
    rows += [(f"telegram:{n}", f"telegram:{n}/0") for n in range(2, 10)]
    await add_rows(engine, rows)
    committed = 0
    all_done = asyncio.Event()

    def on_committed(session_id: str) -> None:
        nonlocal committed
        committed += 1
        if committed == len(rows):
            all_done.set()

    worker = InboxWorker(engine, runner, on_committed=on_committed, busy=lambda: True)
    claims: list[tuple[float, int]] = []
    claim = worker.claim

    async def recorded_claim(limit: int, sessions: Sequence[str] | None = None) -> list[ClaimedMessage]:
        claimed = await claim(limit, sessions)
        if claimed:
            claims.append((time.monotonic(), len(claimed)))
        return claimed

    monkeypatch.setattr(worker, "claim", recorded_claim)
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(all_done.wait(), timeout=30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert model.seen["telegram:1"] == [f"telegram:1/{i}" for i in range(3)]
    assert sum(count for _, count in claims) == len(rows)
    assert max(count for _, count in claims) <= claim_loop.BUSY_CLAIM_ROWS
    times = [at for at, _ in claims]
    assert all(later - earlier >= delay for earlier, later in itertools.pairwise(times))


async def test_before_each_turn_the_worker_names_where_the_reply_will_go(
    setup: tuple[Database, Runner, Echo],
) -> None:
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:5", "telegram:5/a")], chat_type="group")
    seen: list[tuple[str, dict[str, Any]]] = []
    worker = InboxWorker(
        engine, runner, before_turn=lambda platform, target: seen.append((platform, target.to_json()))
    )
    assert await worker.run_until_idle() == 1
    ((platform, target),) = seen
    assert platform == "telegram"
    assert (target["chat_id"], target["reply_to"], target["chat_type"]) == ("5", "telegram:5:0", "group")


class Poisoned:
    """A model whose answer carries what a database refuses: NUL (PostgreSQL text) and a lone surrogate
    (not UTF-8 at all), in the reply and in a tool call's arguments."""

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        return Message(Role.MODEL, "order\x00 42 is \ud800 on its way")


async def test_a_model_answer_the_database_refuses_is_stored_without_the_offending_characters(
    database: Database,
) -> None:
    """The finding (issue 12): a reply with NUL failed its turn's commit on PostgreSQL at every retry,
    then was dead-lettered: the user got nothing. Its text is made storable like a webhook's values."""
    await migrations.upgrade(database)
    store = SQLSessionStore(database)
    try:
        await add_rows(database, [("telegram:1", "telegram:1/x")])
        worker = InboxWorker(database, Runner(Agent("Poisoned", "p", model=Poisoned()), store))
        assert await worker.run_until_idle() == 1
        async with database.connect() as conn:
            status, error = (await conn.execute(select(InboxRow.status, InboxRow.last_error))).one()
            (reply,) = (await conn.execute(select(OutboxRow.text))).one()
        assert (status, error) == ("done", None)
        assert reply == "order 42 is \ufffd on its way"
        fresh = SQLSessionStore(database)  # reads the stored session, not this store's memory of it
        stored = await fresh.get("telegram:1")
        await fresh.aclose()
        assert stored is not None
        assert stored.history[-1].content == "order 42 is \ufffd on its way"
    finally:
        await store.aclose()


async def test_a_claim_reads_its_sessions_version(setup: tuple[Database, Runner, Echo]) -> None:
    """The claim returns the version of the row's session (none yet, then its updated_at), so the
    worker's store can skip reading a session it already holds."""
    engine, runner, _ = setup
    await add_rows(engine, [("telegram:1", "telegram:1/a")])
    worker = InboxWorker(engine, runner)
    (first,) = await worker.claim(10)
    assert first.session_version == StoredVersion(None)
    await worker.process(first)
    await add_rows(engine, [("telegram:1", "telegram:1/b")])
    (second,) = await worker.claim(10)
    (stored,) = await table(engine, select(SessionRow.updated_at))
    assert second.session_version == StoredVersion(stored[0])
    assert stored[0] is not None


async def test_replicas_taking_turns_on_one_conversation_each_see_the_others_turns(
    setup: tuple[Database, Runner, Echo],
) -> None:
    """Two processes (two stores, each remembering the sessions it wrote) answer one conversation in
    turn: the version each claim reads tells a store its remembered copy is stale."""
    engine, runner, model = setup
    other_store = SQLSessionStore(engine)
    other = Runner(Agent("Echo", "e", model=model), other_store)
    try:
        workers = [InboxWorker(engine, runner, owner="a"), InboxWorker(engine, other, owner="b")]
        for i in range(4):
            await add_rows(engine, [("telegram:1", f"telegram:1/{i}")])
            assert await workers[i % 2].run_until_idle() == 1
        for store in (runner.session_store, other_store):
            session = await store.get("telegram:1")
            assert session is not None
            assert [m.content for m in session.history] == [
                text for i in range(4) for text in (f"telegram:1/{i}", f"echo:telegram:1/{i}")
            ]
    finally:
        await other_store.aclose()
