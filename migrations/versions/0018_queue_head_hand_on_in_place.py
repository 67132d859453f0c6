"""PostgreSQL: a hand-on moves its queue head without touching an indexed column, so the new version
is a HOT update (no new index entries) whenever its page has room.

Why: every head version written while a snapshot is held open (a long report, `pg_dump`, an idle
replication slot) that is not a HOT update adds an entry to the head's key, which every later look-up
of that head walks (claims, the settle triggers' locks, pushes). A hand-on (0015) is the one head
update of a busy conversation's turn, and it changed two indexed columns: `next_id`, named by the due
index's predicate, and `due_at`, its key. Now:
- the due index leaves heads out by `due_at IS NULL` instead of `next_id IS NULL` (a head has a
  `due_at` exactly while it has a `next_id`: every writer sets both, from the same row);
- a hand-on keeps the head's lease end (`due_at`) while at least half of the lease asked for is left,
  and moves it to the new end only otherwise. The heartbeat renews every third of a lease, so the head
  of a live owner never expires; a frozen owner's conversation comes back at the head's end, which
  may now be before its row's (a claim goes by the head's, never by the row's).
The SQLite file keeps its triggers and index: its look-ups never meet old versions.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
DUE_INDEX = "ix_chatflow_queue_heads_due"

# 0017's, with the head's lease end kept from its lock and kept on a hand-on while half the lease is left.
_IN_PLACE = """
DECLARE
  head_at tid;
  head_next bigint;
  head_due timestamptz;
  head_owner varchar;
  row_next bigint;
  row_due timestamptz;
  row_owner varchar;
  new_due timestamptz;
BEGIN
  SELECT h.ctid, h.next_id, h.due_at, h.lease_owner INTO head_at, head_next, head_due, head_owner
    FROM chatflow_queue_heads AS h
    WHERE h.queue = '{table}' AND h.session_id = NEW.session_id FOR UPDATE;
  SELECT p.id, p.next_attempt_at, p.lease_owner INTO row_next, row_due, row_owner FROM {table} AS p
    WHERE p.session_id = NEW.session_id AND p.status = 'pending' AND p.id >= COALESCE(head_next, 0)
    ORDER BY p.id LIMIT 1;
  IF NEW.status <> 'pending' AND NEW.lease_owner IS NOT NULL AND NEW.lease_owner = OLD.lease_owner
     AND NEW.lease_until IS DISTINCT FROM OLD.lease_until AND head_owner = OLD.lease_owner
     AND row_next IS NOT NULL AND row_due <= now() AND (row_owner IS NULL OR row_owner = NEW.lease_owner)
  THEN
    IF row_owner IS NULL THEN
      UPDATE {table} SET lease_owner = NEW.lease_owner, lease_until = NEW.lease_until
        WHERE id = row_next;
    END IF;
    new_due := CASE WHEN head_due >= now() + (NEW.lease_until - now()) / 2 THEN head_due
                    ELSE NEW.lease_until END;
    UPDATE chatflow_queue_heads
      SET next_id = row_next, due_at = new_due, lease_owner = NEW.lease_owner
      WHERE ctid = head_at
      AND (next_id, due_at, lease_owner) IS DISTINCT FROM (row_next, new_due, NEW.lease_owner);
  ELSE
    UPDATE chatflow_queue_heads SET next_id = row_next, due_at = row_due, lease_owner = NULL
      WHERE ctid = head_at AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner);
  END IF;
  RETURN NULL;
END
"""


def _replace(body: str) -> None:
    for table in TABLES:
        op.execute(
            f"CREATE OR REPLACE FUNCTION {table}_head_settled() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ {body.format(table=table)} $$"
        )


def _due_index(predicate: str) -> None:
    op.drop_index(DUE_INDEX, table_name="chatflow_queue_heads")
    op.create_index(
        DUE_INDEX, "chatflow_queue_heads", ["queue", "due_at"], postgresql_where=sa.text(predicate)
    )


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("UPDATE chatflow_queue_heads SET due_at = NULL WHERE next_id IS NULL AND due_at IS NOT NULL")
    _due_index("due_at IS NOT NULL")
    _replace(_IN_PLACE)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _due_index("next_id IS NOT NULL")
    _replace(_body_of_0017())


def _body_of_0017() -> str:
    """0017's functions, read from 0017 itself: the downgrade restores exactly what it installed."""
    path = Path(__file__).with_name("0017_queue_head_updated_where_locked.py")
    spec = importlib.util.spec_from_file_location("chatflow_migration_0017", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"migration 0017 not found at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module._BY_CTID)
