"""Delivery through outages: transient failures retried for a time budget, then `dead` and retryable.

The finding: delivery gave up after 8 attempts (2 to 4 minutes of backoff) and marked the reply `failed`
like a permanent refusal; nothing retried it and no operator could see it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import update

from gateway.platforms.telegram.api import TelegramAPI, TelegramSender
from gateway.store import migrations, outbox
from gateway.store.database import Database
from gateway.store.tables import OutboxRow
from gateway.worker.outbound import BACKOFF_CAP_SECONDS, OutboxDelivery, backoff_seconds
from tests.fakes import FakeTelegram
from tests.helpers import free_port, serve_in_thread
from tests.integration.test_delivery import add_outbox
from tests.integration.test_delivery import outbox as rows

TOKEN = "123456:fake-token"
UNAVAILABLE = (503, {"error_code": 503, "description": "Service Unavailable"})


@pytest.fixture
async def migrated(database: Database) -> Database:
    await migrations.upgrade(database)
    return database


async def time_moves_on(db: Database) -> None:
    """Make every waiting row due now, as if its backoff had passed."""
    async with db.begin() as conn:
        await conn.execute(update(OutboxRow).values(next_attempt_at=datetime.now(UTC)))


async def test_a_platform_down_for_many_attempts_still_gets_the_reply_when_it_is_back(
    migrated: Database,
) -> None:
    fake = FakeTelegram(TOKEN)
    fake.results["sendMessage"] = {"message_id": 9}
    fake.errors["sendMessage"] = UNAVAILABLE
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, base, http))})
            await add_outbox(migrated, "telegram", {"chat_id": "42"})
            for attempt in range(1, 13):  # more than the 8 attempts that used to end it
                assert await delivery.run_until_idle() == 1
                assert (await rows(migrated))[0] == ("pending", None, "503", attempt)
                await time_moves_on(migrated)
            del fake.errors["sendMessage"]
            assert await delivery.run_until_idle() == 1
    assert (await rows(migrated))[0][:2] == ("sent", "9")
    assert len(fake.calls("sendMessage")) == 13


async def test_after_the_budget_a_reply_is_dead_and_an_operator_can_send_it_again(
    migrated: Database,
) -> None:
    fake = FakeTelegram(TOKEN)
    fake.results["sendMessage"] = {"message_id": 10}
    fake.errors["sendMessage"] = UNAVAILABLE
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            # A budget shorter than the first backoff (at least 1 s): dead at its first failure.
            delivery = OutboxDelivery(migrated, {"telegram": sender}, retry_hours=0.5 / 3600)
            await add_outbox(migrated, "telegram", {"chat_id": "42"})
            assert await delivery.run_until_idle() == 1
            assert (await rows(migrated))[0][0] == "dead"
            [dead] = await outbox.list_items(migrated, status="dead")
            assert (dead.error_code, dead.attempts, dead.retry_until is not None) == ("503", 1, True)
            assert await outbox.list_items(migrated, status="pending") == []

            del fake.errors["sendMessage"]
            again = await outbox.requeue(migrated, dead.id)
            assert again is not None
            assert (again.status, again.attempts, again.retry_until) == ("pending", 0, None)
            assert await outbox.requeue(migrated, dead.id) is None  # only a dead or failed row
            assert await delivery.run_until_idle() == 1
    assert (await rows(migrated))[0][:2] == ("sent", "10")


async def test_a_permanent_refusal_fails_at_once_and_a_network_error_has_no_code(
    migrated: Database,
) -> None:
    async with httpx.AsyncClient() as http:
        nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
        delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, nowhere, http))})
        await add_outbox(migrated, "telegram", {"chat_id": "42"})
        assert await delivery.run_until_idle() == 1
    assert (await rows(migrated))[0] == ("pending", None, None, 1)  # not the text "None"

    fake = FakeTelegram(TOKEN)
    fake.errors["sendMessage"] = (403, {"error_code": 403, "description": "Forbidden: bot was blocked"})
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, base, http))})
            await time_moves_on(migrated)
            assert await delivery.run_until_idle() == 1
    assert (await rows(migrated))[0] == ("failed", None, "403", 2)
    assert [item.status for item in await outbox.list_items(migrated, status="failed")] == ["failed"]


@pytest.mark.parametrize("retry_after", [10**30, math.inf, math.nan, -5.0, 0.0, None], ids=str)
def test_a_platforms_retry_after_is_bounded(retry_after: float | None) -> None:
    """The finding: a huge retry_after raised OverflowError (and the row was sent again at every lease)."""
    delay = backoff_seconds(3, retry_after)
    assert 0 < delay <= BACKOFF_CAP_SECONDS


async def test_a_huge_retry_after_from_the_platform_waits_the_cap(migrated: Database) -> None:
    fake = FakeTelegram(TOKEN)
    fake.errors["sendMessage"] = (
        429,
        {"error_code": 429, "description": "Too Many Requests", "parameters": {"retry_after": 10**30}},
    )
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, base, http))})
            await add_outbox(migrated, "telegram", {"chat_id": "42"})
            assert await delivery.run_until_idle() == 1
    [item] = await outbox.list_items(migrated)
    assert item.status == "pending"
    wait = (item.next_attempt_at - item.updated_at).total_seconds()
    assert BACKOFF_CAP_SECONDS - 5 <= wait <= BACKOFF_CAP_SECONDS + 5
