"""Shared fixtures: a clean environment per test, and databases on every backend."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.agents import BaseSessionStore, SessionStore, SQLiteSessionStore, SQLSessionStore
from gateway.store import migrations
from gateway.store.database import Database
from gateway.store.engine import create_engine
from tests.helpers import postgres_database

POSTGRES_ENV = "GATEWAY_TEST_POSTGRES_URL"
POSTGRES_SKIP_REASON = f"{POSTGRES_ENV} is not set, so no PostgreSQL server is known to these tests"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No GATEWAY_* setting leaks in from the shell, and no config/gateway.toml from the checkout."""
    for name in list(os.environ):
        if name.upper().startswith("GATEWAY_") and name != POSTGRES_ENV:
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'db' / 'gateway.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty database on the test server, dropped afterwards."""
    admin_url = os.environ.get(POSTGRES_ENV)
    if not admin_url:
        pytest.skip(reason=POSTGRES_SKIP_REASON)
    with postgres_database(admin_url) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str:
    """The same test on an SQLite file and on PostgreSQL."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def migrated_url(database_url: str) -> str:
    """`database_url` with the schema at head, for tests that start the app or read tables."""

    async def migrate() -> None:
        engine = create_engine(database_url)
        try:
            await migrations.upgrade(engine)
        finally:
            await engine.dispose()

    asyncio.run(migrate())
    return database_url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    """The service's view of `database_url`: its Database (on an SQLite file, with the writer thread)."""
    database = Database.open(database_url)
    yield database
    await database.aclose()


@pytest.fixture
async def migrated_database(database: Database) -> Database:
    """`database` with the schema at head."""
    await migrations.upgrade(database)
    return database


@pytest.fixture(
    params=["memory", "sqlite-file", "sqlite-memory", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BaseSessionStore]:
    """Every session store: in memory, SQLite file, SQLite :memory:, PostgreSQL."""
    made: BaseSessionStore
    if request.param == "memory":
        made = SessionStore()
    elif request.param == "sqlite-file":
        made = SQLiteSessionStore(tmp_path / "sessions.db")
    elif request.param == "sqlite-memory":
        made = SQLiteSessionStore(":memory:")
    else:
        made = SQLSessionStore(request.getfixturevalue("postgres_url"))
    yield made
    await made.aclose()
