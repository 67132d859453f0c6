"""PostgreSQL: a settled row's queue-head refresh looks for the conversation's next pending row from the
head's own id on, instead of from the conversation's first row.

Every pending row of a conversation has an id at or after its head's `next_id` (a push only moves the
head to an older row, a refresh to the oldest pending one), so the bound skips nothing that counts. It
skips the conversation's earlier rows, which were pending once: while a snapshot is held open (a long
report, `pg_dump`, an idle replication slot), VACUUM cannot remove their entries from the pending
index, and the unbounded look-up visited each of them on every settle, a cost that grew with every turn
of the conversation during the hold (benchmarks/soak.py; tests/integration/test_queue_head_versions.py
counts the index entries one settle reads). The SQLite file has no such entries (a row that stops
being pending leaves the partial index at once), so its triggers stay as 0011 made them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
# 0007's refresh, as written there; the new one adds the bound on p.id.
_REFRESH = (
    "UPDATE chatflow_queue_heads SET (next_id, due_at) = (SELECT p.id, p.next_attempt_at FROM {table} AS p "
    "WHERE p.session_id = NEW.session_id AND p.status = 'pending'{bound} ORDER BY p.id LIMIT 1), "
    "lease_owner = NULL WHERE queue = '{table}' AND session_id = NEW.session_id "
    "AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner)"
)
_FROM_THE_HEAD = " AND p.id >= COALESCE(chatflow_queue_heads.next_id, 0)"
# 0007's: the head is locked before the refresh reads the table, so it sees every push committed before.
_LOCK = (
    "PERFORM 1 FROM chatflow_queue_heads WHERE queue = '{table}' AND session_id = NEW.session_id FOR UPDATE"
)


def _replace(bound: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        lock, refresh = _LOCK.format(table=table), _REFRESH.format(table=table, bound=bound)
        op.execute(
            f"CREATE OR REPLACE FUNCTION {table}_head_settled() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN {lock}; {refresh}; RETURN NULL; END $$"
        )


def upgrade() -> None:
    _replace(_FROM_THE_HEAD)


def downgrade() -> None:
    _replace("")
