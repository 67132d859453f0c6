"""Delivery of outbox rows to fake Telegram and WhatsApp APIs, and the whole path from a webhook."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.app import create_app
from gateway.domain.outbound import OutboundMessage, ReplyTarget
from gateway.platforms.telegram.api import TelegramAPI, TelegramSender
from gateway.platforms.whatsapp.api import WhatsAppSender
from gateway.store import migrations
from gateway.store.database import Database
from gateway.store.engine import create_engine
from gateway.store.tables import OutboxRow
from gateway.worker.outbound import OutboxDelivery
from tests.fakes import FakeTelegram, FakeWhatsApp
from tests.helpers import gateway_settings, serve_in_thread

TOKEN = "123456:fake-token"
PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"


@pytest.fixture
async def migrated(database: Database) -> Database:
    await migrations.upgrade(database)
    return database


async def add_outbox(
    engine: AsyncEngine | Database, platform: str, target: dict[str, Any], text: str = "hi"
) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(OutboxRow).values(
                platform=platform,
                session_id=f"{platform}:1",
                kind="text",
                text=text,
                target_json=target,
                status="pending",
                attempts=0,
                next_attempt_at=now,
                created_at=now,
                updated_at=now,
            )
        )


async def outbox(engine: AsyncEngine | Database) -> list[Any]:
    async with engine.connect() as conn:
        query = select(
            OutboxRow.status, OutboxRow.platform_message_id, OutboxRow.error_code, OutboxRow.attempts
        )
        return list(await conn.execute(query.order_by(OutboxRow.id)))


async def test_telegram_send_retry_and_permanent_failure(migrated: Database) -> None:
    fake = FakeTelegram(TOKEN)
    fake.results["sendMessage"] = {"message_id": 77}
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, base, http))})
            await add_outbox(migrated, "telegram", {"chat_id": "42", "thread_id": "7"})
            fake.errors["sendMessage"] = (
                429,
                {"error_code": 429, "description": "Too Many Requests", "parameters": {"retry_after": 3}},
            )
            assert await delivery.run_until_idle() == 1
            (status, message_id, code, attempts) = (await outbox(migrated))[0]
            assert (status, message_id, code, attempts) == ("pending", None, "429", 1)
            assert await delivery.run_until_idle() == 0  # waits the platform's retry_after
            del fake.errors["sendMessage"]
            async with migrated.begin() as conn:  # time moves on
                await conn.execute(update(OutboxRow).values(next_attempt_at=datetime.now(UTC)))
            assert await delivery.run_until_idle() == 1
            assert (await outbox(migrated))[0][:2] == ("sent", "77")
            await add_outbox(migrated, "telegram", {"chat_id": "43"})
            fake.errors["sendMessage"] = (
                403,
                {"error_code": 403, "description": "Forbidden: bot was blocked by the user"},
            )
            assert await delivery.run_until_idle() == 1
    assert (await outbox(migrated))[1][0] == "failed"
    assert (await outbox(migrated))[1][2] == "403"
    sent = fake.calls("sendMessage")
    assert sent[0] == {"chat_id": "42", "text": "hi", "message_thread_id": 7}


async def test_whatsapp_sends_to_the_phone_or_the_business_scoped_id(migrated: Database) -> None:
    fake = FakeWhatsApp()
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"whatsapp": WhatsAppSender(base, "wa-token", http)})
            await add_outbox(
                migrated, "whatsapp", {"scope": "1065", "phone": "15551234567", "user_id": "US.1"}
            )
            await add_outbox(migrated, "whatsapp", {"scope": "1065", "phone": None, "user_id": "US.2"})
            fake.errors.append((400, {"code": 131047, "message": "Re-engagement message"}))
            assert await delivery.run_until_idle() == 2
    first, second = fake.requests
    assert first.path == "/1065/messages"
    assert first.headers["authorization"] == "Bearer wa-token"
    assert first.json["to"] == "15551234567"
    assert second.json["recipient"] == "US.2"
    assert "to" not in second.json
    rows = await outbox(migrated)
    assert rows[0][:3] == ("failed", None, "131047")  # outside the 24-hour window: not retried
    assert rows[1][:2] == ("sent", "wamid.out2")


async def test_without_a_token_replies_are_dry_run(migrated: Database) -> None:
    await add_outbox(migrated, "whatsapp", {"scope": "1065", "phone": "1"})
    assert await OutboxDelivery(migrated, {}).run_until_idle() == 1
    assert (await outbox(migrated))[0][0] == "dry_run"


TELEGRAM_TEXT = (PAYLOADS / "telegram" / "private_text.json").read_bytes()


def telegram_round_trip(database_url: str, **settings: Any) -> FakeTelegram:
    """One Telegram text webhook to a gateway on `database_url`; the fake Bot API once the reply is in."""

    async def migrate() -> None:
        engine = create_engine(database_url)
        await migrations.upgrade(engine)
        await engine.dispose()

    asyncio.run(migrate())
    fake = FakeTelegram(TOKEN)
    fake.results["sendMessage"] = {"message_id": 1}
    with serve_in_thread(fake.app) as telegram_base:
        config = gateway_settings(
            database_url=database_url,
            telegram_secret_token="s3cret",
            telegram_bot_token=TOKEN,
            telegram_api_base=telegram_base,
            **settings,
        )
        with serve_in_thread(create_app(config)) as gateway:
            headers = {"X-Telegram-Bot-Api-Secret-Token": "s3cret", "Content-Type": "application/json"}
            response = httpx.post(f"{gateway}/webhooks/telegram", content=TELEGRAM_TEXT, headers=headers)
            assert response.status_code == 200
            deadline = time.monotonic() + 30
            while not fake.calls("sendMessage") and time.monotonic() < deadline:
                time.sleep(0.05)  # the turn and the delivery run after the ack, in the background
    return fake


def test_the_whole_path_from_telegram_webhook_to_a_reply_at_the_fake_platform(database_url: str) -> None:
    fake = telegram_round_trip(database_url)
    (reply,) = fake.calls("sendMessage")
    assert str(reply["chat_id"]) in TELEGRAM_TEXT.decode()
    assert reply["text"]  # the demo agent's answer
    assert fake.calls("sendChatAction") == []  # the typing indicator is off by default


def test_with_the_typing_indicator_the_chat_sees_typing_while_the_turn_runs(database_url: str) -> None:
    fake = telegram_round_trip(database_url, typing_indicator=True)
    chat_id = json.loads(TELEGRAM_TEXT)["message"]["chat"]["id"]
    assert fake.calls("sendChatAction") == [{"chat_id": str(chat_id), "action": "typing"}]
    replying = sorted(r.path for r in fake.requests if r.path != "getMe")  # getMe: the bot's username
    assert replying == ["sendChatAction", "sendMessage"]  # in either order


def test_whatsapp_statuses_move_the_sent_reply_forward_only(database_url: str) -> None:
    from gateway.platforms.whatsapp.adapter import WhatsAppAdapter

    async def prepare() -> None:
        engine = create_engine(database_url)
        await migrations.upgrade(engine)
        await add_outbox(engine, "whatsapp", {"scope": "1065"})
        async with engine.begin() as conn:
            await conn.execute(update(OutboxRow).values(status="sent", platform_message_id="wamid.OUT1"))
        await engine.dispose()

    async def status_now() -> tuple[Any, ...]:
        engine = create_engine(database_url)
        rows = await outbox(engine)
        await engine.dispose()
        return tuple(rows[0])

    def status_payload(status: str, **extra: Any) -> bytes:
        value = {
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": "15550001111", "phone_number_id": "1065"},
            "statuses": [
                {
                    "id": "wamid.OUT1",
                    "status": status,
                    "timestamp": "1764500000",
                    "recipient_id": "1555",
                    **extra,
                }
            ],
        }
        payload = {
            "object": "whatsapp_business_account",
            "entry": [{"id": "1", "changes": [{"field": "messages", "value": value}]}],
        }
        return json.dumps(payload).encode()

    asyncio.run(prepare())
    settings = gateway_settings(database_url=database_url, whatsapp_app_secret="app-secret")
    with serve_in_thread(create_app(settings)) as gateway:

        def post(body: bytes) -> None:
            headers = {"X-Hub-Signature-256": WhatsAppAdapter.sign("app-secret", body)}
            assert (
                httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=headers).status_code == 200
            )

        post(status_payload("read"))
        assert asyncio.run(status_now())[0] == "read"
        post(status_payload("delivered"))  # arrives late: must not undo "read"
        assert asyncio.run(status_now())[0] == "read"
        error = {"code": 131047, "title": "Re-engagement message"}
        post(status_payload("failed", errors=[error]))
    final = asyncio.run(status_now())
    assert final[0] == "failed"
    assert final[2] == "131047"


def test_a_bot_kicked_from_a_chat_sends_nothing_there_until_it_is_back(database_url: str) -> None:
    kicked = (PAYLOADS / "telegram" / "my_chat_member_kicked.json").read_bytes()
    member = (PAYLOADS / "telegram" / "my_chat_member_member.json").read_bytes()
    chat_id = str(json.loads(kicked)["my_chat_member"]["chat"]["id"])

    async def prepare() -> None:
        engine = create_engine(database_url)
        await migrations.upgrade(engine)
        await engine.dispose()

    async def deliver_one() -> str:
        database = Database.open(database_url)
        await add_outbox(database, "telegram", {"chat_id": chat_id})
        await OutboxDelivery(database, {}).run_until_idle()  # dry-run unless unreachable
        status = (await outbox(database))[-1][0]
        await database.aclose()
        return str(status)

    asyncio.run(prepare())
    settings = gateway_settings(database_url=database_url, telegram_secret_token="s3cret")
    headers = {"X-Telegram-Bot-Api-Secret-Token": "s3cret"}
    with serve_in_thread(create_app(settings)) as gateway:
        assert httpx.post(f"{gateway}/webhooks/telegram", content=kicked, headers=headers).status_code == 200
        assert asyncio.run(deliver_one()) == "failed"
        assert httpx.post(f"{gateway}/webhooks/telegram", content=member, headers=headers).status_code == 200
        assert asyncio.run(deliver_one()) == "dry_run"


async def test_telegram_replies_quote_the_message_in_groups_only(migrated: Database) -> None:
    fake = FakeTelegram(TOKEN)
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            delivery = OutboxDelivery(migrated, {"telegram": TelegramSender(TelegramAPI(TOKEN, base, http))})
            await add_outbox(
                migrated, "telegram", {"chat_id": "-100500", "reply_to": "-100500:31", "chat_type": "group"}
            )
            await add_outbox(migrated, "telegram", {"chat_id": "42", "reply_to": "42:7", "chat_type": None})
            assert await delivery.run_until_idle() == 2
    group, private = fake.calls("sendMessage")
    assert group["reply_parameters"] == {"message_id": 31, "allow_sending_without_reply": True}
    assert "reply_parameters" not in private


class RecordingSender:
    """A platform that accepts everything at once and signals when it got `expected` messages."""

    def __init__(self, expected: int) -> None:
        self.sent: dict[str, list[str | None]] = {}
        self.expected = expected
        self.all_sent = asyncio.Event()

    async def send(self, message: OutboundMessage) -> str | None:
        await asyncio.sleep(0)  # a network call suspends: let other sends interleave
        chat = self.sent.setdefault(message.target.chat_id, [])
        chat.append(message.text)
        if sum(len(texts) for texts in self.sent.values()) == self.expected:
            self.all_sent.set()
        return f"{message.target.chat_id}:{len(chat)}"

    async def indicate_typing(self, target: ReplyTarget) -> None:
        return None


async def test_the_delivery_loop_sends_every_row_once_in_order_per_conversation(
    migrated: Database,
) -> None:
    from gateway.agents import SQLSessionStore
    from gateway.store.tables import ChatRow

    store = SQLSessionStore(migrated)  # on an SQLite file, its writer thread serves the delivery too
    chats, per_chat = 12, 6
    for i in range(per_chat):
        for chat in range(chats):
            await add_outbox(migrated, "telegram", {"chat_id": str(chat)}, text=f"{chat}/{i}")
    async with migrated.begin() as conn:  # the bot was removed from chat 11
        await conn.execute(
            insert(ChatRow).values(
                platform="telegram",
                chat_id="11",
                reachable=False,
                membership="kicked",
                updated_at=datetime.now(UTC),
            )
        )
    sender = RecordingSender(expected=(chats - 1) * per_chat)
    delivery = OutboxDelivery(migrated, {"telegram": sender}, concurrency=4)
    running = asyncio.create_task(delivery.run())
    try:
        async with asyncio.timeout(60):
            await sender.all_sent.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)  # returns once every send is recorded
    await delivery.run_until_idle()  # the rest of the unreachable chat's rows, if any
    assert sender.sent == {str(c): [f"{c}/{i}" for i in range(per_chat)] for c in range(chats - 1)}
    async with migrated.connect() as conn:
        rows = list(
            await conn.execute(
                select(
                    OutboxRow.target_json,
                    OutboxRow.status,
                    OutboxRow.platform_message_id,
                    OutboxRow.error_code,
                )
            )
        )
    assert len(rows) == chats * per_chat
    for target, status, message_id, error in rows:
        if target["chat_id"] == "11":
            assert (status, message_id, error) == ("failed", None, "unreachable")
        else:
            assert status == "sent"
            assert message_id is not None
    assert len({message_id for _, _, message_id, _ in rows if message_id}) == (chats - 1) * per_chat
    await store.aclose()
