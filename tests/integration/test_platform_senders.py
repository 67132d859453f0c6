"""The platform senders against fake Bot and Graph APIs on loopback: chat migration, typing indicators."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget, TelegramTarget, WhatsAppTarget
from gateway.platforms.base import DeliveryError, Sender
from gateway.platforms.telegram.api import TelegramAPI, TelegramAPIError, TelegramSender
from gateway.platforms.whatsapp.api import WhatsAppSender
from tests.fakes import FakeTelegram, FakeWhatsApp
from tests.helpers import free_port, serve_in_thread

TOKEN = "123456:fake-token"
WA_TOKEN = "wa-secret-token"
OLD_CHAT = "-4098765432"  # a basic group ...
NEW_CHAT = -1003344556677  # ... and the supergroup it became


def group_target(**extra: Any) -> TelegramTarget:
    """A reply target as the inbox worker builds it, for a reply in the old group."""
    fields: dict[str, Any] = {
        "chat_id": OLD_CHAT,
        "reply_to": f"{OLD_CHAT}:78",
        "chat_type": "group",
        **extra,
    }
    return TelegramTarget(**fields)


def whatsapp_target(**extra: Any) -> WhatsAppTarget:
    fields = {
        "chat_id": "US.1",
        "scope": "1065",
        "user_id": "US.1",
        "phone": "15551234567",
        "reply_to": "wamid.IN1",
    }
    return WhatsAppTarget(**{**fields, **extra})


def text(body: str, target: ReplyTarget) -> OutboundMessage:
    return OutboundMessage(target.platform, f"{target.platform}:1", OutboundKind.TEXT, target, body)


def callback_answer(query_id: str) -> OutboundMessage:
    """An answer to a pressed button, its target as the inbox worker stores it."""
    target = TelegramTarget.from_json({"id": query_id})
    return OutboundMessage("telegram", "telegram:1", OutboundKind.ANSWER_CALLBACK, target)


def unreachable_base() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# --- Telegram: a group upgraded to a supergroup ------------------------------------------------------


async def test_a_send_to_a_migrated_group_is_resent_once_to_the_supergroup() -> None:
    fake = FakeTelegram(TOKEN)
    fake.migrated[OLD_CHAT] = NEW_CHAT
    fake.results["sendMessage"] = {"message_id": 5, "chat": {"id": NEW_CHAT}}
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender: Sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            with capture_logs() as logs:
                assert await sender.send(text("hello", group_target())) == "5"
    first, resend = fake.calls("sendMessage")
    assert first == {
        "chat_id": OLD_CHAT,
        "text": "hello",
        "reply_parameters": {"message_id": 78, "allow_sending_without_reply": True},
    }
    # The quoted message belongs to the old chat: the resend does not point at it.
    assert resend == {"chat_id": NEW_CHAT, "text": "hello"}
    assert [e["event"] for e in logs] == ["telegram_chat_migrated"]
    assert logs[0]["new_chat_id"] == str(NEW_CHAT)
    assert TOKEN not in repr(logs)


async def test_a_failed_resend_is_a_delivery_error() -> None:
    fake = FakeTelegram(TOKEN)
    fake.migrated[OLD_CHAT] = NEW_CHAT
    fake.errors["sendMessage"] = (403, {"error_code": 403, "description": "Forbidden: bot was kicked"})
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            with pytest.raises(DeliveryError) as raised:
                await sender.send(text("hello", group_target()))
    assert raised.value.permanent
    assert raised.value.code == "403"
    assert [call["chat_id"] for call in fake.calls("sendMessage")] == [OLD_CHAT, NEW_CHAT]


async def test_a_resend_that_is_told_to_migrate_again_is_not_followed() -> None:
    fake = FakeTelegram(TOKEN)
    fake.migrated[OLD_CHAT] = NEW_CHAT
    fake.migrated[str(NEW_CHAT)] = NEW_CHAT - 1
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            with pytest.raises(DeliveryError) as raised:
                await sender.send(text("hello", group_target()))
    assert raised.value.permanent
    assert raised.value.code == "400"
    assert len(fake.calls("sendMessage")) == 2  # once to the old id, once to the new: no loop


async def test_the_resend_to_a_transiently_failing_supergroup_is_retried_later() -> None:
    fake = FakeTelegram(TOKEN)
    fake.migrated[OLD_CHAT] = NEW_CHAT
    fake.errors["sendMessage"] = (
        429,
        {"error_code": 429, "description": "Too Many Requests", "parameters": {"retry_after": 2}},
    )
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            with pytest.raises(DeliveryError) as raised:
                await sender.send(text("hello", group_target()))
    assert not raised.value.permanent
    assert raised.value.retry_after == 2


async def test_the_api_error_carries_migrate_to_chat_id() -> None:
    fake = FakeTelegram(TOKEN)
    fake.migrated[OLD_CHAT] = NEW_CHAT
    fake.errors["getChat"] = (400, {"error_code": 400, "description": "Bad Request: chat not found"})
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            api = TelegramAPI(TOKEN, base, http)
            with pytest.raises(TelegramAPIError) as raised:
                await api.call("sendMessage", chat_id=OLD_CHAT, text="x")
            assert raised.value.code == 400
            assert raised.value.migrate_to_chat_id == NEW_CHAT
            assert raised.value.retry_after is None
            with pytest.raises(TelegramAPIError) as other:
                await api.call("getChat", chat_id="1")
            assert other.value.migrate_to_chat_id is None


async def test_other_bad_requests_and_callback_answers_are_not_resent() -> None:
    fake = FakeTelegram(TOKEN)
    migrated = {
        "error_code": 400,
        "description": "Bad Request: group chat was upgraded to a supergroup chat",
        "parameters": {"migrate_to_chat_id": NEW_CHAT},
    }
    fake.errors["answerCallbackQuery"] = (400, migrated)
    fake.errors["sendMessage"] = (400, {"error_code": 400, "description": "Bad Request: chat not found"})
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            with pytest.raises(DeliveryError):
                await sender.send(callback_answer("q1"))
            with pytest.raises(DeliveryError) as raised:
                await sender.send(text("hello", group_target()))
            del fake.errors["answerCallbackQuery"]
            assert await sender.send(callback_answer("q2")) is None
    assert raised.value.permanent
    assert fake.calls("answerCallbackQuery") == [{"callback_query_id": "q1"}, {"callback_query_id": "q2"}]
    assert len(fake.calls("sendMessage")) == 1


# --- typing indicators ---------------------------------------------------------------------------------


async def test_telegram_typing_is_a_chat_action_in_the_topic() -> None:
    fake = FakeTelegram(TOKEN)
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender: Sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            await sender.indicate_typing(group_target(chat_id="-100500", thread_id="7"))
            await sender.indicate_typing(group_target(chat_id="42", chat_type=None))
            # A callback answer's target names no chat.
            await sender.indicate_typing(TelegramTarget.from_json({"id": "q1"}))
    assert fake.calls("sendChatAction") == [
        {"chat_id": "-100500", "action": "typing", "message_thread_id": 7},
        {"chat_id": "42", "action": "typing"},
    ]
    assert not fake.calls("sendMessage")


async def test_whatsapp_typing_marks_the_inbound_message_read() -> None:
    fake = FakeWhatsApp()
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender: Sender = WhatsAppSender(base, WA_TOKEN, http)
            await sender.indicate_typing(whatsapp_target())
            await sender.indicate_typing(whatsapp_target(reply_to=None))  # nothing to mark: no call
    (request,) = fake.requests
    assert request.path == "/1065/messages"
    assert request.headers["authorization"] == f"Bearer {WA_TOKEN}"
    assert request.json == {
        "messaging_product": "whatsapp",
        "status": "read",
        "message_id": "wamid.IN1",
        "typing_indicator": {"type": "text"},
    }


@pytest.mark.parametrize("status", [500, 400])
async def test_a_refused_typing_indicator_does_not_raise(status: int) -> None:
    telegram, whatsapp = FakeTelegram(TOKEN), FakeWhatsApp()
    telegram.errors["sendChatAction"] = (status, {"error_code": status, "description": "nope"})
    whatsapp.errors.append((status, {"code": 131000 if status == 500 else 100, "message": "nope"}))
    with serve_in_thread(telegram.app) as tg_base, serve_in_thread(whatsapp.app) as wa_base:
        async with httpx.AsyncClient() as http:
            with capture_logs() as logs:
                await TelegramSender(TelegramAPI(TOKEN, tg_base, http)).indicate_typing(group_target())
                await WhatsAppSender(wa_base, WA_TOKEN, http).indicate_typing(whatsapp_target())
    assert len(telegram.calls("sendChatAction")) == 1
    assert len(whatsapp.requests) == 1
    failures = [e for e in logs if e["event"] == "typing_indicator_failed"]
    assert [e["platform"] for e in failures] == ["telegram", "whatsapp"]
    assert {e["log_level"] for e in failures} == {"debug" if status == 500 else "warning"}
    assert TOKEN not in repr(logs)
    assert WA_TOKEN not in repr(logs)


async def test_typing_to_an_unreachable_platform_does_not_raise() -> None:
    async with httpx.AsyncClient() as http:
        with capture_logs() as logs:
            await TelegramSender(TelegramAPI(TOKEN, unreachable_base(), http)).indicate_typing(group_target())
            await WhatsAppSender(unreachable_base(), WA_TOKEN, http).indicate_typing(whatsapp_target())
    failures = [e for e in logs if e["event"] == "typing_indicator_failed"]
    assert [e["platform"] for e in failures] == ["telegram", "whatsapp"]
    assert TOKEN not in repr(logs)
    assert WA_TOKEN not in repr(logs)
    assert "127.0.0.1" not in repr(logs)  # no URL either: Telegram's holds the token


# --- Telegram: a business chat ---------------------------------------------------------------------


async def test_a_reply_in_a_business_chat_is_sent_as_the_business() -> None:
    fake = FakeTelegram(TOKEN)
    fake.results["sendMessage"] = {"message_id": 9}
    target = TelegramTarget(chat_id="456", reply_to="456:123", business_connection_id="BCONN-1")
    with serve_in_thread(fake.app) as base:
        async with httpx.AsyncClient() as http:
            sender = TelegramSender(TelegramAPI(TOKEN, base, http))
            assert await sender.send(text("We open at 10.", target)) == "9"
            await sender.indicate_typing(target)
    assert fake.calls("sendMessage") == [
        {"chat_id": "456", "text": "We open at 10.", "business_connection_id": "BCONN-1"}
    ]
    assert fake.calls("sendChatAction") == [
        {"chat_id": "456", "action": "typing", "business_connection_id": "BCONN-1"}
    ]
