"""/readyz and /metrics tell when this process's claims keep failing, and which replies wait on a platform.

The finding: with a lease owner id too long for its column (PostgreSQL), every claim failed, so no
turn ran and no reply left, while /readyz stayed ready and nothing in /metrics said so. Here claims are
made to fail the way a drifted schema makes them fail (a column the claim needs is gone), while
webhooks, which do not need it, still store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert, text

from gateway.app import create_app
from gateway.store.engine import create_engine
from gateway.store.tables import OutboxRow
from tests.helpers import gateway_settings, serve_in_thread, wait_until


@pytest.fixture
def gateway(migrated_url: str) -> Iterator[str]:
    with serve_in_thread(create_app(gateway_settings(database_url=migrated_url))) as base:
        yield base


async def execute(url: str, statement: str) -> None:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(statement))
    finally:
        await engine.dispose()


def metric(base: str, name: str) -> float | None:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_failing_claims_make_the_process_unready_and_show_in_metrics(gateway: str, migrated_url: str) -> None:
    ready = httpx.get(f"{gateway}/readyz")
    assert ready.status_code == 200
    assert ready.json()["claims"] == {"worker": "ok", "delivery": "ok"}
    assert metric(gateway, 'gateway_claims_failing{loop="worker"}') == 0

    asyncio.run(execute(migrated_url, "ALTER TABLE chatflow_inbox RENAME COLUMN lease_until TO lease_gone"))
    # A message to claim: the claim then fails when it leases the row (with nothing pending, a claim
    # reads only the conversations' queue heads).
    asyncio.run(
        execute(
            migrated_url,
            "INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
            "message_json, status, attempts, next_attempt_at, received_at) VALUES ('telegram:9:1', "
            "'telegram', 'telegram:9', '1', 'text', 'hi', '{}', 'pending', 0, CURRENT_TIMESTAMP, "
            "CURRENT_TIMESTAMP)",
        )
    )
    try:
        unready = wait_until(
            lambda: (r := httpx.get(f"{gateway}/readyz")).status_code == 503 and r,
            "the worker's failing claims to show in /readyz",
            timeout=30,
        )
        assert "worker claims have failed" in unready.json()["reason"]
        assert metric(gateway, 'gateway_claims_failing{loop="worker"}') == 1
        assert (metric(gateway, 'gateway_claim_failures_total{loop="worker"}') or 0) >= 3
        assert metric(gateway, 'gateway_claims_failing{loop="delivery"}') == 0
    finally:
        asyncio.run(
            execute(migrated_url, "ALTER TABLE chatflow_inbox RENAME COLUMN lease_gone TO lease_until")
        )
    wait_until(lambda: httpx.get(f"{gateway}/readyz").status_code == 200, "ready again", timeout=30)
    assert metric(gateway, 'gateway_claims_failing{loop="worker"}') == 0


def test_replies_waiting_on_a_failing_platform_are_named_while_ready(gateway: str, migrated_url: str) -> None:
    async def a_reply_that_failed_once() -> None:
        now = datetime.now(UTC)
        engine = create_engine(migrated_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    insert(OutboxRow).values(
                        platform="telegram",
                        session_id="telegram:42",
                        kind="text",
                        text="hi",
                        target_json={"chat_id": "42"},
                        status="pending",
                        attempts=3,
                        next_attempt_at=now.replace(year=now.year + 1),  # not due: nobody sends it now
                        retry_until=now.replace(year=now.year + 1),
                        created_at=now,
                        updated_at=now,
                    )
                )
        finally:
            await engine.dispose()

    asyncio.run(a_reply_that_failed_once())
    ready = httpx.get(f"{gateway}/readyz")
    assert ready.status_code == 200
    assert ready.json()["outbox_waiting"]["telegram"]["rows"] == 1
    assert metric(gateway, 'gateway_outbox_waiting_rows{platform="telegram"}') == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_sqlite_file_exports_no_xmin_horizon(gateway: str) -> None:
    assert metric(gateway, "gateway_postgres_oldest_snapshot_seconds") is None
    assert metric(gateway, "gateway_postgres_xmin_horizon_xids") is None


@pytest.mark.parametrize(
    "database_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_a_snapshot_held_open_shows_in_metrics(gateway: str, migrated_url: str) -> None:
    """A held xmin horizon slows every queue look-up (benchmarks/soak.py): /metrics says how old the
    oldest open snapshot is and how many transactions ran since, so operators can alert on it."""

    async def hold_then_scrape() -> tuple[float | None, float | None, float]:
        engine = create_engine(migrated_url)
        try:
            async with engine.connect() as holder:
                await holder.execution_options(isolation_level="REPEATABLE READ")
                async with holder.begin():
                    # The first read takes the snapshot; the transaction's start is its `now()`.
                    began = (await holder.execute(text("SELECT extract(epoch FROM now())"))).scalar_one()
                    for n in range(3):  # transactions that the held xmin is older than
                        await execute(migrated_url, f"INSERT INTO chatflow_health VALUES ('xmin {n}', now())")
                    at_scrape = time.time()
                    seconds = metric(gateway, "gateway_postgres_oldest_snapshot_seconds")
                    xids = metric(gateway, "gateway_postgres_xmin_horizon_xids")
            return seconds, xids, at_scrape - float(began)
        finally:
            await engine.dispose()

    seconds, xids, held_for = asyncio.run(hold_then_scrape())
    assert seconds is not None
    assert seconds >= held_for - 0.01  # scraped after it: at least as old as it was then
    assert xids is not None
    assert xids >= 3
    after = metric(gateway, "gateway_postgres_oldest_snapshot_seconds")
    assert after is not None
    assert after < held_for
