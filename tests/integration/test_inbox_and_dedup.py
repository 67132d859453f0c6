"""Operators' tools on the inbox and the dedup keys: purge, list, retry, and the hourly purge in serve."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.cli import main
from gateway.store import dedup, inbox, migrations
from gateway.store.database import Database
from gateway.store.tables import InboxRow, ProcessedMessageRow
from gateway.worker.maintenance import purge_dedup_keys_periodically


async def add_keys(engine: AsyncEngine | Database, expired: int, fresh: int) -> None:
    now = datetime.now(UTC)
    rows = [
        {
            "message_key": f"k{i}",
            "platform": "telegram",
            "processed_at": now,
            "expires_at": now + timedelta(hours=1),
        }
        for i in range(fresh)
    ] + [
        {
            "message_key": f"old{i}",
            "platform": "telegram",
            "processed_at": now,
            "expires_at": now - timedelta(hours=1),
        }
        for i in range(expired)
    ]
    async with engine.begin() as conn:
        await conn.execute(insert(ProcessedMessageRow), rows)


async def key_count(engine: AsyncEngine | Database) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(ProcessedMessageRow))).scalar_one())


async def test_purge_deletes_only_expired_keys_in_batches(database: Database) -> None:
    await migrations.upgrade(database)
    await add_keys(database, expired=25, fresh=3)
    assert await dedup.purge_expired(database, batch_size=10) == 25
    assert await key_count(database) == 3


async def test_the_periodic_purge_runs_at_once_and_keeps_going(database: Database) -> None:
    await migrations.upgrade(database)
    await add_keys(database, expired=4, fresh=1)
    rounds: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.create_task(
        purge_dedup_keys_periodically(database, interval=0.01, on_purged=rounds.put_nowait)
    )
    try:
        async with asyncio.timeout(30):
            assert await rounds.get() == 4
            await add_keys(database, expired=2, fresh=0)
            while (purged := await rounds.get()) == 0:
                pass
        assert purged == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert await key_count(database) == 1


async def add_inbox(engine: AsyncEngine | Database, status: str, key: str) -> int:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        result = await conn.execute(
            insert(InboxRow)
            .values(
                dedup_key=key,
                platform="telegram",
                session_id="telegram:42",
                message_id="42:1",
                kind="text",
                text="hello\nthere",
                message_json={},
                status=status,
                attempts=5 if status == "dead" else 0,
                next_attempt_at=now,
                received_at=now,
                last_error="ModelError: 503" if status == "dead" else None,
            )
            .returning(InboxRow.id)
        )
        return int(result.scalar_one())


async def test_retry_requeues_only_dead_rows(database: Database) -> None:
    await migrations.upgrade(database)
    dead = await add_inbox(database, "dead", "tg:1:1")
    done = await add_inbox(database, "done", "tg:1:2")
    assert await inbox.retry(database, done) is False
    assert await inbox.retry(database, 999) is False
    assert await inbox.retry(database, dead) is True
    (item,) = await inbox.list_items(database, "pending")
    assert (item.id, item.attempts) == (dead, 0)
    assert [i.id for i in await inbox.list_items(database)] == [done, dead]  # newest first


def test_cli_inbox_and_dedup(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.store.engine import create_engine

    monkeypatch.setenv("GATEWAY_DATABASE_URL", sqlite_url)
    assert main(["inbox", "list"]) == 0  # migrates a new database first
    assert "no inbox rows" in capsys.readouterr().out

    async def seed() -> int:
        engine = create_engine(sqlite_url)
        await add_keys(engine, expired=3, fresh=1)
        row = await add_inbox(engine, "dead", "tg:1:9")
        await engine.dispose()
        return row

    dead = asyncio.run(seed())
    assert main(["inbox", "list", "--status", "dead"]) == 0
    listing = capsys.readouterr().out
    assert "telegram:42" in listing
    assert "hello there" in listing  # one line per row
    assert "ModelError: 503" in listing
    assert main(["inbox", "retry", str(dead)]) == 0
    assert f"inbox row {dead} requeued" in capsys.readouterr().out
    assert main(["inbox", "retry", str(dead)]) == 1
    assert "no dead inbox row" in capsys.readouterr().err
    assert main(["dedup", "purge"]) == 0
    assert "purged 3 expired message keys" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["inbox", "list", "--limit", "99999999999999999999"], "must be at most 1,000,000"),
        (["outbox", "list", "--limit", str(2**63)], "must be at most 1,000,000"),
        (["sessions", "list", "--limit", "0"], "must be at least 1"),
        (["inbox", "list", "--limit", "ten"], "not a whole number: 'ten'"),
    ],
)
def test_cli_limits_out_of_range_are_usage_errors(
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    problem: str,
) -> None:
    """A limit past SQLite's integers reached it and ended in an OverflowError's traceback."""
    monkeypatch.setenv("GATEWAY_DATABASE_URL", sqlite_url)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("inbox_id", [2**63, 0, -1])
def test_cli_inbox_retry_of_an_id_no_row_has(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], inbox_id: int
) -> None:
    """As `gateway outbox retry`: an id past BIGINT names no row (it was an OverflowError's traceback)."""
    monkeypatch.setenv("GATEWAY_DATABASE_URL", sqlite_url)
    assert main(["inbox", "retry", str(inbox_id)]) == 1
    assert capsys.readouterr().err.strip() == f"gateway: no dead inbox row with id {inbox_id}"
