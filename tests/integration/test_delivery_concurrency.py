"""Replies in flight are bounded by GATEWAY_MAX_SENDS_IN_FLIGHT, not by a constant.

The finding: delivery sent at most 16 replies at once. A send waits for the platform's answer (0.1 to
0.3 s from most places) or for its chat's pacing slot (a Telegram chat's next reply, up to a second),
so 16 slots capped a process near 16 / answer time replies per second whatever the pacing allowed,
and sixteen chats with a second reply waiting held up every other chat's replies.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.bootstrap import build_delivery
from gateway.store import migrations
from gateway.store.database import Database
from tests.fakes import FakeTelegram
from tests.helpers import gateway_settings, serve_in_thread
from tests.integration.test_delivery import outbox
from tests.integration.test_leases import add_replies

TOKEN = "123456:fake-token"
CHATS = 40
ANSWER_SECONDS = 0.3  # the fake Bot API's answer time


async def deliver_all(database: Database, setting: dict[str, int], busy: bool = False) -> FakeTelegram:
    """Deliver one reply to each of CHATS chats through a Bot API answering in ANSWER_SECONDS, with
    `gateway serve`'s delivery (`busy`: webhooks flood the process throughout); the fake, afterwards."""
    await migrations.upgrade(database)
    await add_replies(database, CHATS)
    fake = FakeTelegram(TOKEN)
    fake.delay = ANSWER_SECONDS
    with serve_in_thread(fake.app) as base:
        settings = gateway_settings(
            telegram_bot_token=TOKEN,
            telegram_api_base=base,
            telegram_bot_username="fake_gateway_bot",
            telegram_global_per_second=0,  # unpaced overall: the setting alone bounds the sends
            **setting,
        )
        async with httpx.AsyncClient() as http:
            delivery = build_delivery(settings, database, http, busy=lambda: busy)
            assert delivery.concurrency == settings.max_sends_in_flight
            running = asyncio.create_task(delivery.run())
            try:
                assert await asyncio.to_thread(fake.wait_for_calls, "sendMessage", CHATS, 60)
                for _ in range(1200):  # then every answer is recorded (the database is polled: 60 s)
                    if [status for status, *_ in await outbox(database)] == ["sent"] * CHATS:
                        break
                    await asyncio.sleep(0.05)
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    assert sorted(call["chat_id"] for call in fake.calls("sendMessage")) == sorted(
        str(chat) for chat in range(CHATS)
    )
    assert [status for status, *_ in await outbox(database)] == ["sent"] * CHATS
    return fake


@pytest.mark.parametrize(("setting", "most"), [({}, CHATS), ({"max_sends_in_flight": 8}, 8)])
async def test_replies_to_many_chats_go_out_together_up_to_the_setting(
    database: Database, setting: dict[str, int], most: int
) -> None:
    fake = await deliver_all(database, setting)
    # Each private chat's first reply has its chat's slot at once: only the setting held sends back.
    assert fake.most_in_flight == most


async def test_a_webhook_flood_holds_new_sends_back_and_starves_none(database: Database) -> None:
    """The flood rule (webhooks waiting for their commit) applies to delivery as to turns: a few new
    sends at a time (BUSY_CLAIM_ROWS every BUSY_CLAIM_DELAY_SECONDS), acknowledgements first, and
    every reply still goes out. Without it, 256 sends in flight cost acks 0.86-0.93 of their rate
    without model traffic in benchmarks/webhooks.py --model-latency 1 (1.02-1.10 with it)."""
    fake = await deliver_all(database, {}, busy=True)
    assert fake.most_in_flight < CHATS // 2
