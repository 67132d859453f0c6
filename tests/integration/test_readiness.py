"""`/readyz` tries a real write, within its timeout: one row per process in `chatflow_health`, and 503
when the database takes reads but not writes (another process holding SQLite's write lock, a
read-only PostgreSQL database, a locked table)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from gateway.app import create_app
from gateway.store import migrations
from gateway.store.engine import create_engine, sqlite_file_path
from gateway.web.health import READY_TIMEOUT_SECONDS
from tests.conftest import POSTGRES_ENV
from tests.helpers import gateway_settings, serve_in_thread, wait_until

TG_SECRET = "tg-secret-readiness"


def webhook(base: str, update_id: int) -> httpx.Response:
    person = {"id": update_id, "is_bot": False, "first_name": "T"}
    message = {"message_id": update_id, "date": 1767225600, "chat": {**person, "type": "private"}}
    update = {"update_id": update_id, "message": {**message, "from": person, "text": "hi"}}
    headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
    return httpx.post(f"{base}/webhooks/telegram", content=json.dumps(update), headers=headers, timeout=30)


def health_rows(url: str) -> list[Any]:
    async def run() -> list[Any]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return list(await conn.execute(text("SELECT owner, checked_at FROM chatflow_health")))
        finally:
            await engine.dispose()

    return asyncio.run(run())


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


@pytest.fixture
def gateway(url: str) -> Iterator[str]:
    settings = gateway_settings(database_url=url, telegram_secret_token=TG_SECRET)
    with serve_in_thread(create_app(settings)) as base:
        yield base


def test_readyz_writes_one_row_for_this_process(gateway: str, url: str) -> None:
    answers = [httpx.get(f"{gateway}/readyz") for _ in range(20)]
    assert {a.status_code for a in answers} == {200}
    ((owner, checked_at),) = health_rows(url)
    assert owner == f"{socket.gethostname()}:{os.getpid()}"
    checked = checked_at if isinstance(checked_at, datetime) else datetime.fromisoformat(checked_at)
    assert abs(datetime.now(UTC) - checked.replace(tzinfo=UTC)) < timedelta(minutes=1)


def test_readyz_is_503_while_another_process_holds_the_sqlite_write_lock(sqlite_url: str) -> None:
    asyncio.run(_migrate(sqlite_url))
    settings = gateway_settings(database_url=sqlite_url, telegram_secret_token=TG_SECRET)
    path = sqlite_file_path(sqlite_url)
    assert path is not None
    with serve_in_thread(create_app(settings)) as base:
        assert httpx.get(f"{base}/readyz").status_code == 200
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # reads still work (WAL); no write can commit
            started = time.monotonic()
            answer = httpx.get(f"{base}/readyz", timeout=30)
            elapsed = time.monotonic() - started
            assert answer.status_code == 503, answer.text
            assert f"within {READY_TIMEOUT_SECONDS:g}s" in answer.json()["reason"]
            assert elapsed < READY_TIMEOUT_SECONDS + 1  # bounded by the readiness timeout
            assert webhook(base, 1).status_code == 503  # what readiness stands for: webhooks fail
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, "/readyz to be ready again")


async def _migrate(url: str) -> None:
    engine = create_engine(url)
    try:
        await migrations.upgrade(engine)
    finally:
        await engine.dispose()


# --- PostgreSQL ----------------------------------------------------------------------------------------
def _admin(statement: str) -> None:
    """A statement on the test server's own database (not the one under test)."""

    async def run() -> None:
        engine = create_engine(os.environ[POSTGRES_ENV], isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                await conn.execute(text(statement))
        finally:
            await engine.dispose()

    asyncio.run(run())


def _drop_connections(name: str) -> None:
    _admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")


@pytest.mark.postgres
def test_readyz_is_503_while_postgres_is_read_only(postgres_url: str) -> None:
    asyncio.run(_migrate(postgres_url))
    name = make_url(postgres_url).database
    assert name is not None
    settings = gateway_settings(database_url=postgres_url, telegram_secret_token=TG_SECRET)
    with serve_in_thread(create_app(settings)) as base:
        assert httpx.get(f"{base}/readyz").status_code == 200
        _admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        try:
            _drop_connections(name)  # new connections start read-only
            # Once the pool has reconnected, every webhook fails; readiness must say so too.
            wait_until(
                lambda: [webhook(base, n).status_code for n in (1, 2)] == [503, 503], "webhooks to fail"
            )
            answers = [httpx.get(f"{base}/readyz", timeout=30) for _ in range(2)]
            assert [a.status_code for a in answers] == [503, 503], [a.text for a in answers]
            assert "read-only" in answers[-1].json()["reason"]
        finally:
            _admin(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            _drop_connections(name)
        wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, "/readyz to be ready again")
        assert webhook(base, 3).status_code == 200


@pytest.mark.postgres
def test_readyz_answers_within_its_timeout_when_the_write_blocks(postgres_url: str) -> None:
    asyncio.run(_migrate(postgres_url))
    settings = gateway_settings(database_url=postgres_url)

    async def locked_readyz(base: str) -> tuple[int, str, float]:
        engine = create_engine(postgres_url)
        try:
            async with engine.connect() as blocker, httpx.AsyncClient(timeout=30) as client:
                await blocker.execute(text("LOCK TABLE chatflow_health IN ACCESS EXCLUSIVE MODE"))
                started = time.monotonic()
                answer = await client.get(f"{base}/readyz")
                elapsed = time.monotonic() - started
                await blocker.rollback()
                return answer.status_code, answer.json()["reason"], elapsed
        finally:
            await engine.dispose()

    with serve_in_thread(create_app(settings)) as base:
        assert httpx.get(f"{base}/readyz").status_code == 200
        status, reason, elapsed = asyncio.run(locked_readyz(base))
        assert (status, reason) == (503, f"database did not answer within {READY_TIMEOUT_SECONDS:g}s")
        assert READY_TIMEOUT_SECONDS - 0.5 < elapsed < READY_TIMEOUT_SECONDS + 1
        wait_until(lambda: httpx.get(f"{base}/readyz").status_code == 200, "/readyz to be ready again")
