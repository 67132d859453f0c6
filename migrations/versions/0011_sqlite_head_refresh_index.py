"""SQLite: the queue-head refresh reads a conversation's oldest pending row through the pending index.

Without statistics SQLite's planner chose the `(status, id)` index for the refresh of 0007's
`head_settled` trigger (`… WHERE session_id = ? AND status = 'pending' ORDER BY id LIMIT 1`): it walked
every pending row of every conversation in id order until it met the conversation's. Each settled
row (every turn's commit, every sent reply) then cost time in proportion to the whole backlog: about
30,000 SQLite VM steps at 20,000 waiting rows instead of 155, and 0.5 ms of the database thread per
turn in a 2,000-turn burst. `INDEXED BY` pins the partial index `ix_<table>_pending` (session, id) of
0007, so the read is one probe whatever the backlog; SQLite refuses the statement rather than fall
back to another plan if that index is ever missing. PostgreSQL plans this read from its statistics
(tests/integration/test_query_plans.py) and is left as it is.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
# 0007's trigger, as it was written there (the downgrade puts it back).
SETTLED = (
    "OLD.status = 'pending' AND (NEW.status <> 'pending' OR (NEW.lease_owner IS NULL AND "
    "(OLD.lease_owner IS NOT NULL OR NEW.next_attempt_at <> OLD.next_attempt_at)))"
)
SETTLED_COLUMNS = "status, lease_owner, next_attempt_at"
REFRESH = (
    "UPDATE chatflow_queue_heads SET (next_id, due_at) = (SELECT p.id, p.next_attempt_at FROM {table} AS p "
    "{hint}WHERE p.session_id = NEW.session_id AND p.status = 'pending' ORDER BY p.id LIMIT 1), "
    "lease_owner = NULL WHERE queue = '{table}' AND session_id = NEW.session_id "
    "AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner)"
)


def _settled_trigger(table: str, hint: str) -> str:
    refresh = REFRESH.format(table=table, hint=hint)
    return (
        f"CREATE TRIGGER {table}_head_settled AFTER UPDATE OF {SETTLED_COLUMNS} ON {table} "
        f"WHEN {SETTLED} BEGIN {refresh}; END"
    )


def _replace(hinted: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in TABLES:
        op.execute(f"DROP TRIGGER {table}_head_settled")
        op.execute(_settled_trigger(table, f"INDEXED BY ix_{table}_pending " if hinted else ""))


def upgrade() -> None:
    _replace(hinted=True)


def downgrade() -> None:
    _replace(hinted=False)
