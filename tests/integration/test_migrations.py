"""Migrations on SQLite and PostgreSQL: up, down, up again; drift detection; concurrent upgrades."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.cli import main
from gateway.store import migrations
from gateway.store.engine import create_engine
from tests.helpers import GATEWAY, REPO_ROOT, gateway_env

CONTRACT_TABLES = {"chatflow_sessions", "chatflow_messages", "chatflow_processed_messages"}


async def table_names(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def test_upgrade_downgrade_upgrade(engine: AsyncEngine) -> None:
    assert await migrations.current(engine) is None
    await migrations.upgrade(engine)
    assert await table_names(engine) >= CONTRACT_TABLES
    assert await migrations.current(engine) == migrations.head_revision()

    await migrations.downgrade(engine, "base")
    assert await table_names(engine) == {"alembic_version"}
    assert await migrations.current(engine) is None

    await migrations.upgrade(engine)
    assert await table_names(engine) >= CONTRACT_TABLES


async def test_contract_columns_and_indexes(engine: AsyncEngine) -> None:
    await migrations.upgrade(engine)

    def describe(sync_conn: object) -> dict[str, object]:
        inspector = inspect(sync_conn)
        return {
            table: {
                "columns": {c["name"] for c in inspector.get_columns(table)},
                "indexes": {tuple(i["column_names"]) for i in inspector.get_indexes(table)},
                "fks": [
                    (fk["referred_table"], fk["options"].get("ondelete"))
                    for fk in inspector.get_foreign_keys(table)
                ],
            }
            for table in CONTRACT_TABLES
        }

    async with engine.connect() as conn:
        schema = await conn.run_sync(describe)
    assert schema["chatflow_sessions"]["columns"] == {  # type: ignore[index]
        "session_id",
        "active_agent_name",
        "title",
        "metadata_json",
        "created_at",
        "updated_at",
        "message_count",
    }
    assert schema["chatflow_messages"]["columns"] == {  # type: ignore[index]
        "id",
        "session_id",
        "position",
        "role",
        "message_json",
        "created_at",
    }
    assert ("session_id", "position") in schema["chatflow_messages"]["indexes"]  # type: ignore[index]
    assert schema["chatflow_messages"]["fks"] == [("chatflow_sessions", "CASCADE")]  # type: ignore[index]
    assert schema["chatflow_processed_messages"]["columns"] == {  # type: ignore[index]
        "message_key",
        "platform",
        "processed_at",
        "expires_at",
    }
    assert ("expires_at",) in schema["chatflow_processed_messages"]["indexes"]  # type: ignore[index]


async def test_check_passes_at_head_and_reports_drift(engine: AsyncEngine) -> None:
    await migrations.upgrade(engine)
    assert await migrations.check(engine) is None
    async with engine.begin() as conn:
        await conn.execute(text("DROP INDEX ix_chatflow_processed_messages_expires_at"))
    differences = await migrations.check(engine)
    assert differences is not None
    assert "ix_chatflow_processed_messages_expires_at" in differences


async def start_upgrade(env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        GATEWAY, "db", "upgrade", env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )


@pytest.mark.slow
async def test_concurrent_upgrades_from_several_processes_do_not_collide(
    database_url: str, engine: AsyncEngine
) -> None:
    # Separate processes, as replicas starting together would be (alembic's context is per process).
    env = gateway_env(GATEWAY_DATABASE_URL=database_url, GATEWAY_LOG_FORMAT="json")
    replicas = [await start_upgrade(env) for _ in range(4)]
    errors = [(await p.communicate())[1] for p in replicas]
    assert [p.returncode for p in replicas] == [0, 0, 0, 0], errors
    assert await migrations.current(engine) == migrations.head_revision()
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM alembic_version"))).scalar() == 1


def test_cli_db_commands(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", database_url)
    assert main(["db", "current"]) == 0
    assert "base" in capsys.readouterr().out
    assert main(["db", "upgrade"]) == 0
    assert f"database at {migrations.head_revision()}" in capsys.readouterr().out
    assert main(["db", "check"]) == 0
    assert "agree" in capsys.readouterr().out
    assert main(["db", "history"]) == 0
    assert f"{migrations.head_revision()} (head)" in capsys.readouterr().out
    assert main(["db", "downgrade", "base"]) == 0
    assert "database at base" in capsys.readouterr().out
    assert main(["db", "upgrade", "0001"]) == 0
    capsys.readouterr()
    assert main(["db", "downgrade", "nonexistent"]) == 1
    assert "gateway:" in capsys.readouterr().err


def test_cli_db_check_exits_1_on_drift(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", sqlite_url)
    assert main(["db", "upgrade"]) == 0
    engine = create_engine(sqlite_url)

    async def drop_index() -> None:
        async with engine.begin() as conn:
            await conn.execute(text("DROP INDEX ix_chatflow_sessions_updated_at_session_id"))
        await engine.dispose()

    asyncio.run(drop_index())
    capsys.readouterr()
    assert main(["db", "check"]) == 1
    assert "models and migrations differ" in capsys.readouterr().err


def test_plain_alembic_works_from_the_repository_root(sqlite_url: str) -> None:
    env = gateway_env(GATEWAY_DATABASE_URL=sqlite_url)
    alembic = str(Path(sys.executable).with_name("alembic"))
    upgrade = subprocess.run(
        [alembic, "upgrade", "head"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert upgrade.returncode == 0, upgrade.stderr
    current = subprocess.run(
        [alembic, "current"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert f"{migrations.head_revision()} (head)" in current.stdout
    check = subprocess.run(
        [alembic, "check"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stderr


@pytest.mark.postgres
@pytest.mark.slow
async def test_postgres_replicas_queue_on_the_migration_lock(postgres_url: str) -> None:
    """While one holder keeps the advisory lock, every replica's upgrade waits for it, then succeeds."""
    engine = create_engine(postgres_url)
    env = gateway_env(GATEWAY_DATABASE_URL=postgres_url, GATEWAY_LOG_FORMAT="json")
    try:
        async with engine.connect() as holder:
            await holder.execute(
                text("SELECT pg_advisory_xact_lock(:k)"), {"k": migrations.MIGRATION_LOCK_KEY}
            )
            replicas = [await start_upgrade(env) for _ in range(3)]
            waiting = await wait_for_lock_waiters(engine, expected=3)
            assert waiting == 3, "the replicas did not queue on the migration lock"
            assert await migrations.current(engine) is None, "a replica migrated while the lock was held"
            await holder.rollback()  # releases the lock
        errors = [(await p.communicate())[1] for p in replicas]
        assert [p.returncode for p in replicas] == [0, 0, 0], errors
        assert await migrations.current(engine) == migrations.head_revision()
    finally:
        await engine.dispose()


async def wait_for_lock_waiters(engine: AsyncEngine, expected: int) -> int:
    """Poll pg_locks (the server's own view) until `expected` sessions wait for an advisory lock."""
    query = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    count = 0
    for _ in range(600):  # bounded: about 60 s
        async with engine.connect() as conn:
            count = (await conn.execute(query)).scalar_one()
        if count >= expected:
            break
        await asyncio.sleep(0.1)
    return count


async def test_upgrading_with_a_backlog_gives_every_waiting_conversation_its_queue_head(
    database_url: str,
) -> None:
    """Migration 0007 on a database with messages waiting (one of them leased): every conversation's
    oldest pending message becomes claimable, in order, and the leased one stays with its holder."""
    from datetime import UTC, datetime, timedelta

    from gateway.store import inbox
    from gateway.store.database import Database

    db = Database.open(database_url)
    try:
        await migrations.upgrade(db, "0006")
        later = datetime.now(UTC) + timedelta(minutes=5)
        rows: list[tuple[str, str, str | None, datetime | None]] = [
            ("a", "pending", None, None),
            ("a", "pending", None, None),
            ("b", "done", None, None),
        ]
        rows += [
            ("b", "pending", None, None),
            ("c", "pending", "holder", later),
            ("c", "pending", None, None),
        ]
        async with db.begin() as conn:
            for number, (chat, status, owner, until) in enumerate(rows):
                await conn.execute(
                    text(
                        "INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, "
                        "text, message_json, status, attempts, next_attempt_at, received_at, lease_owner, "
                        "lease_until) VALUES (:key, 'telegram', :session, :id, 'text', :text, '{}', "
                        ":status, 0, :now, :now, :owner, :until)"
                    ),
                    {
                        "key": f"k{number}",
                        "session": f"telegram:{chat}",
                        "id": str(number),
                        "text": f"{chat}/{number}",
                        "status": status,
                        "now": datetime.now(UTC) - timedelta(seconds=1),
                        "owner": owner,
                        "until": until,
                    },
                )
        await migrations.upgrade(db)
        claimed = await inbox.claim(db, "new", timedelta(seconds=30), 10)
        assert [row.text for row in claimed] == ["a/0", "b/3"]  # c's first message is still leased
    finally:
        await db.aclose()


async def test_the_outage_columns_come_and_go_and_the_queue_heads_keep_working(database_url: str) -> None:
    """Migration 0010 adds the inbox's outage columns; its downgrade drops them without rebuilding the
    table, so the queue-head triggers (0007) still move a conversation on after it."""
    from datetime import UTC, datetime

    from gateway.store.database import Database

    def inbox_columns(sync_conn: object) -> set[str]:
        return {c["name"] for c in inspect(sync_conn).get_columns("chatflow_inbox")}

    db = Database.open(database_url)
    try:
        await migrations.upgrade(db)
        async with db.connect() as conn:
            assert {"outage_started_at", "holding_reply_at"} <= await conn.run_sync(inbox_columns)
        await migrations.downgrade(db, "0009")
        async with db.begin() as conn:
            assert not {"outage_started_at", "holding_reply_at"} & await conn.run_sync(inbox_columns)
            for number in range(2):
                await conn.execute(
                    text(
                        "INSERT INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, "
                        "text, message_json, status, attempts, next_attempt_at, received_at) VALUES "
                        "(:key, 'telegram', 'telegram:a', :id, 'text', :text, '{}', 'pending', 0, :now, :now)"
                    ),
                    {"key": f"k{number}", "id": str(number), "text": f"a/{number}", "now": datetime.now(UTC)},
                )
        # Read as that schema's code would: the claims of today's code need later columns.
        head = text(
            "SELECT i.text FROM chatflow_queue_heads AS h JOIN chatflow_inbox AS i ON i.id = h.next_id "
            "WHERE h.queue = 'chatflow_inbox' AND h.session_id = 'telegram:a'"
        )
        async with db.begin() as conn:
            assert (await conn.execute(head)).scalar_one() == "a/0"
            await conn.execute(text("UPDATE chatflow_inbox SET status = 'done' WHERE text = 'a/0'"))
        async with db.connect() as conn:
            assert (await conn.execute(head)).scalar_one() == "a/1"
    finally:
        await db.aclose()
