"""A cap on what one signed webhook may carry: over GATEWAY_MAX_MESSAGES_PER_WEBHOOK it gets 413 and
nothing is stored, on both backends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, ProcessedMessageRow
from tests.helpers import gateway_settings, serve_in_thread

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
APP_SECRET = "wa-secret-limits"


def whatsapp_batch(messages: int, statuses: int = 0) -> bytes:
    """One signed-able WhatsApp webhook carrying `messages` text messages and `statuses` statuses."""
    payload: dict[str, Any] = json.loads((PAYLOADS / "whatsapp" / "text.json").read_bytes())
    value = payload["entry"][0]["changes"][0]["value"]
    template = value["messages"][0]
    value["messages"] = [
        {**template, "id": f"wamid.limit{n}", "text": {"body": "hi"}} for n in range(messages)
    ]
    if statuses:
        value["statuses"] = [
            {"id": f"wamid.out{n}", "status": "delivered", "timestamp": "1776160800", "recipient_id": "1"}
            for n in range(statuses)
        ]
    return json.dumps(payload, separators=(",", ":")).encode()


def post(base: str, body: bytes) -> httpx.Response:
    headers = {
        "X-Hub-Signature-256": WhatsAppAdapter.sign(APP_SECRET, body),
        "Content-Type": "application/json",
    }
    return httpx.post(f"{base}/webhooks/whatsapp", content=body, headers=headers, timeout=60)


def stored(url: str) -> tuple[int, int]:
    async def run() -> tuple[int, int]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                inbox = (await conn.execute(select(func.count()).select_from(InboxRow))).scalar_one()
                keys = (
                    await conn.execute(select(func.count()).select_from(ProcessedMessageRow))
                ).scalar_one()
                return int(inbox), int(keys)
        finally:
            await engine.dispose()

    return asyncio.run(run())


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


@pytest.fixture
def capped(url: str) -> Iterator[str]:
    settings = gateway_settings(database_url=url, whatsapp_app_secret=APP_SECRET, max_messages_per_webhook=50)
    with serve_in_thread(create_app(settings)) as base:
        yield base


def test_twenty_thousand_messages_in_one_signed_webhook_are_refused_by_default(url: str) -> None:
    body = whatsapp_batch(20_000)
    assert len(body) < 4 * 1024 * 1024  # within the default body limit: the count is what refuses it
    settings = gateway_settings(database_url=url, whatsapp_app_secret=APP_SECRET)
    with structlog.testing.capture_logs() as logs, serve_in_thread(create_app(settings)) as base:
        answer = post(base, body)
    assert answer.status_code == 413, answer.text[:300]
    assert answer.json()["error"] == "too_many_messages"
    assert "1000" in answer.json()["detail"]
    assert stored(url) == (0, 0)
    (event,) = [e for e in logs if e["event"] == "webhook_too_many_messages"]
    assert (event["items"], event["limit"], event["platform"]) == (20_000, 1000, "whatsapp")


def test_the_cap_counts_messages_and_statuses_together(capped: str, url: str) -> None:
    at_cap = post(capped, whatsapp_batch(40, statuses=10))
    over = post(capped, whatsapp_batch(41, statuses=10))
    assert (at_cap.status_code, at_cap.json()["new"]) == (200, 50)
    assert (over.status_code, over.json()["error"]) == (413, "too_many_messages")
    assert stored(url)[0] == 40  # the 40 messages of the first; statuses have no inbox row
