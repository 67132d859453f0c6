"""Queue-head versions: what writes one, and what a look-up of a head walks while a snapshot is held.

Every version written is one a held snapshot keeps (benchmarks/soak.py). A push that changes nothing
writes nothing (migration 0013): on PostgreSQL the head row's `xmin` (the transaction that wrote its
current version) says whether it was written; the SQLite file counts the rows changed. On PostgreSQL
every write of a head is a new `ver`, the key's last column, and every look-up reads the key backwards
from the newest version (0019): it reads one or two entries however many versions a held snapshot keeps,
where a look-up by `(queue, session_id)` alone reads them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import insert, select, text, update

from gateway.store import inbox, leases
from gateway.store.database import Database
from gateway.store.postgres_lanes import PostgresLanes, Statement
from gateway.store.tables import InboxRow
from tests.integration.test_claim_hints import inbox_row
from tests.integration.test_migrations import wait_for_lock_waiters

HEAD_VERSION = {
    "postgresql": "SELECT xmin::text FROM chatflow_queue_heads WHERE queue = 'chatflow_inbox' "
    "AND session_id = 'telegram:a'",
    "sqlite": "SELECT total_changes()",
}


@pytest.fixture
def db(migrated_database: Database) -> Database:
    return migrated_database


@pytest.fixture
def postgres_only(db: Database) -> None:
    """Skips on the SQLite file, saying why: only PostgreSQL keeps old row versions for a held snapshot."""
    if db.dialect != "postgresql":
        pytest.skip(reason="only PostgreSQL keeps old row versions for a held snapshot")


async def test_a_newer_message_leaves_the_head_as_it_was(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row("a", 0, now)])
    if db.dialect == "postgresql":
        async with db.begin() as conn:
            before = (await conn.execute(text(HEAD_VERSION["postgresql"]))).scalar_one()
            await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
        async with db.connect() as conn:
            after = (await conn.execute(text(HEAD_VERSION["postgresql"]))).scalar_one()
        assert after == before
    else:
        async with db.begin() as conn:  # one connection: total_changes() counts its own writes
            before = (await conn.execute(text(HEAD_VERSION["sqlite"]))).scalar_one()
            await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
            after = (await conn.execute(text(HEAD_VERSION["sqlite"]))).scalar_one()
        assert after - before == 1  # the inbox row; the head was not written
    claimed = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert [row.text for row in claimed] == ["a/0"]


async def test_an_older_row_back_in_the_queue_is_the_head_again(db: Database) -> None:
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row("a", 0, now)])
    (first,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    async with db.begin() as conn:
        await conn.execute(
            update(InboxRow).where(InboxRow.id == first.id).values(status="dead", lease_owner=None)
        )
        await conn.execute(insert(InboxRow), [inbox_row("a", 1, now)])
        await conn.execute(update(InboxRow).where(InboxRow.id == first.id).values(status="pending"))
    claimed = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert [row.text for row in claimed] == ["a/0"]  # the requeued older row goes first


PENDING_INDEX_READS = (
    "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'ix_chatflow_inbox_pending'"
)


async def _settle(db: Database, row_id: int) -> None:
    """Mark a claimed row done, as a turn's commit does; the settled trigger refreshes the head."""
    async with db.begin() as conn:
        await conn.execute(
            update(InboxRow)
            .where(InboxRow.id == row_id)
            .values(status="done", lease_owner=None, lease_until=None)
        )
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))  # counted once this commits


async def _store_a(db: Database, count: int) -> datetime:
    """`count` messages of conversation a, due now; their due time."""
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row("a", n, now) for n in range(count)])
    return now


@contextlib.asynccontextmanager
async def _held_snapshot(db: Database, settled: int, hinted: bool = False) -> AsyncIterator[None]:
    """A long report's snapshot held open (it keeps every row version written meanwhile), and
    `settled` of conversation a's rows claimed and settled under it: two head versions each."""
    async with db.connect() as holder:
        await holder.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        await holder.execute(text("SELECT count(*) FROM chatflow_inbox"))
        for _ in range(settled):
            sessions = ["telegram:a"] if hinted else None
            (row,) = await inbox.claim(db, "w", timedelta(seconds=30), 10, sessions=sessions)
            await _settle(db, row.id)
        yield
        await holder.rollback()


@pytest.mark.usefixtures("postgres_only")
async def test_a_settle_under_a_held_snapshot_skips_the_conversations_earlier_rows(db: Database) -> None:
    """Migration 0014: while a snapshot is held, the pending index keeps an entry for every row of the
    conversation that was ever pending; the head's refresh starts at the head, not at the first of them."""
    settled = 100
    await _store_a(db, settled + 2)
    async with _held_snapshot(db, settled):
        (row,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
        async with db.connect() as conn:
            before = (await conn.execute(text(PENDING_INDEX_READS))).scalar_one()
        await _settle(db, row.id)
        async with db.connect() as conn:
            after = (await conn.execute(text(PENDING_INDEX_READS))).scalar_one()
    assert after - before < 10  # the head's row and the next; unbounded, each of the 100 settled too
    (last,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert last.text == f"a/{settled + 1}"


HEAD_KEY_READS = (
    "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'pk_chatflow_queue_heads'"
)
HEAD_INDEX_READS = "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = 'chatflow_queue_heads'"
HEAD_A = "FROM chatflow_queue_heads WHERE queue = 'chatflow_inbox' AND session_id = 'telegram:a'"


async def _head_key_reads(db: Database, statement: str = HEAD_KEY_READS) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(text(statement))).scalar_one())


async def _one_key_walk(db: Database) -> int:
    """Key entries a look-up of conversation a's head by `(queue, session_id)` alone reads: one per
    version a held snapshot keeps."""
    before = await _head_key_reads(db)
    async with db.begin() as conn:
        await conn.execute(text(f"SELECT 1 {HEAD_A}"))
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))
    return await _head_key_reads(db) - before


NEWEST_FIRST = 3  # the newest version's entry, and one of a version not yet committed, plus one spare


@pytest.mark.usefixtures("postgres_only")
@pytest.mark.parametrize("hand_on", [False, True], ids=["let-go", "handed-on"])
async def test_a_settle_reads_the_newest_head_version_alone(db: Database, hand_on: bool) -> None:
    """Migration 0019: the settle trigger locks the head's newest version (a backward scan of the key,
    `LIMIT 1`), then updates the version it locked (by ctid, 0017), past every version a held snapshot
    keeps."""
    settled = 100
    await _store_a(db, settled + 3)
    async with _held_snapshot(db, settled):
        (row,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
        one_walk = await _one_key_walk(db)

        before = await _head_key_reads(db)
        if hand_on:  # lease owner kept with a new end: the next row is leased to "w" with the head
            await _hand_on(db, row.id, datetime.now(UTC) + timedelta(seconds=60))
        else:
            await _settle(db, row.id)
        settle = await _head_key_reads(db) - before
    assert one_walk > settled  # the held snapshot keeps a key entry per head version
    assert settle <= NEWEST_FIRST  # before 0019, one_walk
    async with db.connect() as conn:
        owner, next_id = (await conn.execute(text(f"SELECT lease_owner, next_id {HEAD_A}"))).one()
        next_row = (await conn.execute(select(InboxRow.text).where(InboxRow.id == next_id))).scalar_one()
    assert next_row == f"a/{settled + 1}"
    assert owner == ("w" if hand_on else None)


@pytest.mark.usefixtures("postgres_only")
async def test_a_push_reads_the_newest_head_version_alone(db: Database) -> None:
    """A message stored for a conversation whose head a held snapshot keeps many versions of: its push
    (the inbox's insert trigger) finds the head newest version first, and makes it point at the
    message."""
    settled = 100
    await _store_a(db, settled)
    async with _held_snapshot(db, settled):
        one_walk = await _one_key_walk(db)
        before = await _head_key_reads(db)
        async with db.begin() as conn:
            await conn.execute(insert(InboxRow), [inbox_row("a", settled, datetime.now(UTC))])
            await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        push = await _head_key_reads(db) - before
    assert one_walk > settled
    assert push <= NEWEST_FIRST
    (row,) = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert row.text == f"a/{settled}"


@pytest.mark.usefixtures("postgres_only")
async def test_a_hinted_claim_reads_the_newest_head_version_alone(db: Database) -> None:
    """A hinted claim finds each named head newest version first, locks it by its whole key and leases
    the version it locked (by ctid). Every index of the heads is counted: the look-up may go by the due
    index or by the key."""
    settled = 100
    now = await _store_a(db, settled + 2)
    later = now + timedelta(hours=1)  # other conversations' heads, not due: the planner's size of the table
    async with db.begin() as conn:
        await conn.execute(insert(InboxRow), [inbox_row(f"other{n}", 0, later) for n in range(2000)])
        await conn.execute(text("ANALYZE chatflow_queue_heads"))
    async with _held_snapshot(db, settled, hinted=True):
        one_walk = await _one_key_walk(db)

        before = await _head_key_reads(db, HEAD_INDEX_READS)
        async with db.connect() as conn:  # the claim's statement, as the lanes run it, on a connection
            driver = (await conn.get_raw_connection()).driver_connection  # whose counts can be flushed
            claimed = await leases.claim_on_postgres(
                cast(PostgresLanes, _OneConnection(db, driver)),
                InboxRow,
                ("text",),
                "w",
                now,
                now + timedelta(seconds=30),
                10,
                ["telegram:a"],
            )
            await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        claim = await _head_key_reads(db, HEAD_INDEX_READS) - before
    assert [body for _, body in claimed] == [f"a/{settled}"]
    assert one_walk > settled
    assert claim <= 2 * NEWEST_FIRST  # the newest version's look-up, then its lock by the whole key
    async with db.connect() as conn:
        assert (await conn.execute(text(f"SELECT lease_owner {HEAD_A}"))).scalar_one() == "w"


class _OneConnection:
    """What a claim needs of PostgresLanes, on one asyncpg connection of the test's."""

    def __init__(self, db: Database, driver: Any) -> None:
        self.db, self.driver = db, driver

    async def fetch(self, statement: Statement, params: dict[str, Any]) -> list[Any]:
        sql, args = statement.bind(self.db.engine, params)
        return list(await self.driver.fetch(sql, *args))


async def _hand_on(db: Database, row_id: int, until: datetime) -> None:
    """Mark a claimed row done with its lease kept and a new end: its conversation's next row goes on
    to the same owner (migration 0015), as a turn's commit asks for it."""
    async with db.begin() as conn:
        await conn.execute(
            update(InboxRow).where(InboxRow.id == row_id).values(status="done", lease_until=until)
        )
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))


async def _head_a(db: Database) -> tuple[int, datetime, str | None]:
    """Conversation a's head: (next_id, due_at, lease_owner), its index reads counted at once."""
    async with db.begin() as conn:
        head = (await conn.execute(text(f"SELECT next_id, due_at, lease_owner {HEAD_A}"))).one()
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))
    return cast(tuple[int, datetime, str | None], tuple(head))


@pytest.mark.usefixtures("postgres_only")
async def test_hand_ons_under_a_held_snapshot_keep_the_head_look_ups_flat(db: Database) -> None:
    """A hand-on (a busy conversation's one head write a turn) under a held snapshot: the hundredth
    reads the head's key no more than the first, though the snapshot keeps every version between."""
    handed = 100
    await _store_a(db, handed + 2)
    await inbox.claim(db, "w", timedelta(seconds=60), 10)
    row_id, lease_end, _ = await _head_a(db)
    reads = []
    async with _held_snapshot(db, 0):
        for n in range(handed):
            before = await _head_key_reads(db)
            await _hand_on(db, row_id, datetime.now(UTC) + timedelta(seconds=60, microseconds=n))
            reads.append(await _head_key_reads(db) - before)
            next_id, due_at, owner = await _head_a(db)
            assert (next_id > row_id, due_at, owner) == (True, lease_end, "w")
            row_id = next_id
        one_walk = await _one_key_walk(db)
    assert one_walk > handed  # the held versions, each with its key entry
    assert max(reads) <= NEWEST_FIRST
    async with db.connect() as conn:
        body = (await conn.execute(select(InboxRow.text).where(InboxRow.id == row_id))).scalar_one()
    assert body == f"a/{handed}"


@pytest.mark.usefixtures("postgres_only")
async def test_a_hand_on_with_less_than_half_the_lease_left_moves_the_heads_end(db: Database) -> None:
    """The head's end is what a claim goes by: a hand-on keeps it only while at least half the lease
    it asks for is left, so a live owner's heartbeat (every third of a lease) always renews it in time."""
    await _store_a(db, 3)
    (row,) = await inbox.claim(db, "w", timedelta(seconds=10), 10)
    _, claimed_end, _ = await _head_a(db)
    until = datetime.now(UTC) + timedelta(seconds=60)  # 10 s left of 60: less than half
    await _hand_on(db, row.id, until)
    next_id, due_at, owner = await _head_a(db)
    assert (due_at, owner) == (until, "w")
    assert due_at > claimed_end
    await _hand_on(db, next_id, until + timedelta(seconds=1))  # 60 s left of 61: kept
    assert (await _head_a(db))[1:] == (until, "w")
    assert await inbox.claim(db, "other", timedelta(seconds=30), 10) == []


async def test_two_transactions_creating_one_conversations_head_make_one(db: Database) -> None:
    """Migration 0019: no unique index on `(queue, session_id)` keeps a conversation to one head; the
    push creates a head only under an advisory lock of the conversation, after looking for it again.
    The second of two transactions storing a new conversation's first messages waits for the first,
    then pushes onto its head (its own message, newer, leaves the head as it is)."""
    if db.dialect != "postgresql":
        pytest.skip(reason="the SQLite file has one writer at a time and a unique key on (queue, session_id)")
    now = datetime.now(UTC) - timedelta(seconds=1)
    async with db.engine.connect() as first, db.engine.connect() as second:
        await first.begin()
        await first.execute(insert(InboxRow), [inbox_row("new", 0, now)])
        await second.begin()
        storing = asyncio.create_task(second.execute(insert(InboxRow), [inbox_row("new", 1, now)]))
        assert await wait_for_lock_waiters(db.engine, expected=1) == 1, "the second did not wait"
        assert not storing.done()
        await first.commit()
        await storing
        await second.commit()
    async with db.connect() as conn:
        heads = (
            await conn.execute(
                text(
                    "SELECT i.text FROM chatflow_queue_heads AS h "
                    "JOIN chatflow_inbox AS i ON i.id = h.next_id "
                    "WHERE h.queue = 'chatflow_inbox' AND h.session_id = 'telegram:new'"
                )
            )
        ).all()
    assert [tuple(head) for head in heads] == [("new/0",)]
    claimed = await inbox.claim(db, "w", timedelta(seconds=30), 10)
    assert [row.text for row in claimed] == ["new/0"]
