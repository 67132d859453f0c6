"""Scale-out proof: three `gateway serve` replicas on one PostgreSQL database.

5,000 webhook deliveries for 200 conversations are posted to random replicas: 4,000 distinct messages
(20 per conversation) and 1,000 duplicates (20 % of the deliveries: a quarter of the messages, drawn at
random, delivered a second time at the same moment to another replica, or after the 200 to another
replica or to the same one). A conversation's messages are posted in order, each after the previous 200,
and different conversations at once, as the platforms deliver them. Then every distinct message must
have exactly one committed turn (one inbox row `done`, one user message in its session, in order) and
exactly one reply at the fake Bot API, the replies of a conversation in the order of its messages.

The crash variant SIGKILLs one replica when 40 % of the messages are acknowledged and restarts it
at once: the same must hold, and every conversation must be answered within 60 s of the kill (the
reliability issue's contract). Deliveries to the dead replica are refused and posted again to
another one, as a load balancer or the platform's retry would.

Replies name the message they answer: the demo agent answers "Where is order n?" with "I couldn't find
order n. ..." (tests/faultkit.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, OutboxRow
from tests.faultkit import (
    DatabaseCounts,
    Driver,
    FakeBotAPI,
    GatewayProcess,
    Message,
    clean_env,
    conversations,
    database_counts,
    gateway_settings,
    migrate,
    run_sync,
    stopping,
    wait_answered,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres]

REPLICAS = 3
CONVERSATIONS = 200
PER_CONVERSATION = 20  # under max_turns (40): no turn is pruned, so every user message can be counted
DUPLICATES = 1_000  # 20 % of the 5,000 deliveries
KILL_AT_ACKED = 0.4
ANSWERED_WITHIN_KILL = 60.0  # the contract
DRAIN_TIMEOUT = 180.0  # after the last 200, for every reply (generous: a 2-core machine, shared)
CHAT_BASE = 600_000_000
ORDER_BASE = 1_000_000


@dataclass
class Run:
    driver: Driver
    platform: FakeBotAPI
    chats: list[list[Message]]
    counts: DatabaseCounts
    exit_codes: list[int | None]
    started: float
    last_ack: float
    kill_at: float | None = None
    acked_before_kill: frozenset[int] = frozenset()
    held_by_killed: tuple[int, int] = (0, 0)  # inbox, outbox rows leased to the killed process


async def leased_to(url: str, owner_prefix: str) -> tuple[int, int]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            counts = []
            for table in (InboxRow, OutboxRow):
                statement = select(func.count()).where(
                    table.status == "pending", table.lease_owner.startswith(owner_prefix)
                )
                counts.append(int((await conn.execute(statement)).scalar_one()))
            return counts[0], counts[1]
    finally:
        await engine.dispose()


def scale_out(tmp_path: Path, url: str, *, crash: bool) -> Run:
    platform = FakeBotAPI()
    migrate(url, tmp_path)  # a step of its own; the replicas start with --no-migrate
    env = clean_env(**gateway_settings(url, platform.api_base))
    replicas = [GatewayProcess(f"replica{i}", tmp_path / f"replica{i}", env) for i in range(REPLICAS)]
    chats = conversations(CONVERSATIONS, PER_CONVERSATION, chat_base=CHAT_BASE, order_base=ORDER_BASE)
    total = CONVERSATIONS * PER_CONVERSATION
    with stopping(platform.close, *(replica.kill for replica in replicas)):
        for replica in replicas:
            replica.start(wait=False)
        for replica in replicas:
            replica.wait_ready()
        orders = [m.order for chat in chats for m in chat]
        duplicated = frozenset(random.Random(7).sample(orders, min(DUPLICATES, len(orders))))
        driver = Driver([replica.url for replica in replicas], duplicated=duplicated)
        run = Run(driver, platform, chats, DatabaseCounts({}, {}, set(), {}, {}), [], 0.0, 0.0)

        async def kill_one_midway() -> None:
            victim = replicas[0]
            await driver.until_acked(int(total * KILL_AT_ACKED))
            assert victim.process is not None
            pid = victim.process.pid
            run.acked_before_kill = frozenset(driver.acked_at)
            victim.kill()
            run.kill_at = time.monotonic()
            run.held_by_killed = await leased_to(url, victim.owner_prefix(pid))
            await asyncio.to_thread(victim.start)

        async def post_everything() -> None:
            driver.give_up_at = time.monotonic() + 600
            try:
                await asyncio.gather(driver.run(chats), *([kill_one_midway()] if crash else []))
            finally:
                await driver.aclose()

        run.started = time.monotonic()
        asyncio.run(post_everything())
        run.last_ack = max(driver.acked_at.values(), default=run.started)
        posted = [m.order for chat in chats for m in chat]
        assert set(driver.acked_at) == set(posted), "every message is acknowledged in the end"

        if crash:
            assert run.kill_at is not None
            wait_answered(
                platform, run.acked_before_kill, run.kill_at + ANSWERED_WITHIN_KILL - time.monotonic()
            )
            got = {reply.order for reply in list(platform.replies)}
            waiting = {m.chat_id for chat in chats for m in chat if m.order in run.acked_before_kill - got}
            assert not waiting, (
                f"{len(waiting)} conversations had no answer {ANSWERED_WITHIN_KILL:g}s after the SIGKILL "
                f"(the killed replica held {run.held_by_killed[0]} inbox and {run.held_by_killed[1]} "
                "outbox rows)"
            )
        wait_answered(platform, posted, run.last_ack + DRAIN_TIMEOUT - time.monotonic())
        run.exit_codes = [replica.stop() for replica in replicas]
    run.counts = run_sync(database_counts(url, [chat[0].chat_id for chat in chats]))
    return run


def check_exactly_once_in_order(run: Run) -> None:
    total = CONVERSATIONS * PER_CONVERSATION
    expected = {str(chat[0].chat_id): [m.order for m in chat] for chat in run.chats}
    per_chat = run.platform.per_chat()
    missing = sum(len(set(orders) - set(per_chat.get(chat, []))) for chat, orders in expected.items())
    replies = sum(len(per_chat.get(chat, [])) for chat in expected)
    assert missing == 0, f"{missing} messages got no reply"
    assert replies == total, f"{replies - total} replies beyond one per message"
    wrong = [chat for chat, orders in expected.items() if per_chat.get(chat) != orders]
    assert not wrong, f"{len(wrong)} conversations' replies came out of order, e.g. {wrong[0]}"
    assert run.counts.inbox == {"done": total}
    assert run.counts.outbox == {"sent": total}
    assert all(run.counts.turns.get(order) == 1 for orders in expected.values() for order in orders)
    sessions = {chat: run.counts.session_orders.get(f"telegram:{chat}") for chat in expected}
    assert sessions == expected, "each session holds its messages once, in arrival order"
    assert run.exit_codes == [0] * REPLICAS, "every replica drains and exits 0 on SIGTERM"


def summary(run: Run) -> str:
    last_reply = max(r.at for r in run.platform.replies)
    statuses = run.driver.statuses()
    duplicates = sum(1 for d in run.driver.deliveries if d.kind == "duplicate")
    text = (
        f"{len(run.driver.deliveries)} deliveries ({duplicates} duplicates, statuses {statuses}); "
        f"acks done at {run.last_ack - run.started:.1f}s, last reply at {last_reply - run.started:.1f}s"
    )
    if run.kill_at is not None:
        late = max(r.at for r in run.platform.replies if r.order in run.acked_before_kill)
        text += (
            f"; SIGKILL at {run.kill_at - run.started:.1f}s holding {run.held_by_killed} inbox/outbox "
            f"rows, every message acked before it answered {late - run.kill_at:.1f}s after it"
        )
    return text


def test_three_replicas_answer_every_message_exactly_once_in_order(tmp_path: Path, postgres_url: str) -> None:
    run = scale_out(tmp_path, postgres_url, crash=False)
    print(summary(run))
    new_total = sum(d.new or 0 for d in run.driver.deliveries)
    assert new_total == CONVERSATIONS * PER_CONVERSATION, "each message is new to exactly one delivery"
    check_exactly_once_in_order(run)


def test_a_replica_killed_mid_run_loses_nothing_and_stalls_no_conversation(
    tmp_path: Path, postgres_url: str
) -> None:
    run = scale_out(tmp_path, postgres_url, crash=True)
    print(summary(run))
    check_exactly_once_in_order(run)
