"""Poison values: signed, valid JSON whose values a database refuses, posted among innocent webhooks.

The finding: a string with NUL (PostgreSQL), NaN in a JSON column, an id longer than its column or a
field nested ~990 levels failed its whole group commit: the sender got 503 at every retry for days,
and innocent webhooks in the same batch got 503 too. Now every value is made storable before batching
(gateway/store/storable.py) and a batch that still fails is committed again request by request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from gateway.app import create_app
from gateway.store import storable
from gateway.store.tables import InboxRow
from tests.helpers import gateway_settings, serve_in_thread
from tests.integration.test_webhooks import APP_SECRET, rows, wa_headers

NESTING = 900  # deeper than orjson encodes (255) and close to what json.loads itself parses


def whatsapp_text(message_id: str, text: str, sender: str = "16505551234", **extra: Any) -> bytes:
    message = {"from": sender, "id": message_id, "timestamp": "1776160800", "type": "text", **extra}
    message["text"] = {"body": text}
    value = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550783881", "phone_number_id": "106540352242922"},
        "contacts": [{"profile": {"name": "Sheena"}, "wa_id": sender}],
        "messages": [message],
    }
    update = {
        "object": "whatsapp_business_account",
        "entry": [{"id": "1", "changes": [{"value": value, "field": "messages"}]}],
    }
    return json.dumps(update).encode()  # NaN stays NaN: valid for json.loads, not for a JSON column


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


POISON = {
    "nul": whatsapp_text("wamid.nul", "before\u0000after"),
    "nan": whatsapp_text("wamid.nan", "not a number inside", extra_number=float("nan")),
    "long_id": whatsapp_text("wamid." + "A" * 400, "an id longer than its column"),
    "long_sender": whatsapp_text("wamid.sender", "a chat id longer than a session id", sender="1" * 300),
    "deep": whatsapp_text("wamid.deep", "nested very deep", extra_field=nested(NESTING)),
}


@pytest.fixture
def gateway(migrated_url: str) -> Iterator[str]:
    settings = gateway_settings(database_url=migrated_url, whatsapp_app_secret=APP_SECRET)
    with serve_in_thread(create_app(settings)) as base:
        yield base


async def post_all(base: str, bodies: list[bytes]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        return await asyncio.gather(
            *(client.post("/webhooks/whatsapp", content=body, headers=wa_headers(body)) for body in bodies)
        )


def test_poison_values_are_stored_and_do_not_fail_innocent_webhooks(gateway: str, migrated_url: str) -> None:
    innocent = [whatsapp_text(f"wamid.ok{i}", f"innocent {i}", sender=f"1650555{i:04}") for i in range(30)]
    bodies = [body for pair in zip(innocent, [*POISON.values()] * 6, strict=False) for body in pair]
    bodies += innocent[len(bodies) // 2 :]
    answers = asyncio.run(post_all(gateway, bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies)
    assert all(a.json()["status"] == "accepted" for a in answers)

    stored = asyncio.run(rows(migrated_url, select(InboxRow.message_id, InboxRow.session_id, InboxRow.text)))
    by_id = {message_id: (session_id, text) for message_id, session_id, text in stored}
    assert {f"wamid.ok{i}" for i in range(30)} <= set(by_id)
    assert by_id["wamid.nul"][1] == "beforeafter"  # NUL removed
    assert by_id["wamid.nan"][1] == "not a number inside"
    assert by_id["wamid.deep"][1] == "nested very deep"
    long_id = storable.bounded("wamid." + "A" * 400)
    assert len(long_id) == storable.KEY_CHARS
    assert by_id[long_id][1] == "an id longer than its column"
    assert all(len(session_id) <= storable.KEY_CHARS for session_id, _ in by_id.values())
    assert len(stored) == 30 + len(POISON)

    # The platform's retries of the poison are re-deliveries now, never a 503 for days.
    again = asyncio.run(post_all(gateway, list(POISON.values())))
    assert [(a.status_code, a.json()["duplicates"]) for a in again] == [(200, 1)] * len(POISON)


def test_a_stored_poison_message_reads_back_as_json(gateway: str, migrated_url: str) -> None:
    answers = asyncio.run(post_all(gateway, [POISON["nan"], POISON["deep"]]))
    assert [a.status_code for a in answers] == [200, 200]
    stored = dict(asyncio.run(rows(migrated_url, select(InboxRow.message_id, InboxRow.message_json))))
    assert stored["wamid.nan"]["raw"]["extra_number"] is None  # NaN became null
    deep = stored["wamid.deep"]["raw"]["extra_field"]
    depth = 0
    while isinstance(deep, list):
        deep, depth = deep[0], depth + 1
    assert deep == storable.TOO_DEEP
    assert depth < NESTING


def test_the_storable_rule_keeps_one_value_per_original() -> None:
    a, b = "x" * 300, "x" * 299 + "y"
    assert storable.bounded(a) != storable.bounded(b)
    assert storable.bounded(a) == storable.bounded(a)
    assert len(storable.bounded(a, 64)) == 64
    assert storable.bounded("short\u0000") == "short"
    assert json.loads(storable.json_text({"n": float("inf"), "big": 2**70})) == {"n": None, "big": 2**70}
