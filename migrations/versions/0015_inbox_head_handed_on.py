"""PostgreSQL: a turn that finishes its conversation's head may hand the conversation on to its own
worker: the next pending row is leased to it in the same settle, instead of the head being let go
and claimed again.

Why: every version of a queue head a held snapshot keeps (a long report, `pg_dump`, an idle
replication slot) is one more that every later look-up of that head walks, and under load a
conversation's next message is usually waiting when its turn ends. Letting go (one head version)
and claiming again (another, and a claim statement walking them all) became one version. The
worker asks for it by keeping its lease owner on the row it marks done and giving it a new end in
the same UPDATE (`lease_owner` kept, `lease_until` changed: store/turns.py); the settle then leases
the next pending row, if one is due, to that owner until that time, and the head with it. The new
end may come before the old one (the heartbeat can renew the lease after the worker chose it), so
"changed", not "later". Any other settle (a failure, a hand-back, an operator's UPDATE that leaves
the lease as it was or clears it) lets the head go as 0014 did. The SQLite file keeps 0011's
triggers: its claims never meet old versions.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The head is locked first, in a statement of its own (0007): the look-up that follows then sees
# every push committed before (a push holds the head's lock until its commit).
_HANDED_ON = """
DECLARE
  head_next bigint;
  head_owner varchar;
  row_next bigint;
  row_due timestamptz;
  row_owner varchar;
BEGIN
  SELECT h.next_id, h.lease_owner INTO head_next, head_owner FROM chatflow_queue_heads AS h
    WHERE h.queue = 'chatflow_inbox' AND h.session_id = NEW.session_id FOR UPDATE;
  SELECT p.id, p.next_attempt_at, p.lease_owner INTO row_next, row_due, row_owner FROM chatflow_inbox AS p
    WHERE p.session_id = NEW.session_id AND p.status = 'pending' AND p.id >= COALESCE(head_next, 0)
    ORDER BY p.id LIMIT 1;
  IF NEW.status <> 'pending' AND NEW.lease_owner IS NOT NULL AND NEW.lease_owner = OLD.lease_owner
     AND NEW.lease_until IS DISTINCT FROM OLD.lease_until AND head_owner = OLD.lease_owner
     AND row_next IS NOT NULL AND row_due <= now() AND (row_owner IS NULL OR row_owner = NEW.lease_owner)
  THEN
    IF row_owner IS NULL THEN
      UPDATE chatflow_inbox SET lease_owner = NEW.lease_owner, lease_until = NEW.lease_until
        WHERE id = row_next;
    END IF;
    UPDATE chatflow_queue_heads
      SET next_id = row_next, due_at = NEW.lease_until, lease_owner = NEW.lease_owner
      WHERE queue = 'chatflow_inbox' AND session_id = NEW.session_id
      AND (next_id, due_at, lease_owner) IS DISTINCT FROM (row_next, NEW.lease_until, NEW.lease_owner);
  ELSE
    UPDATE chatflow_queue_heads SET next_id = row_next, due_at = row_due, lease_owner = NULL
      WHERE queue = 'chatflow_inbox' AND session_id = NEW.session_id
      AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner);
  END IF;
  RETURN NULL;
END
"""
# 0014's, as it is there.
_LET_GO = (
    "BEGIN PERFORM 1 FROM chatflow_queue_heads WHERE queue = 'chatflow_inbox' "
    "AND session_id = NEW.session_id FOR UPDATE; "
    "UPDATE chatflow_queue_heads SET (next_id, due_at) = (SELECT p.id, p.next_attempt_at "
    "FROM chatflow_inbox AS p WHERE p.session_id = NEW.session_id AND p.status = 'pending' "
    "AND p.id >= COALESCE(chatflow_queue_heads.next_id, 0) ORDER BY p.id LIMIT 1), lease_owner = NULL "
    "WHERE queue = 'chatflow_inbox' AND session_id = NEW.session_id "
    "AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner); RETURN NULL; END"
)


def _replace(body: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE OR REPLACE FUNCTION chatflow_inbox_head_settled() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ {body} $$"
        )


def upgrade() -> None:
    _replace(_HANDED_ON)


def downgrade() -> None:
    _replace(_LET_GO)
