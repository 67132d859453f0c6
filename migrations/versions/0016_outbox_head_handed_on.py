"""PostgreSQL: a reply marked sent may hand its conversation's next reply on to the same delivery
worker, as migration 0015 lets a turn hand its conversation's next message on.

Why: replies wait in the outbox when a conversation's answers come faster than its replies are sent
(several messages answered in a row), and each let the outbox head go and be claimed again: two head
versions per reply, and a claim walking all of them while a snapshot is held open. Now the delivery
worker asks for the next one when it records a sent reply (store/sent_replies.py), by keeping the
row's lease owner and giving the lease a new end in the same UPDATE (a new end, not a later one: see
0015), and takes it with one read (outbox.take_handed_on).
The trigger is 0015's, for the outbox; the SQLite file keeps 0011's.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0015's, for the outbox.
_HANDED_ON = """
DECLARE
  head_next bigint;
  head_owner varchar;
  row_next bigint;
  row_due timestamptz;
  row_owner varchar;
BEGIN
  SELECT h.next_id, h.lease_owner INTO head_next, head_owner FROM chatflow_queue_heads AS h
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
      WHERE queue = '{table}' AND session_id = NEW.session_id
      AND (next_id, due_at, lease_owner) IS DISTINCT FROM (row_next, NEW.lease_until, NEW.lease_owner);
  ELSE
    UPDATE chatflow_queue_heads SET next_id = row_next, due_at = row_due, lease_owner = NULL
      WHERE queue = '{table}' AND session_id = NEW.session_id
      AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner);
  END IF;
  RETURN NULL;
END
"""
# 0014's, as it is there.
_LET_GO = (
    "BEGIN PERFORM 1 FROM chatflow_queue_heads WHERE queue = '{table}' "
    "AND session_id = NEW.session_id FOR UPDATE; "
    "UPDATE chatflow_queue_heads SET (next_id, due_at) = (SELECT p.id, p.next_attempt_at "
    "FROM {table} AS p WHERE p.session_id = NEW.session_id AND p.status = 'pending' "
    "AND p.id >= COALESCE(chatflow_queue_heads.next_id, 0) ORDER BY p.id LIMIT 1), lease_owner = NULL "
    "WHERE queue = '{table}' AND session_id = NEW.session_id "
    "AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner); RETURN NULL; END"
)


def _replace(body: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE OR REPLACE FUNCTION chatflow_outbox_head_settled() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ {body.format(table='chatflow_outbox')} $$"
        )


def upgrade() -> None:
    _replace(_HANDED_ON)


def downgrade() -> None:
    _replace(_LET_GO)
