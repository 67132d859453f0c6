"""The bot's username from getMe, against a fake Bot API on loopback: retried while it fails, asked
again when a group message names a bot we do not know, and the setting that stands in for it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from gateway.bootstrap import build_services
from gateway.domain.inbound import starts_turn
from gateway.platforms.telegram.adapter import TelegramAdapter
from gateway.platforms.telegram.api import TelegramAPI
from gateway.platforms.telegram.identity import BotIdentity, keep_identity
from gateway.platforms.telegram.spec import TelegramSettings, learn_identity
from tests.fakes import FakeTelegram
from tests.helpers import free_port, gateway_settings, serve_in_thread

TOKEN = "7012345678:identity-test-token"
SECRET = "identity-secret"
TIMEOUT = 30  # a deadline for the awaited events, not a pause


def group_update(update_id: int, text: str, entity: dict[str, object]) -> dict[str, object]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "from": {"id": 42, "is_bot": False, "first_name": "Ann"},
            "chat": {"id": -100123, "type": "supergroup", "title": "Shop"},
            "date": 1767225600,
            "text": text,
            "entities": [entity],
        },
    }


def mention(text: str) -> dict[str, object]:
    return group_update(1, text, {"type": "mention", "offset": 0, "length": text.index(" ")})


@pytest.fixture
async def bot_api() -> AsyncIterator[tuple[FakeTelegram, TelegramAPI]]:
    fake = FakeTelegram(TOKEN, username="Shop_Helper_bot")
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            yield fake, TelegramAPI(TOKEN, base, http)


async def run_until_learned(identity: BotIdentity, work: asyncio.Task[None]) -> None:
    try:
        await asyncio.wait_for(identity.learned.wait(), TIMEOUT)
    finally:
        identity.learned.clear()
    assert not work.done()  # it keeps watching for a reason to ask again


async def test_get_me_is_retried_until_the_bot_api_answers(
    bot_api: tuple[FakeTelegram, TelegramAPI],
) -> None:
    fake, api = bot_api
    fake.answers_once["getMe"] = deque(
        [
            (502, {"ok": False, "error_code": 502, "description": "Bad Gateway"}),
            (429, {"ok": False, "error_code": 429, "description": "Too Many Requests"}),
        ]
    )
    identity = BotIdentity()
    adapter = TelegramAdapter(SECRET, "7012345678", identity)
    before = adapter.parse(mention("@Shop_Helper_bot are you open?"))
    assert not starts_turn(before.messages[0])  # unknown yet: recorded, not answered

    with capture_logs() as logs:
        work = asyncio.create_task(keep_identity(api, identity, first_retry_seconds=0.01))
        try:
            await run_until_learned(identity, work)
        finally:
            work.cancel()
    assert len(fake.calls("getMe")) == 3
    assert identity.username == "shop_helper_bot"
    failed = [e for e in logs if e["event"] == "telegram_get_me_failed"]
    assert [(e["attempt"], e["code"], e["log_level"]) for e in failed] == [
        (1, 502, "warning"),
        (2, 429, "warning"),
    ]
    [learned] = [e for e in logs if e["event"] == "telegram_bot_identity"]
    assert (learned["bot_username"], learned["source"], learned["log_level"]) == (
        "Shop_Helper_bot",
        "getMe",
        "info",
    )
    assert learned["reads_all_group_messages"] is False
    assert TOKEN not in str(logs)

    after = adapter.parse(mention("@shop_helper_BOT are you open?"))
    assert starts_turn(after.messages[0])
    assert after.messages[0].text == "are you open?"


async def test_an_answer_without_a_username_is_a_failure_too(
    bot_api: tuple[FakeTelegram, TelegramAPI],
) -> None:
    fake, api = bot_api
    fake.answers_once["getMe"] = deque(
        [
            (200, {"ok": True, "result": True}),  # what a Bot API stand-in answers to every method
            (200, {"ok": True, "result": {"id": 7012345678, "is_bot": True, "first_name": "Shop"}}),
        ]
    )
    identity = BotIdentity()
    with capture_logs() as logs:
        work = asyncio.create_task(keep_identity(api, identity, first_retry_seconds=0.01))
        try:
            await run_until_learned(identity, work)
        finally:
            work.cancel()
    assert len(fake.calls("getMe")) == 3
    assert identity.username == "shop_helper_bot"
    failed = [e for e in logs if e["event"] == "telegram_get_me_failed"]
    assert [e["error"] for e in failed] == ["the answer names no bot username"] * 2


async def test_a_bot_we_do_not_know_asks_get_me_again(bot_api: tuple[FakeTelegram, TelegramAPI]) -> None:
    """The bot was renamed (a collectible username moved to it): the next group message naming a bot
    that is not the known one makes the gateway ask getMe again, and later mentions are answered."""
    fake, api = bot_api
    identity = BotIdentity()
    adapter = TelegramAdapter(SECRET, "7012345678", identity)
    work = asyncio.create_task(keep_identity(api, identity, min_refresh_seconds=0))
    try:
        await run_until_learned(identity, work)
        adapter.parse(mention("@alice hi"))  # a person, not a bot: no reason to ask
        assert len(fake.calls("getMe")) == 1
        fake.results["getMe"] = {**fake.results["getMe"], "username": "ShopRenamedBot"}
        missed = adapter.parse(mention("@ShopRenamedBot open today?"))
        assert not starts_turn(missed.messages[0])
        await run_until_learned(identity, work)
        assert len(fake.calls("getMe")) == 2
        assert identity.username == "shoprenamedbot"
        again = adapter.parse(mention("@ShopRenamedBot open today?"))
        assert starts_turn(again.messages[0])
        command = adapter.parse(
            group_update(2, "/hours@ShopRenamedBot", {"type": "bot_command", "offset": 0, "length": 21})
        )
        assert starts_turn(command.messages[0])
        assert command.messages[0].text == "/hours"
    finally:
        work.cancel()


async def test_the_setting_names_the_bot_and_get_me_is_not_asked() -> None:
    fake = FakeTelegram(TOKEN)
    with serve_in_thread(fake.app) as base:
        settings = TelegramSettings(
            secret_token=SECRET, bot_token=TOKEN, api_base=base, bot_username="@Shop_Helper_bot"
        )
        adapter = TelegramAdapter(SECRET, settings.bot_id, settings.bot_username)
        async with httpx.AsyncClient() as http:
            with capture_logs() as logs:
                await learn_identity(settings, adapter, http)  # returns at once: nothing to learn
    assert fake.calls("getMe") == []
    assert [(e["event"], e["source"]) for e in logs] == [("telegram_bot_identity", "settings")]
    assert starts_turn(adapter.parse(mention("@shop_helper_bot hours?")).messages[0])


async def test_without_a_token_or_a_username_the_log_says_what_is_lost() -> None:
    settings = TelegramSettings(secret_token=SECRET, api_base=f"http://127.0.0.1:{free_port()}")
    adapter = TelegramAdapter(SECRET, settings.bot_id)
    async with httpx.AsyncClient() as http:
        with capture_logs() as logs:
            await learn_identity(settings, adapter, http)
    [event] = logs
    assert (event["event"], event["log_level"]) == ("telegram_bot_username_unknown", "warning")
    assert "GATEWAY_TELEGRAM_BOT_USERNAME" in event["fix_with"]


@pytest.mark.parametrize("name", ["shop", "@shop_helper", "shop helper bot", "x" * 30 + "_bot", "robot!"])
def test_the_setting_must_be_a_bots_username(name: str) -> None:
    with pytest.raises(ValidationError, match="bot's username"):
        TelegramSettings(bot_username=name)


async def test_gateway_serve_learns_the_username_and_gateway_worker_does_not_ask(migrated_url: str) -> None:
    fake = FakeTelegram(TOKEN, username="Shop_Helper_bot")
    with serve_in_thread(fake.app) as base:
        settings = gateway_settings(
            database_url=migrated_url,
            telegram_secret_token=SECRET,
            telegram_bot_token=TOKEN,
            telegram_api_base=base,
        )
        worker = build_services(settings)
        try:
            await worker.start(webhooks=False)  # `gateway worker`: no webhooks, so no username needed
            assert "telegram-background" not in {task.get_name() for task in worker.tasks}
        finally:
            await worker.aclose()
        serving = build_services(settings)
        try:
            await serving.start()
            adapter = serving.platforms["telegram"].adapter
            assert isinstance(adapter, TelegramAdapter)
            await asyncio.wait_for(adapter.identity.learned.wait(), TIMEOUT)
            assert adapter.identity.username == "shop_helper_bot"
        finally:
            await serving.aclose()
    assert len(fake.calls("getMe")) == 1
