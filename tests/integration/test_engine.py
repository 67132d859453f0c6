"""The database layer: SQLite pragmas, file and in-memory databases, UTC datetimes, cascades."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import delete, func, insert, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import DatabaseUnavailableError
from gateway.store import dedup, migrations
from gateway.store.database import Database
from gateway.store.engine import create_engine, ping
from gateway.store.tables import MessageRow, ProcessedMessageRow, SessionRow
from tests.helpers import free_port


async def test_sqlite_pragmas_hold_on_every_connection(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'p.db'}")
    try:
        async with engine.connect() as first, engine.connect() as second:
            for conn in (first, second):
                values = [
                    (await conn.execute(text(f"PRAGMA {name}"))).scalar()
                    for name in ("journal_mode", "foreign_keys", "busy_timeout", "synchronous")
                ]
                assert values == ["wal", 1, 5000, 1]  # synchronous=1 is NORMAL
    finally:
        await engine.dispose()


async def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "gateway.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await ping(engine)
    finally:
        await engine.dispose()
    assert path.exists()


async def test_the_database_files_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    """They hold every conversation: the file, its WAL and its shared-memory index are mode 0600."""
    path = tmp_path / "data" / "gateway.db"
    database = Database.open(f"sqlite+aiosqlite:///{path}")
    try:
        await migrations.upgrade(database)
        assert await dedup.mark(database, "k", "telegram", timedelta(hours=1))  # through the writer thread
        files = [path, path.with_name("gateway.db-wal"), path.with_name("gateway.db-shm")]
        assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == dict.fromkeys(
            (f.name for f in files), "0o600"
        )
    finally:
        await database.aclose()


async def test_the_data_folder_it_creates_is_its_users_only(tmp_path: Path) -> None:
    """The finding: data/ was created 0755, so any local user could list it (and, with the old 0644
    database, read every conversation)."""
    path = tmp_path / "data" / "gateway.db"
    database = Database.open(f"sqlite+aiosqlite:///{path}")
    await database.aclose()
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


async def test_in_memory_database_is_one_shared_connection() -> None:
    engine = create_engine("sqlite+aiosqlite:///:memory:")
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (x INTEGER)"))
            await conn.execute(text("INSERT INTO t VALUES (7)"))
        async with engine.connect() as other:
            assert (await other.execute(text("SELECT x FROM t"))).scalar() == 7
    finally:
        await engine.dispose()


async def test_ping_an_unreachable_server_raises_a_clear_error() -> None:
    engine = create_engine(f"postgresql+asyncpg://postgres:s3cret-pw@127.0.0.1:{free_port()}/x")
    try:
        with pytest.raises(DatabaseUnavailableError) as caught:
            await ping(engine)
    finally:
        await engine.dispose()
    assert "cannot use the database at postgresql+asyncpg://postgres:***@127.0.0.1" in str(caught.value)
    assert "s3cret-pw" not in str(caught.value)


async def seed_session(engine: AsyncEngine, session_id: str, messages: int) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(SessionRow).values(session_id=session_id, message_count=messages))
        for position in range(messages):
            await conn.execute(
                insert(MessageRow).values(
                    session_id=session_id, position=position, role="user", message_json={"content": "hi"}
                )
            )


async def test_deleting_a_session_cascades_to_its_messages(engine: AsyncEngine) -> None:
    await migrations.upgrade(engine)
    await seed_session(engine, "whatsapp:1:alice", 3)
    await seed_session(engine, "telegram:42", 2)
    async with engine.begin() as conn:
        await conn.execute(delete(SessionRow).where(SessionRow.session_id == "whatsapp:1:alice"))
    async with engine.connect() as conn:
        counts = dict(
            (
                await conn.execute(
                    select(MessageRow.session_id, func.count()).group_by(MessageRow.session_id)
                )
            ).all()
        )
    assert counts == {"telegram:42": 2}


async def test_a_message_needs_an_existing_session(engine: AsyncEngine) -> None:
    await migrations.upgrade(engine)
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(
                insert(MessageRow).values(session_id="ghost", position=0, role="user", message_json={})
            )


async def test_datetimes_come_back_timezone_aware_utc(engine: AsyncEngine) -> None:
    await migrations.upgrade(engine)
    local = datetime(2026, 11, 30, 12, 0, tzinfo=timezone(timedelta(hours=3)))
    async with engine.begin() as conn:
        await conn.execute(
            insert(ProcessedMessageRow).values(message_key="wa:msg:1", platform="whatsapp", expires_at=local)
        )
    async with engine.connect() as conn:
        row = (await conn.execute(select(ProcessedMessageRow))).one()
    assert row.expires_at == local
    assert row.expires_at.tzinfo == UTC
    assert row.processed_at.tzinfo == UTC


async def test_naive_datetimes_are_refused(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        await migrations.upgrade(engine)
        with pytest.raises(Exception, match="naive datetime"):
            async with engine.begin() as conn:
                await conn.execute(
                    insert(ProcessedMessageRow).values(
                        message_key="k",
                        platform="telegram",
                        expires_at=datetime(2026, 1, 1),  # noqa: DTZ001
                    )
                )
    finally:
        await engine.dispose()


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgres://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql+psycopg2://u@h/db", "postgresql+asyncpg://u@h/db"),
    ],
)
def test_sync_driver_urls_are_run_with_the_async_driver(given: str, used: str) -> None:
    from gateway.store.engine import async_url

    assert async_url(given).render_as_string() == used


async def test_a_store_accepts_a_plain_sqlite_url(tmp_path: Path) -> None:
    from gateway.agents import Agent, Runner, ScriptedModel, SQLSessionStore

    store = SQLSessionStore(f"sqlite:///{tmp_path / 'plain.db'}")
    runner = Runner(Agent("A", "a", model=ScriptedModel()), store)
    assert (await runner.run_async("s", "hello")).content == "Hello! How can I help you today?"
    await store.aclose()
    assert (tmp_path / "plain.db").is_file()


@pytest.mark.postgres
async def test_a_pooled_connection_left_in_a_broken_driver_state_is_replaced(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg left mid-operation ("cannot switch to state 11; another operation is in progress", an
    InternalClientError, seen after a terminated backend) is still open, so SQLAlchemy's asyncpg
    dialect does not count it as a disconnect and pooled it again: every later use of it failed. The
    operation fails once; the connection is dropped, not the pool."""
    import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

    engine = create_engine(postgres_url, pool_size=1)  # one connection: a kept one would serve again
    prepare = asyncpg.Connection.prepare
    broken: list[int] = []

    async def prepare_once_broken(self: asyncpg.Connection, query: str, **kwargs: object) -> object:
        if not broken and "broken" in query:
            broken.append(1)
            raise asyncpg.InternalClientError("cannot switch to state 11; another operation is in progress")
        return await prepare(self, query, **kwargs)

    try:
        async with engine.connect() as conn:
            before = await conn.scalar(text("SELECT pg_backend_pid()"))
        monkeypatch.setattr(asyncpg.Connection, "prepare", prepare_once_broken)
        with pytest.raises(DBAPIError):
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1 AS broken"))
        async with engine.connect() as conn:
            after = await conn.scalar(text("SELECT pg_backend_pid()"))
    finally:
        await engine.dispose()
    assert broken == [1]
    assert after != before  # a fresh connection, not the one the driver left broken
