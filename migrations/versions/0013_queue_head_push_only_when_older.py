"""Queue heads: a push that changes nothing writes nothing.

0007's push (a row becomes pending: it is its conversation's head if it is older than the head) was an
upsert whose DO UPDATE always ran, setting the head to what it already was when the conversation had
an older row waiting. Each such no-op wrote a new row version of the head, and while a snapshot is
held open (a long report, pg_dump, an idle replication slot) vacuum can remove none of them: every
later look-up of that head walks them all. Now the update runs only when the new row is older (or the
head is empty), which is when it changed anything. On PostgreSQL a conflicting row is locked all the
same, whether or not the update's condition holds, so a push still holds the head's lock until its
commit, which the refresh of migration 0007 relies on.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
_HEAD = "chatflow_queue_heads"
_OLDER = f"{_HEAD}.next_id IS NULL OR excluded.next_id < {_HEAD}.next_id"
# 0007's, as it was written there; the new one adds the WHERE.
_CONFLICT = (
    "ON CONFLICT (queue, session_id) DO UPDATE SET "
    f"next_id = CASE WHEN {_OLDER} THEN excluded.next_id ELSE {_HEAD}.next_id END, "
    f"due_at = CASE WHEN {_HEAD}.lease_owner IS NULL AND ({_OLDER}) "
    f"THEN excluded.due_at ELSE {_HEAD}.due_at END"
)
_CONFLICT_WHEN_OLDER = f"{_CONFLICT} WHERE {_OLDER}"
PUSH = (
    "INSERT INTO chatflow_queue_heads (queue, session_id, next_id, due_at) "
    "VALUES ('{table}', NEW.session_id, NEW.id, NEW.next_attempt_at) "
)
PUSH_STORED = (
    "INSERT INTO chatflow_queue_heads (queue, session_id, next_id, due_at) "
    "SELECT DISTINCT ON (session_id) '{table}', session_id, id, next_attempt_at FROM stored "
    "WHERE status = 'pending' ORDER BY session_id, id "
)
BECAME_PENDING = "NEW.status = 'pending' AND OLD.status <> 'pending'"


def _sqlite(table: str, conflict: str) -> list[str]:
    push = PUSH.format(table=table) + conflict
    return [
        f"DROP TRIGGER {table}_head_stored",
        f"DROP TRIGGER {table}_head_requeued",
        f"CREATE TRIGGER {table}_head_stored AFTER INSERT ON {table} WHEN NEW.status = 'pending' "
        f"BEGIN {push}; END",
        f"CREATE TRIGGER {table}_head_requeued AFTER UPDATE OF status ON {table} WHEN {BECAME_PENDING} "
        f"BEGIN {push}; END",
    ]


def _postgresql(table: str, conflict: str) -> list[str]:
    push = PUSH.format(table=table) + conflict
    push_stored = PUSH_STORED.format(table=table) + conflict
    return [
        f"CREATE OR REPLACE FUNCTION {table}_heads_stored() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {push_stored}; RETURN NULL; END $$",
        f"CREATE OR REPLACE FUNCTION {table}_head_pushed() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {push}; RETURN NULL; END $$",
    ]


def _replace(conflict: str) -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table in TABLES:
        for statement in _postgresql(table, conflict) if postgresql else _sqlite(table, conflict):
            op.execute(statement)


def upgrade() -> None:
    _replace(_CONFLICT_WHEN_OLDER)


def downgrade() -> None:
    _replace(_CONFLICT)
