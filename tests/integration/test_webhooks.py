"""Webhooks over real loopback HTTP: verification, limits, durable acks and dedup, on both backends."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, text

from gateway.app import create_app
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from gateway.settings import Settings
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, OutboxRow, ProcessedMessageRow
from tests.helpers import gateway_settings, serve_in_thread

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
APP_SECRET = "wa-app-secret-for-tests"
VERIFY_TOKEN = "verify-me"
TG_SECRET = "tg-secret_token-1"
BOT_TOKEN = "123456789:AAbbCCdd"


def payload_bytes(platform: str, name: str) -> bytes:
    # Sent byte for byte as stored: the WhatsApp signature covers exactly these bytes.
    return (PAYLOADS / platform / f"{name}.json").read_bytes().strip()


def wa_headers(body: bytes, secret: str = APP_SECRET) -> dict[str, str]:
    return {"X-Hub-Signature-256": WhatsAppAdapter.sign(secret, body), "Content-Type": "application/json"}


def tg_headers(secret: str = TG_SECRET) -> dict[str, str]:
    return {"X-Telegram-Bot-Api-Secret-Token": secret, "Content-Type": "application/json"}


async def rows(url: str, query: Any) -> Any:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(query)).all()
    finally:
        await engine.dispose()


def count(url: str, table: Any) -> int:
    result = asyncio.run(rows(url, select(func.count()).select_from(table)))
    return int(result[0][0])


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


@pytest.fixture
def gateway(url: str) -> Iterator[str]:
    settings = gateway_settings(
        database_url=url,
        whatsapp_app_secret=APP_SECRET,
        whatsapp_verify_token=VERIFY_TOKEN,
        telegram_secret_token=TG_SECRET,
        telegram_bot_token=BOT_TOKEN,
        telegram_bot_username="chatflow_demo_bot",  # getMe would go to the real Bot API
        max_body_bytes=64 * 1024,
    )
    with serve_in_thread(create_app(settings)) as base:
        yield base


def test_a_signed_whatsapp_message_is_stored_once(gateway: str, url: str) -> None:
    body = payload_bytes("whatsapp", "text")
    first = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    again = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    assert (first.status_code, first.json()) == (200, {"status": "accepted", "new": 1, "duplicates": 0})
    assert (again.status_code, again.json()) == (200, {"status": "accepted", "new": 0, "duplicates": 1})
    inbox = asyncio.run(
        rows(url, select(InboxRow.dedup_key, InboxRow.session_id, InboxRow.status, InboxRow.text))
    )
    assert len(inbox) == 1
    key, session_id, status, agent_text = inbox[0]
    assert key.startswith("wa:msg:wamid.")
    assert session_id.startswith("whatsapp:")
    assert status in {"pending", "done"}  # the worker in the app may already have answered it
    assert agent_text


def test_non_ascii_bodies_verify_against_the_raw_bytes(gateway: str, url: str) -> None:
    body = payload_bytes("whatsapp", "text_non_ascii")
    assert b"\\u" in body  # escaped the way Meta sends it
    reserialized = json.dumps(json.loads(body), ensure_ascii=False).encode()
    refused = httpx.post(f"{gateway}/webhooks/whatsapp", content=reserialized, headers=wa_headers(body))
    accepted = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    assert refused.status_code == 401
    assert accepted.status_code == 200


def test_a_batch_stores_every_message_in_order(gateway: str, url: str) -> None:
    body = payload_bytes("whatsapp", "batch")
    response = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    assert response.status_code == 200
    expected = [
        f"wa:msg:{m['id']}"
        for entry in json.loads(body)["entry"]
        for change in entry["changes"]
        for m in change["value"].get("messages", [])
    ]
    stored = asyncio.run(rows(url, select(InboxRow.dedup_key).order_by(InboxRow.id)))
    assert [r[0] for r in stored] == expected


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "missing signature"),
        ({"X-Hub-Signature-256": "sha256=" + "0" * 64}, "wrong signature"),
        ("other-secret", "signed with another secret"),
    ],
)
def test_a_bad_signature_is_401_and_stores_nothing(gateway: str, url: str, headers: Any, why: str) -> None:
    body = payload_bytes("whatsapp", "text")
    sent = wa_headers(body, headers) if isinstance(headers, str) else headers
    response = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=sent)
    assert response.status_code == 401, why
    assert response.json()["error"] == "unauthorized"
    assert count(url, InboxRow) == 0
    assert count(url, ProcessedMessageRow) == 0


def test_telegram_secret_token(gateway: str, url: str) -> None:
    body = payload_bytes("telegram", "private_text")
    wrong = httpx.post(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers("nope"))
    missing = httpx.post(f"{gateway}/webhooks/telegram", content=body)
    right = httpx.post(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers())
    assert (wrong.status_code, missing.status_code, right.status_code) == (401, 401, 200)
    (key,) = asyncio.run(rows(url, select(InboxRow.dedup_key)))
    update_id = json.loads(body)["update_id"]
    assert key == (f"tg:123456789:{update_id}",)


def test_kinds_that_start_no_turn_are_recorded(gateway: str, url: str) -> None:
    body = payload_bytes("whatsapp", "reaction")
    assert (
        httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body)).status_code == 200
    )
    assert asyncio.run(rows(url, select(InboxRow.status))) == [("recorded",)]


def test_statuses_are_deduplicated_without_an_inbox_row(gateway: str, url: str) -> None:
    body = payload_bytes("whatsapp", "status_delivered")
    first = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    again = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    assert first.json()["new"] == 1
    assert again.json()["duplicates"] == 1
    assert count(url, InboxRow) == 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"object": "page", "entry": []}', 200),
        (b'{"object": "whatsapp_business_account", "entry": [{"changes": []}]}', 200),
        (b"\xff\xfe", 400),
        (b"[" * 20_000 + b"]" * 20_000, 400),  # deeper than the parsers go
        (b'{"object": "page", "n": NaN, "big": 123456789012345678901234567890}', 200),  # orjson refuses
        ('{"object": "page"}'.encode("utf-16"), 200),  # JSON may come in UTF-16
    ],
)
def test_bad_or_irrelevant_json(gateway: str, url: str, body: bytes, status: int) -> None:
    response = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=wa_headers(body))
    assert response.status_code == status
    if status == 200:
        assert response.json() == {"status": "ignored"}
    assert count(url, InboxRow) == 0


def test_oversize_bodies_are_413(gateway: str) -> None:
    big = b"{" + b" " * (70 * 1024) + b"}"
    declared = httpx.post(f"{gateway}/webhooks/telegram", content=big, headers=tg_headers())

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(70):
            yield b" " * 1024

    streamed = httpx.post(f"{gateway}/webhooks/telegram", content=chunks(), headers=tg_headers())
    assert declared.status_code == streamed.status_code == 413


def test_unknown_and_disabled_platforms_are_404(url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=url))) as base:
        unknown = httpx.post(f"{base}/webhooks/slack", content=b"{}")
        disabled = httpx.post(f"{base}/webhooks/telegram", content=b"{}")
        handshake = httpx.get(f"{base}/webhooks/whatsapp", params={"hub.mode": "subscribe"})
    assert unknown.status_code == 404
    assert disabled.status_code == 404
    assert disabled.json()["error"] == "platform_disabled"
    assert "GATEWAY_TELEGRAM_SECRET_TOKEN" in disabled.json()["detail"]
    assert handshake.status_code == 404


def test_whatsapp_handshake(gateway: str) -> None:
    def get(**params: str) -> httpx.Response:
        return httpx.get(f"{gateway}/webhooks/whatsapp", params=params)

    ok = get(**{"hub.mode": "subscribe", "hub.verify_token": VERIFY_TOKEN, "hub.challenge": "1158201444"})
    assert (ok.status_code, ok.text) == (200, "1158201444")
    assert ok.headers["content-type"].startswith("text/plain")
    assert (
        get(**{"hub.mode": "subscribe", "hub.verify_token": "wrong", "hub.challenge": "1"}).status_code == 403
    )
    assert get(**{"hub.mode": "unsubscribe", "hub.verify_token": VERIFY_TOKEN}).status_code == 403
    assert httpx.get(f"{gateway}/webhooks/telegram").status_code == 405


async def test_concurrent_duplicates_store_one_row(gateway: str, url: str) -> None:
    body = payload_bytes("telegram", "private_text")
    async with httpx.AsyncClient(base_url=gateway) as client:
        responses = await asyncio.gather(
            *(client.post("/webhooks/telegram", content=body, headers=tg_headers()) for _ in range(20))
        )
    assert all(r.status_code == 200 for r in responses)
    assert sum(r.json()["new"] for r in responses) == 1
    engine = create_engine(url)
    async with engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(InboxRow))).scalar_one() == 1
    await engine.dispose()


def test_a_failed_commit_is_503_so_the_platform_retries(gateway: str, url: str) -> None:
    async def break_inbox() -> None:
        engine = create_engine(url)
        async with engine.begin() as conn:
            await conn.execute(text("DROP TABLE chatflow_inbox"))
        await engine.dispose()

    asyncio.run(break_inbox())
    body = payload_bytes("telegram", "private_text")
    response = httpx.post(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers())
    assert response.status_code == 503
    assert response.json()["error"] == "unavailable"
    assert count(url, ProcessedMessageRow) == 0  # the key went with the failed transaction


def test_the_worker_in_the_app_answers_into_the_outbox(gateway: str, url: str) -> None:
    body = payload_bytes("telegram", "private_text")
    assert httpx.post(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers()).status_code == 200
    deadline = time.monotonic() + 30
    replies: list[Any] = []
    while not replies and time.monotonic() < deadline:  # the turn runs after the ack, in the background
        replies = asyncio.run(rows(url, select(OutboxRow.kind, OutboxRow.text, OutboxRow.target_json)))
        time.sleep(0.05)
    assert replies, "no reply reached the outbox"
    kind, reply, target = replies[0]
    assert kind == "text"
    assert reply  # the demo agent's answer
    assert target["chat_id"] == str(json.loads(body)["message"]["chat"]["id"])
    assert asyncio.run(rows(url, select(InboxRow.status))) == [("done",)]


def test_webhook_posts_keep_the_request_context_and_the_route_table(gateway: str) -> None:
    """The shortcut to the receiver keeps what every route has: the request id, metrics by route
    template, JSON errors; and paths or methods it does not take get the router's answers."""
    body = payload_bytes("telegram", "private_text")
    accepted = httpx.post(
        f"{gateway}/webhooks/telegram", content=body, headers={**tg_headers(), "X-Request-ID": "req-42"}
    )
    assert accepted.status_code == 200
    assert accepted.headers["x-request-id"] == "req-42"
    assert accepted.headers["content-type"] == "application/json"
    assert accepted.json()["status"] == "accepted"

    refused = httpx.post(f"{gateway}/webhooks/telegram", content=body)
    assert refused.status_code == 401
    assert refused.json()["request_id"] == refused.headers["x-request-id"]

    deeper = httpx.post(f"{gateway}/webhooks/telegram/extra", content=body, headers=tg_headers())
    assert deeper.status_code == 404
    assert deeper.json()["error"] == "not_found"
    wrong_method = httpx.put(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers())
    assert wrong_method.status_code == 405
    assert "POST" in wrong_method.headers["allow"]

    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'gateway_http_requests_total{method="POST",route="/webhooks/{platform}",status="200"}' in metrics
    assert 'gateway_http_requests_total{method="POST",route="/webhooks/{platform}",status="401"}' in metrics


def test_json_that_only_the_standard_library_encodes_is_stored_too(gateway: str, url: str) -> None:
    """A lone surrogate escape and an integer over 64 bits are valid JSON: accepted and stored (the
    half character as U+FFFD, since no UTF-8 database or platform takes it)."""
    update = json.loads(payload_bytes("telegram", "private_text"))
    update["update_id"] = 990001
    update["message"]["text"] = "half an emoji: \ud83d"
    update["extra_field"] = 2**70
    body = json.dumps(update).encode()  # escapes the surrogate as \ud83d
    response = httpx.post(f"{gateway}/webhooks/telegram", content=body, headers=tg_headers())
    assert response.status_code == 200
    assert response.json()["new"] == 1
    stored = asyncio.run(rows(url, select(InboxRow.text, InboxRow.message_json)))
    assert [(text, message["raw"]["extra_field"]) for text, message in stored] == [
        ("half an emoji: \ufffd", 2**70)
    ]
