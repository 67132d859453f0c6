"""PostgreSQL's held connections for the per-message statements (gateway/store/postgres_lanes.py).

Errors must reach callers as SQLAlchemy's did (the refused-value and unavailable rules of
store/database.py depend on their types); a lost connection must cost one statement, not one per
lane; a caller must not wait for a lane longer than the pool's timeout; a webhook's ingest goes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Integer, String, bindparam, text
from sqlalchemy.exc import DataError, IntegrityError, OperationalError

from gateway.store import engine as engines
from gateway.store.database import Database, refused_value
from gateway.store.postgres_lanes import PostgresLanes, Statement

pytestmark = pytest.mark.postgres

ECHO = Statement(text("SELECT CAST(:value AS integer) + 1").bindparams(bindparam("value", type_=Integer)))
SLEEP = Statement(text("SELECT pg_sleep(CAST(:seconds AS float8)), CAST(:tag AS text)"))
INSERT = Statement(
    text("INSERT INTO lanes_probe (k) VALUES (:k) RETURNING k").bindparams(bindparam("k", type_=String))
)
BACKEND_PID = Statement(text("SELECT pg_backend_pid()"))
BACKENDS = text(
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


@pytest.fixture
async def db(postgres_url: str) -> AsyncIterator[Database]:
    database = Database(engines.create_engine(postgres_url, pool_size=6, pool_timeout=2))
    async with database.begin() as conn:
        await conn.execute(text("DROP TABLE IF EXISTS lanes_probe"))
        await conn.execute(text("CREATE TABLE lanes_probe (k text PRIMARY KEY)"))
    yield database
    async with database.begin() as conn:
        await conn.execute(text("DROP TABLE IF EXISTS lanes_probe"))
    await database.aclose()


async def test_a_statement_runs_on_a_held_connection_and_gives_its_rows(db: Database) -> None:
    assert db.postgres is not None
    rows = await asyncio.gather(*(db.postgres.fetch(ECHO, {"value": n}) for n in range(50)))
    assert [row[0][0] for row in rows] == [n + 1 for n in range(50)]
    async with db.connect() as conn:
        held = len((await conn.execute(BACKENDS)).all())
    assert held == 3  # half the pool of 6: the lanes stay open between statements


async def test_errors_are_sqlalchemys_and_keep_their_meaning(db: Database) -> None:
    assert db.postgres is not None
    await db.postgres.fetch(INSERT, {"k": "a"})
    with pytest.raises(IntegrityError) as duplicate:
        await db.postgres.fetch(INSERT, {"k": "a"})
    with pytest.raises(DataError) as nul:
        await db.postgres.fetch(INSERT, {"k": "nul \x00 inside"})
    with pytest.raises(DataError) as wrong_type:
        await db.postgres.fetch(ECHO, {"value": "not a number"})
    assert all(refused_value(e.value) for e in (duplicate, nul, wrong_type))
    assert "inside" not in str(nul.value)  # no value in a log line
    assert "not a number" not in str(wrong_type.value)
    assert (await db.postgres.fetch(ECHO, {"value": 1}))[0][0] == 2  # the lanes go on


async def test_a_lost_connection_fails_one_statement_and_every_lane_reconnects(db: Database) -> None:
    assert db.postgres is not None
    await asyncio.gather(*(db.postgres.fetch(SLEEP, {"seconds": 0.05, "tag": str(n)}) for n in range(6)))
    async with db.connect() as conn:
        await conn.execute(text(f"SELECT pg_terminate_backend(pid) FROM ({BACKENDS.text}) AS lanes"))
    failures = 0
    for n in range(6):
        try:
            assert (await db.postgres.fetch(ECHO, {"value": n}))[0][0] == n + 1
        except OperationalError:
            failures += 1
    assert failures == 1


async def test_a_driver_left_in_a_broken_state_costs_one_statement_and_its_connection(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend terminated at the wrong moment left asyncpg's protocol mid-operation (CI, 2026-12-04:
    "cannot switch to state 11; another operation (2) is in progress", an InternalClientError, which
    is neither a PostgresError nor an InterfaceError). That connection serves nothing again: the lane
    must drop it and the caller must see the unavailable error, as for any lost connection."""
    import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type hints

    lanes = PostgresLanes(db.engine, 1, 5.0)  # one lane: every statement runs on its connection
    fetch = asyncpg.Connection.fetch
    broken: list[int] = []

    async def fetch_once_broken(self: asyncpg.Connection, query: str, *args: object) -> list[object]:
        if not broken:
            broken.append(1)
            raise asyncpg.InternalClientError("cannot switch to state 11; another operation is in progress")
        rows: list[object] = await fetch(self, query, *args)
        return rows

    try:
        before = (await lanes.fetch(BACKEND_PID, {}))[0][0]
        monkeypatch.setattr(asyncpg.Connection, "fetch", fetch_once_broken)
        with pytest.raises(OperationalError):
            await lanes.fetch(ECHO, {"value": 1})
        after = (await lanes.fetch(BACKEND_PID, {}))[0][0]
    finally:
        await lanes.aclose()
    assert after != before  # a fresh connection, not the broken one


async def test_a_caller_waits_for_a_lane_no_longer_than_the_pool_timeout(db: Database) -> None:
    assert db.postgres is not None
    busy = [asyncio.ensure_future(db.postgres.fetch(SLEEP, {"seconds": 3, "tag": str(n)})) for n in range(3)]
    late = asyncio.ensure_future(db.postgres.fetch(ECHO, {"value": 1}))  # queued behind the three (tasks
    started = asyncio.get_running_loop().time()  # start in the order they were made)
    with pytest.raises(TimeoutError):
        await late
    assert asyncio.get_running_loop().time() - started < 3  # it gave up (2 s) before a lane freed up
    assert [rows[0][1] for rows in await asyncio.gather(*busy)] == ["0", "1", "2"]  # started ones finish


async def test_ingest_goes_before_the_statements_queued_ahead_of_it(db: Database) -> None:
    lanes = PostgresLanes(db.engine, 1, 5.0)  # one lane: the queue decides the order
    finished: list[str] = []

    async def run(tag: str, *, urgent: bool = False) -> None:
        await lanes.fetch(SLEEP, {"seconds": 0.01, "tag": tag}, urgent=urgent)
        finished.append(tag)

    try:
        queued = [asyncio.ensure_future(run(f"turn {n}")) for n in range(4)]
        ingest = asyncio.ensure_future(run("ingest", urgent=True))
        await asyncio.gather(*queued, ingest)
    finally:
        await lanes.aclose()
    # Every call queued before the lane's first take; the webhook's went first all the same.
    assert finished == ["ingest", "turn 0", "turn 1", "turn 2", "turn 3"]


async def test_a_pool_of_one_holds_nothing(postgres_url: str) -> None:
    db = Database(engines.create_engine(postgres_url, pool_size=1, pool_timeout=2))
    try:
        assert db.postgres is not None
        assert (await db.postgres.fetch(ECHO, {"value": 41}))[0][0] == 42
        async with db.connect() as conn:  # the one connection is back in the pool
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await db.aclose()
