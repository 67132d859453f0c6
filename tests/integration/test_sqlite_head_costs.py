"""On the SQLite file, settling a queued row costs the same whatever the backlog.

Every turn's commit and every sent reply settles a row, and the queue-head trigger then looks up its
conversation's oldest pending row. SQLite's planner once walked the whole backlog for that look-up
(migration 0011 says why): the cost is counted here in SQLite VM steps, which, unlike time, do not
depend on the machine or its load.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gateway.store import migrations
from gateway.store.database import Database

SMALL, LARGE = 100, 20_000
BUSY = 500  # conversations the backlog is spread over
QUIET = 50  # conversations of one message each, the oldest: settling one leaves its conversation empty

INSERT = {
    "chatflow_inbox": (
        "INSERT INTO chatflow_inbox (id, dedup_key, platform, session_id, message_id, kind, message_json, "
        "status, attempts, next_attempt_at, received_at, lease_owner) VALUES "
        "(?1, 'k' || ?1, 'telegram', ?2, ?1, 'text', '{}', 'pending', 0, '2026-01-01', '2026-01-01', 'w')"
    ),
    "chatflow_outbox": (
        "INSERT INTO chatflow_outbox (id, inbox_id, platform, session_id, kind, text, target_json, status, "
        "attempts, next_attempt_at, created_at, updated_at, lease_owner) VALUES "
        "(?1, ?1, 'telegram', ?2, 'text', 'hi', '{}', 'pending', 0, '2026-01-01', '2026-01-01', "
        "'2026-01-01', 'w')"
    ),
}
HEADS = "SELECT session_id, next_id FROM chatflow_queue_heads WHERE queue = ?"
SETTLE = {
    "chatflow_inbox": "UPDATE chatflow_inbox SET status = 'done', lease_owner = NULL WHERE id = ?",
    "chatflow_outbox": "UPDATE chatflow_outbox SET status = 'sent', lease_owner = NULL WHERE id = ?",
}


@pytest.fixture
async def migrated_file(tmp_path: Path) -> Path:
    path = tmp_path / "gateway.db"
    db = Database.open(f"sqlite+aiosqlite:///{path}")
    try:
        await migrations.upgrade(db)
    finally:
        await db.aclose()
    return path


def steps_per_settle(path: Path, table: str, backlog: int) -> float:
    """VM steps of settling one leased row whose conversation has nothing else waiting (the look-up's
    worst case: no pending row of that conversation stops a walk), with `backlog` rows pending in
    other conversations."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("DELETE FROM chatflow_outbox")
        conn.execute("DELETE FROM chatflow_inbox")
        conn.execute("DELETE FROM chatflow_queue_heads")
        sessions = [f"telegram:quiet{n}" for n in range(QUIET)]
        sessions += [f"telegram:busy{n % BUSY}" for n in range(backlog)]
        conn.execute("BEGIN")
        conn.executemany(INSERT[table], enumerate(sessions, 1))
        conn.execute("COMMIT")
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0  # go on

        conn.set_progress_handler(count, 1)
        for row_id in range(1, QUIET + 1):
            assert conn.execute(SETTLE[table], (row_id,)).rowcount == 1
        conn.set_progress_handler(None, 1)
        heads = dict(conn.execute(HEADS, (table,)))
        assert {heads[session] for session in sessions[:QUIET]} == {None}  # nothing left to claim there
        return steps / QUIET
    finally:
        conn.close()


@pytest.mark.parametrize("table", sorted(INSERT))
def test_a_settle_costs_the_same_at_any_backlog(migrated_file: Path, table: str) -> None:
    small = steps_per_settle(migrated_file, table, SMALL)
    large = steps_per_settle(migrated_file, table, LARGE)
    assert large <= 2 * small, f"{table}: {small:.0f} VM steps per settle at {SMALL}, {large:.0f} at {LARGE}"


def test_a_settled_conversation_moves_on_to_its_next_row(migrated_file: Path) -> None:
    """The pinned index still finds the right row: the conversation's next pending one."""
    steps_per_settle(migrated_file, "chatflow_inbox", SMALL)
    # 100 rows over 500 busy conversations: busy0 holds row 51 alone, busy1 row 52.
    conn = sqlite3.connect(migrated_file, isolation_level=None)
    try:
        conn.execute(INSERT["chatflow_inbox"], (1000, "telegram:busy0"))
        conn.execute(SETTLE["chatflow_inbox"], (51,))
        conn.execute(SETTLE["chatflow_inbox"], (52,))
        conn.execute("UPDATE chatflow_inbox SET status = 'pending' WHERE id = 1")  # quiet0 requeued
        heads = dict(conn.execute(HEADS, ("chatflow_inbox",)))
    finally:
        conn.close()
    assert heads["telegram:busy0"] == 1000
    assert heads["telegram:busy1"] is None
    assert heads["telegram:quiet0"] == 1
    assert heads["telegram:busy2"] == 53
