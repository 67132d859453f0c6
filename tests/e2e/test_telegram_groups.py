"""Telegram groups through the real `gateway serve`: the bot learns its username from getMe at
start-up, and answers a group message addressed to it by @mention, by a reply to it, by
/command@bot, and in a forum topic, quoting it; a message for someone else is only recorded.

The Bot API is a fake on loopback (tests/fakes.py) whose getMe fails once before it answers, so the
start-up retry is part of the path. The agent is the demo desk: "order <n>" is answered naming n.
"""

from __future__ import annotations

import json
import sqlite3
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.agents import Runner, SessionStore
from gateway.demo import agent as demo_agent
from tests.fakes import FakeTelegram
from tests.helpers import serve_in_thread, wait_until
from tests.serve_process import ServeProcess, serve_process

pytestmark = pytest.mark.e2e

BOT_ID = 6100200300
BOT_TOKEN = f"{BOT_ID}:groups-e2e-token"
BOT_USERNAME = "AcmeDeskBot"
SECRET = "groups-e2e-secret"
DEADLINE = 90  # seconds; conditions decide, not the clock


def answer(text: str) -> str:
    """What the demo desk answers to `text` as the first message of a conversation."""
    content = Runner(demo_agent, SessionStore()).run("expected", text).content
    assert content
    return content


def group_message(
    update_id: int, chat_id: int, text: str, entities: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id % 1000,
            "from": {"id": 501, "is_bot": False, "first_name": "Ann", "language_code": "en"},
            "chat": {"id": chat_id, "title": "Acme customers", "type": "supergroup"},
            "date": 1767225600,
            "text": text,
            "entities": entities,
            **extra,
        },
    }


def mention(text: str, offset: int = 0) -> list[dict[str, Any]]:
    return [{"type": "mention", "offset": offset, "length": 1 + len(BOT_USERNAME)}]


def post(served: ServeProcess, update: dict[str, Any]) -> httpx.Response:
    headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET, "Content-Type": "application/json"}
    return httpx.post(f"{served.base}/webhooks/telegram", content=json.dumps(update), headers=headers)


def inbox_status(db: Path, dedup_key: str) -> str:
    with sqlite3.connect(db) as conn:
        [(status,)] = conn.execute("SELECT status FROM chatflow_inbox WHERE dedup_key = ?", (dedup_key,))
    return str(status)


@pytest.fixture
def bot_api() -> Iterator[tuple[FakeTelegram, str]]:
    fake = FakeTelegram(BOT_TOKEN, username=BOT_USERNAME)
    fake.results["sendMessage"] = {"message_id": 1, "date": 1767225601, "chat": {"id": 0, "type": "group"}}
    with serve_in_thread(fake.app) as base:
        yield fake, base


def gateway_settings(tmp_path: Path, api_base: str, **extra: str) -> dict[str, str]:
    return {
        "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
        "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
        "GATEWAY_TELEGRAM_API_BASE": api_base,
        "GATEWAY_TELEGRAM_CHAT_PER_SECOND": "0",
        "GATEWAY_TELEGRAM_GROUP_PER_MINUTE": "0",
        "GATEWAY_TELEGRAM_GLOBAL_PER_SECOND": "0",
        "GATEWAY_LOCAL_KEY_FILE": "",
        **extra,
    }


def test_group_round_trips_after_get_me_at_start_up(
    tmp_path: Path, bot_api: tuple[FakeTelegram, str]
) -> None:
    fake, base = bot_api
    fake.answers_once["getMe"] = deque(
        [(502, {"ok": False, "error_code": 502, "description": "Bad Gateway"})]
    )
    bot = {"id": BOT_ID, "is_bot": True, "first_name": "Acme desk", "username": BOT_USERNAME}
    by_mention = group_message(
        900001, -1001000000001, f"@{BOT_USERNAME} order 7101", mention(f"@{BOT_USERNAME}")
    )
    by_reply = group_message(
        900002,
        -1001000000002,
        "and order 7102?",
        [],
        reply_to_message={
            "message_id": 40,
            "from": bot,
            "chat": {"id": -1001000000002, "type": "supergroup", "title": "Acme customers"},
            "date": 1767225500,
            "text": "Hi! How can I help?",
        },
    )
    command = f"/order@{BOT_USERNAME}"
    by_command = group_message(
        900003,
        -1001000000003,
        f"{command} 7103",
        [{"type": "bot_command", "offset": 0, "length": len(command)}],
    )
    in_topic = group_message(
        900004,
        -1001000000004,
        f"🙂 @{BOT_USERNAME.lower()}, order 7104",
        [{"type": "mention", "offset": 3, "length": 1 + len(BOT_USERNAME)}],  # UTF-16 offsets
        message_thread_id=77,
        is_topic_message=True,
    )
    for_someone_else = group_message(
        900005, -1001000000005, "@OtherShopBot order 7105", [{"type": "mention", "offset": 0, "length": 13}]
    )
    other_command = group_message(
        900006,
        -1001000000005,
        "/order@OtherShopBot 7106",
        [{"type": "bot_command", "offset": 0, "length": 19}],
    )
    settings = gateway_settings(tmp_path, base)
    with serve_process(tmp_path, **settings) as served:  # type: ignore[arg-type]

        def identity_known() -> dict[str, Any] | None:
            return next((e for e in served.events() if e["event"] == "telegram_bot_identity"), None)

        learned = wait_until(identity_known, "telegram_bot_identity in the log", DEADLINE)
        assert (learned["bot_username"], learned["source"]) == (BOT_USERNAME, "getMe")
        [failed] = [e for e in served.events() if e["event"] == "telegram_get_me_failed"]
        assert (failed["attempt"], failed["code"], failed["level"]) == (1, 502, "warning")

        for update in (for_someone_else, other_command, by_mention, by_reply, by_command, in_topic):
            response = post(served, update)
            assert (response.status_code, response.json()["new"]) == (200, 1)

        def four_replies() -> list[Any] | None:
            calls = fake.calls("sendMessage")
            return calls if len(calls) >= 4 else None

        sent = wait_until(four_replies, "four replies at the fake Bot API", DEADLINE)
        db = tmp_path / "gateway.db"
        assert inbox_status(db, f"tg:{BOT_ID}:900005") == "recorded"
        assert inbox_status(db, f"tg:{BOT_ID}:900006") == "recorded"
        log_text = served.log.read_text()
    by_chat = {int(call["chat_id"]): call for call in sent}  # chat ids travel as strings
    assert set(by_chat) == {-1001000000001, -1001000000002, -1001000000003, -1001000000004}
    assert len(sent) == 4  # nothing for the messages addressed to another bot
    for chat_id, update_id, order in [
        (-1001000000001, 900001, 7101),
        (-1001000000002, 900002, 7102),
        (-1001000000003, 900003, 7103),
        (-1001000000004, 900004, 7104),
    ]:
        call = by_chat[chat_id]
        assert call["text"] == answer(f"order {order}")
        # A group reply quotes the message it answers.
        assert call["reply_parameters"] == {
            "message_id": update_id % 1000,
            "allow_sending_without_reply": True,
        }
    assert by_chat[-1001000000004]["message_thread_id"] == 77
    assert "message_thread_id" not in by_chat[-1001000000001]
    assert BOT_TOKEN not in log_text
    assert "order 7101" not in log_text  # message text never reaches the log


def test_the_setting_stands_in_where_the_bot_api_is_unreachable_at_start(
    tmp_path: Path, bot_api: tuple[FakeTelegram, str]
) -> None:
    fake, base = bot_api
    fake.errors["getMe"] = (500, {"error_code": 500, "description": "Internal Server Error"})
    settings = gateway_settings(tmp_path, base, GATEWAY_TELEGRAM_BOT_USERNAME=f"@{BOT_USERNAME}")
    update = group_message(910001, -1001000000011, f"@{BOT_USERNAME} order 7111", mention(f"@{BOT_USERNAME}"))
    with serve_process(tmp_path, **settings) as served:  # type: ignore[arg-type]
        assert post(served, update).status_code == 200
        [call] = wait_until(lambda: fake.calls("sendMessage"), "the reply at the fake Bot API", DEADLINE)
        events = served.events()
    assert call["text"] == answer("order 7111")
    assert fake.calls("getMe") == []
    [learned] = [e for e in events if e["event"] == "telegram_bot_identity"]
    assert (learned["bot_username"], learned["source"]) == (BOT_USERNAME, "settings")
