"""The hot statements' plans on PostgreSQL at 100,000 rows: none reads a whole work table.

Every statement the message path sends (a webhook's ingest, a turn's claim, load, save and completion,
a delivery's claim and outcomes, one and a batch, lease renewals and releases, a status webhook) is
captured while it runs on tables holding 100,000 rows each, then EXPLAINed with its own parameters.
A sequential scan on the inbox, the outbox, the dedup keys, the sessions, their messages or the queue
heads would make that statement's cost grow with the history: the test names the statement and its plan.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, text

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.domain.inbound import ConversationKey, InboundMessage, MessageKind, ParsedUpdate, StatusUpdate
from gateway.store import inbox, migrations, outbox, postgres_lanes
from gateway.store.database import Database
from gateway.store.ingest import Ingest
from gateway.store.sent_replies import SentReplies
from gateway.worker.claim_loop import MAX_HINTS_PER_CLAIM
from gateway.worker.inbox import InboxWorker

pytestmark = pytest.mark.postgres

ROWS = 100_000
HOT_TABLES = (
    "chatflow_inbox",
    "chatflow_outbox",
    "chatflow_processed_messages",
    "chatflow_sessions",
    "chatflow_messages",
    "chatflow_queue_heads",
)
SEQUENTIAL = re.compile(r"Seq Scan on (\w+)")

# 100,000 rows per table: the history of 1,000 conversations, most of it done; 1,000 messages pending.
FILL = [
    f"INSERT INTO chatflow_sessions (session_id, active_agent_name, metadata_json, created_at, updated_at, "
    f"message_count) "
    f"SELECT 'telegram:' || n, 'Echo', '{{}}', now(), now(), 100 FROM generate_series(1, {ROWS // 100}) AS n",
    f"INSERT INTO chatflow_messages (session_id, position, role, message_json, created_at) "
    f"""SELECT 'telegram:' || (n % {ROWS // 100} + 1), n / {ROWS // 100}, 'user', """
    """'{"role": "user", "content": "hi"}', now() """
    f"FROM generate_series(0, {ROWS - 1}) AS n",
    f"INSERT INTO chatflow_processed_messages (message_key, platform, processed_at, expires_at) "
    f"SELECT 'telegram:old:' || n, 'telegram', now(), now() + interval '8 days' "
    f"FROM generate_series(1, {ROWS}) AS n",
    f"INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, message_json, "
    f"status, attempts, next_attempt_at, received_at) "
    f"SELECT 'telegram:old:' || n, 'telegram', 'telegram:' || (n % 1000 + 1), n, 'text', 'hi', "
    f"""'{{"platform": "telegram", "conversation": {{"platform": "telegram", "chat_id": "1"}}}}', """
    f"CASE WHEN n > {ROWS - 1000} THEN 'pending' ELSE 'done' END, 0, now(), now() "
    f"FROM generate_series(1, {ROWS}) AS n",
    f"INSERT INTO chatflow_outbox (inbox_id, platform, session_id, kind, text, target_json, status, "
    f"attempts, next_attempt_at, platform_message_id, created_at, updated_at) "
    f"SELECT n, 'telegram', 'telegram:' || (n % 1000 + 1), 'text', 'hello', '{{\"chat_id\": \"1\"}}', "
    f"CASE WHEN n > {ROWS - 1000} THEN 'pending' ELSE 'sent' END, 0, now(), 'm' || n, now(), now() "
    f"FROM generate_series(1, {ROWS}) AS n",
    "ANALYZE",
]


class Echo:
    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        return Message(Role.MODEL, "echo")


class Sender:
    async def send(self, message: Any) -> str:
        return "sent-1"

    async def indicate_typing(self, target: Any) -> None:
        return None


@pytest.fixture
async def full_database(postgres_url: str) -> AsyncIterator[Database]:
    db = Database.open(postgres_url)
    await migrations.upgrade(db)
    async with db.begin() as conn:
        for statement in FILL:
            await conn.execute(text(statement))
    yield db
    await db.aclose()


def message(number: int) -> InboundMessage:
    return InboundMessage(
        platform="telegram",
        message_id=str(number),
        dedup_key=f"telegram:new:{number}",
        conversation=ConversationKey("telegram", str(number % 1000 + 1)),
        kind=MessageKind.TEXT,
        timestamp=datetime.now(UTC),
        user_id="7",
        text="Where is my order?",
    )


async def test_no_hot_statement_reads_a_whole_table(
    full_database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = full_database
    captured: list[tuple[str, Any]] = []
    run_on_lane = postgres_lanes._execute

    async def capture_lane(raw: Any, statement: str, args: list[Any]) -> Any:
        captured.append((statement, tuple(args)))
        return await run_on_lane(raw, statement, args)

    # The per-message statements run on the lanes' asyncpg connections, past SQLAlchemy's events.
    monkeypatch.setattr(postgres_lanes, "_execute", capture_lane)

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if not many and statement.lstrip().split(None, 1)[0].upper() in {
            "SELECT",
            "INSERT",
            "UPDATE",
            "DELETE",
            "WITH",
        }:
            captured.append((statement, parameters))

    event.listen(db.engine.sync_engine, "before_cursor_execute", capture)
    store = SQLSessionStore(db)
    try:
        ingest = Ingest(db, timedelta(hours=192))
        await ingest.write(ParsedUpdate(messages=[message(n) for n in range(3)]), [True, True, True])
        worker = InboxWorker(db, Runner(Agent("Echo", "e", model=Echo()), store), owner="plans")
        claimed = await worker.claim(4)
        assert claimed, "the backlog's heads are claimable"
        hints = [
            f"telegram:{n}" for n in range(700, 710) if f"telegram:{n}" not in {r.session_id for r in claimed}
        ]
        hinted = await worker.claim(4, hints[:2])
        assert {row.session_id for row in hinted} == set(hints[:2])
        await inbox.release_many(db, [row.id for row in hinted], "plans")
        # As the claim loop names them under load: a dozen conversations for up to 64 rows.
        taken = {r.session_id for r in claimed}
        free = [f"telegram:{n}" for n in range(800, 830) if f"telegram:{n}" not in taken]
        dozen = free[:MAX_HINTS_PER_CLAIM]
        dozen_rows = await worker.claim(64, dozen)
        assert len(dozen_rows) == MAX_HINTS_PER_CLAIM
        await inbox.release_many(db, [row.id for row in dozen_rows], "plans")
        await inbox.renew(db, [row.id for row in claimed], "plans", timedelta(seconds=30))
        await worker.process(claimed[0])
        assert await inbox.get_item(db, claimed[0].id) is not None
        assert (await inbox.get_item(db, claimed[0].id)).status == "done"  # type: ignore[union-attr]
        await inbox.release_many(db, [row.id for row in claimed[1:]], "plans")
        replies = await outbox.claim(db, "plans", timedelta(seconds=30), 4, {})
        assert replies
        hint = next(h for h in hints[2:] if h not in {reply.session_id for reply in replies})
        hinted_replies = await outbox.claim(db, "plans", timedelta(seconds=30), 4, {}, [hint])
        assert [reply.session_id for reply in hinted_replies] == [hint]
        await outbox.release_many(db, [reply.id for reply in hinted_replies], "plans")
        await outbox.finish(db, replies[0].id, "plans", status="sent", platform_message_id="new-1")
        assert len(replies) >= 2
        assert await SentReplies(db).record(replies[1].id, "plans", "sent", "new-2")
        await outbox.release_many(db, [r.id for r in replies[2:]], "plans")
        status = StatusUpdate("telegram", "m5", "delivered", "telegram:status:m5", datetime.now(UTC))
        await ingest.write(ParsedUpdate(statuses=[status]), [])
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", capture)
        await store.aclose()

    # The statements the inbox's and outbox's triggers run (migration 0007) are not in the captured
    # ones' plans: their reads of a conversation's oldest pending row are checked as statements.
    for table in ("chatflow_inbox", "chatflow_outbox"):
        oldest = (
            f"SELECT p.id, p.next_attempt_at FROM {table} AS p WHERE p.session_id = $1 "
            "AND p.status = 'pending' ORDER BY p.id LIMIT 1"
        )
        captured.append((oldest, ("telegram:5",)))
    assert len(captured) >= 20, captured
    assert any("FROM chatflow_sessions s WHERE" in s for s, _ in captured), "a turn loaded its session"
    offenders = []
    async with db.connect() as conn:
        for statement, parameters in captured:
            plan = await conn.exec_driver_sql("EXPLAIN " + statement, parameters)
            lines = [row[0] for row in plan]
            scanned = {table for line in lines for table in SEQUENTIAL.findall(line)} & set(HOT_TABLES)
            if scanned:
                offenders.append(f"{statement}\n" + "\n".join(lines))
    assert not offenders, "\n\n".join(offenders)
    # A hinted claim (naming 1, 2 or MAX_HINTS_PER_CLAIM conversations, as the claim loop does under
    # load) finds each named head newest version first (a backward scan of the key) and locks that
    # version by ctid: the due index, where a held snapshot keeps every head version written meanwhile,
    # is not read at all, nor the whole heads table (the generic check above), nor the key forwards,
    # through the held versions (migration 0019, docs/postgres-performance.md). So does a renewal.
    newest_first = [(s, p) for s, p in captured if "unnest" in s and "chatflow_queue_heads" in s]
    assert len([s for s, _ in newest_first if "FOR UPDATE" in s]) == 3, newest_first
    assert len(newest_first) == 4, newest_first  # and the renewal
    async with db.connect() as conn:
        for statement, parameters in newest_first:
            plan_text = " ".join(
                row[0] for row in await conn.exec_driver_sql("EXPLAIN " + statement, parameters)
            )
            assert "Index Scan Backward using pk_chatflow_queue_heads" in plan_text, plan_text
            assert "Index Scan using pk_chatflow_queue_heads" not in plan_text, plan_text
            assert "Tid Scan on chatflow_queue_heads" in plan_text, plan_text
            assert "ix_chatflow_queue_heads_due" not in plan_text, plan_text
    # The check itself sees a whole-table read.
    async with db.connect() as conn:
        plan = await conn.exec_driver_sql("EXPLAIN SELECT id FROM chatflow_inbox WHERE text = 'x'")
        assert "chatflow_inbox" in SEQUENTIAL.findall(" ".join(row[0] for row in plan))


async def test_queue_tables_carry_their_autovacuum_settings(postgres_url: str) -> None:
    """Migration 0008: vacuum the queue tables early, the heads table every 1,000 dead versions."""
    db = Database.open(postgres_url)
    try:
        await migrations.upgrade(db)
        async with db.connect() as conn:
            query = text("SELECT relname, reloptions FROM pg_class WHERE relname LIKE 'chatflow_%'")
            options = {name: reloptions for name, reloptions in await conn.execute(query)}
    finally:
        await db.aclose()
    assert "autovacuum_vacuum_scale_factor=0.01" in options["chatflow_inbox"]
    assert "autovacuum_vacuum_scale_factor=0.01" in options["chatflow_outbox"]
    assert "autovacuum_vacuum_scale_factor=0.01" in options["chatflow_processed_messages"]
    assert {"autovacuum_vacuum_threshold=1000", "fillfactor=70"} <= set(options["chatflow_queue_heads"])


# Statistics taken while the queue was drained (5 rows pending), then a burst stored: the state a
# queue's statistics are usually in. Statements that name one conversation's pending rows, or rows by
# id, must not walk every pending entry on the strength of "few are pending" (migration 0012): under a
# held snapshot those entries include every row version written meanwhile.
STALE_STATISTICS = [
    "INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, message_json, "
    "status, attempts, next_attempt_at, received_at) "
    "SELECT 'telegram:k' || n, 'telegram', 'telegram:' || (n % 500), n, 'text', 'hi', '{}', "
    "CASE WHEN n > 19995 THEN 'pending' ELSE 'done' END, 0, now(), now() FROM generate_series(1, 20000) AS n",
    "ANALYZE chatflow_inbox",
    "INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, message_json, "
    "status, attempts, next_attempt_at, received_at) "
    "SELECT 'telegram:b' || n, 'telegram', 'telegram:' || (n % 500), n, 'text', 'hi', '{}', 'pending', 0, "
    "now(), now() FROM generate_series(1, 5000) AS n",
]
PER_CONVERSATION = {
    # The queue-head triggers' look-up of a conversation's oldest pending row (migration 0007).
    "oldest": (
        "text",
        "SELECT p.id FROM chatflow_inbox AS p WHERE p.session_id = $1 AND p.status = 'pending' "
        "ORDER BY p.id LIMIT 1",
        "'telegram:7'",
    ),
    # A lease renewal's rows, by id (store/leases.py).
    "renewal": (
        "bigint, bigint, text",
        "SELECT id FROM chatflow_inbox WHERE id IN ($1, $2) AND lease_owner = $3 "
        "AND coalesce(status, '') = 'pending'",
        "20001, 20002, 'w'",
    ),
}


async def test_pending_rows_are_not_walked_on_stale_statistics(postgres_url: str) -> None:
    db = Database.open(postgres_url)
    try:
        await migrations.upgrade(db)
        async with db.begin() as conn:
            for statement in STALE_STATISTICS:
                await conn.execute(text(statement))
        async with db.connect() as conn:
            await conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")  # as cached plans are
            for name, (types, statement, arguments) in PER_CONVERSATION.items():
                await conn.exec_driver_sql(f"PREPARE {name}({types}) AS {statement}")
                explained = await conn.exec_driver_sql(f"EXPLAIN EXECUTE {name}({arguments})")
                plan = " ".join(row[0] for row in explained)
                assert "ix_chatflow_inbox_status_id" not in plan, (name, plan)
                assert "Index Cond" in plan, (name, plan)
    finally:
        await db.aclose()
