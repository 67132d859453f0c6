"""PostgreSQL: a settle updates its queue head where it locked it (by `ctid`), not by looking it up again.

Why: the settle triggers (0015, 0016) lock the conversation's head, then update it. Both found the head
through its primary key, and while a snapshot is held open (a long report, `pg_dump`, an idle
replication slot) every head version written meanwhile keeps an entry there that each look-up walks:
a turn walked its inbox head's versions twice and its outbox head's twice. The lock returns the
head's current version; the update now goes straight to it (a TID scan), so each settle walks them
once. Nothing can move or replace that version in between: the trigger holds its lock, and each
statement of a plpgsql function takes a new snapshot (READ COMMITTED), which sees it.
The SQLite file keeps 0011's triggers: its look-ups never meet old versions.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")

# 0015's (and 0016's, for the outbox) with the head's ctid kept from its lock. A conversation without
# a head leaves `head_at` NULL, and the updates then match nothing, as the look-ups by key did.
_BY_CTID = """
DECLARE
  head_at tid;
  head_next bigint;
  head_owner varchar;
  row_next bigint;
  row_due timestamptz;
  row_owner varchar;
BEGIN
  SELECT h.ctid, h.next_id, h.lease_owner INTO head_at, head_next, head_owner FROM chatflow_queue_heads AS h
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
    UPDATE chatflow_queue_heads
      SET next_id = row_next, due_at = NEW.lease_until, lease_owner = NEW.lease_owner
      WHERE ctid = head_at
      AND (next_id, due_at, lease_owner) IS DISTINCT FROM (row_next, NEW.lease_until, NEW.lease_owner);
  ELSE
    UPDATE chatflow_queue_heads SET next_id = row_next, due_at = row_due, lease_owner = NULL
      WHERE ctid = head_at AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner);
  END IF;
  RETURN NULL;
END
"""
# 0015's and 0016's, as they are there.
_BY_KEY = _BY_CTID.replace("  head_at tid;\n", "").replace("h.ctid, ", "").replace("head_at, ", "")
_BY_KEY = _BY_KEY.replace("WHERE ctid = head_at", "WHERE queue = '{table}' AND session_id = NEW.session_id")


def _replace(body: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(
            f"CREATE OR REPLACE FUNCTION {table}_head_settled() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ {body.format(table=table)} $$"
        )


def upgrade() -> None:
    _replace(_BY_CTID)


def downgrade() -> None:
    _replace(_BY_KEY)
