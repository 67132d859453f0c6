"""A database that stops answering: webhooks get 503 within the timeout, and the queue stays bounded.

The finding: PostgreSQL SIGSTOPped for 30 s left 20 of 20 webhooks unanswered after 30 s, requests
piling up in memory. Here the SQLite file is frozen by another connection holding its write lock (as
another process would), which the gateway's writer waits on; the PostgreSQL variant, with a real
SIGSTOP, is in the fault suite.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.store import migrations
from gateway.store.database import Database
from tests.helpers import gateway_settings, serve_in_thread
from tests.integration.test_poison_values import whatsapp_text
from tests.integration.test_webhooks import APP_SECRET, wa_headers

TIMEOUT = 1.0


@pytest.fixture
def database_file(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.db"

    async def migrate() -> None:
        database = Database.open(f"sqlite+aiosqlite:///{path}")
        await migrations.upgrade(database)
        await database.aclose()

    asyncio.run(migrate())
    return path


@pytest.fixture
def gateway(database_file: Path) -> Iterator[str]:
    settings = gateway_settings(
        database_url=f"sqlite+aiosqlite:///{database_file}",
        whatsapp_app_secret=APP_SECRET,
        database_timeout_seconds=TIMEOUT,
        max_queued_webhooks=8,
    )
    with serve_in_thread(create_app(settings)) as base:
        yield base


async def post(base: str, bodies: list[bytes]) -> list[tuple[int, float, dict[str, str]]]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def one(body: bytes) -> tuple[int, float, dict[str, str]]:
            started = time.monotonic()
            answer = await client.post("/webhooks/whatsapp", content=body, headers=wa_headers(body))
            return answer.status_code, time.monotonic() - started, answer.json()

        return await asyncio.gather(*(one(body) for body in bodies))


def test_a_frozen_database_answers_503_in_bounded_time_then_recovers(
    gateway: str, database_file: Path
) -> None:
    holder = sqlite3.connect(database_file, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # nobody else writes until this ends: the database is frozen
    try:
        bodies = [
            whatsapp_text(f"wamid.frozen{i}", f"frozen {i}", sender=f"1650555{i:04}") for i in range(20)
        ]
        answers = asyncio.run(post(gateway, bodies))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert {status for status, _, _ in answers} == {503}
    # Each answered in about the timeout, not when the database came back (never, here, until the end).
    assert max(seconds for _, seconds, _ in answers) < TIMEOUT * 10
    details = [body["detail"] for _, _, body in answers]
    assert any("in time" in detail for detail in details)  # waited for its commit, then gave up
    assert any("too many" in detail for detail in details)  # refused at once: the queue is bounded

    # Once the database answers again, the platform's retries (a few at a time) are stored.
    retried = [answer for i in range(0, 20, 4) for answer in asyncio.run(post(gateway, bodies[i : i + 4]))]
    assert [status for status, _, _ in retried] == [200] * len(bodies)
