"""Queue heads: per work table and conversation, its oldest pending row and lease, so a claim reads only
claimable conversations whatever the backlog (gateway/store/queue_heads.py). Triggers on the inbox and
the outbox keep the heads right whoever writes the rows; partial indexes find a conversation's oldest
pending row in one probe. Existing pending rows get their heads here.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("chatflow_inbox", "chatflow_outbox")
PENDING = sa.text("status = 'pending'")
WITH_WORK = sa.text("next_id IS NOT NULL")

# A row becomes pending (stored, or requeued): it is the head if older than the head, or if there is
# none. A leased head keeps its lease (its due_at is the lease's end).
_HEAD = "chatflow_queue_heads"
_OLDER = f"{_HEAD}.next_id IS NULL OR excluded.next_id < {_HEAD}.next_id"
PUSH = (
    "INSERT INTO chatflow_queue_heads (queue, session_id, next_id, due_at) "
    "VALUES ('{table}', NEW.session_id, NEW.id, NEW.next_attempt_at) "
    "ON CONFLICT (queue, session_id) DO UPDATE SET "
    f"next_id = CASE WHEN {_OLDER} THEN excluded.next_id ELSE {_HEAD}.next_id END, "
    f"due_at = CASE WHEN {_HEAD}.lease_owner IS NULL AND ({_OLDER}) "
    f"THEN excluded.due_at ELSE {_HEAD}.due_at END"
)
# A row left pending or was handed back: its conversation's head is its oldest pending row again, due
# at that row's next attempt, and the lease of whoever settled the row ends (not another's).
REFRESH = (
    "UPDATE chatflow_queue_heads SET (next_id, due_at) = (SELECT p.id, p.next_attempt_at FROM {table} AS p "
    "WHERE p.session_id = NEW.session_id AND p.status = 'pending' ORDER BY p.id LIMIT 1), lease_owner = NULL "
    "WHERE queue = '{table}' AND session_id = NEW.session_id "
    "AND (lease_owner IS NULL OR lease_owner = OLD.lease_owner)"
)
BECAME_PENDING = "NEW.status = 'pending' AND OLD.status <> 'pending'"
# ... or, not leased, it is due at another time (an operator's or a test's UPDATE).
SETTLED = (
    "OLD.status = 'pending' AND (NEW.status <> 'pending' OR (NEW.lease_owner IS NULL AND "
    "(OLD.lease_owner IS NOT NULL OR NEW.next_attempt_at <> OLD.next_attempt_at)))"
)
SETTLED_COLUMNS = "status, lease_owner, next_attempt_at"


def _sqlite_triggers(table: str) -> list[str]:
    push, refresh = PUSH.format(table=table), REFRESH.format(table=table)
    return [
        f"CREATE TRIGGER {table}_head_stored AFTER INSERT ON {table} WHEN NEW.status = 'pending' "
        f"BEGIN {push}; END",
        f"CREATE TRIGGER {table}_head_requeued AFTER UPDATE OF status ON {table} WHEN {BECAME_PENDING} "
        f"BEGIN {push}; END",
        f"CREATE TRIGGER {table}_head_settled AFTER UPDATE OF {SETTLED_COLUMNS} ON {table} "
        f"WHEN {SETTLED} BEGIN {refresh}; END",
    ]


# PostgreSQL: a statement's new rows at once, their conversations in session order (the lock order of
# several batches committing at once), whatever order the rows were inserted in.
PUSH_STORED = (
    "INSERT INTO chatflow_queue_heads (queue, session_id, next_id, due_at) "
    "SELECT DISTINCT ON (session_id) '{table}', session_id, id, next_attempt_at FROM stored "
    "WHERE status = 'pending' ORDER BY session_id, id " + PUSH[PUSH.index("ON CONFLICT") :]
)


def _postgresql_triggers(table: str) -> list[str]:
    push, refresh = PUSH.format(table=table), REFRESH.format(table=table)
    push_stored = PUSH_STORED.format(table=table)
    # The head is locked before the recomputation reads the table, in a statement of its own: it then
    # sees every push committed before (a push holds the head's lock until its commit).
    lock = (
        f"PERFORM 1 FROM chatflow_queue_heads WHERE queue = '{table}' AND session_id = NEW.session_id "
        "FOR UPDATE"
    )
    return [
        f"CREATE FUNCTION {table}_heads_stored() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {push_stored}; RETURN NULL; END $$",
        f"CREATE FUNCTION {table}_head_pushed() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {push}; RETURN NULL; END $$",
        f"CREATE FUNCTION {table}_head_settled() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {lock}; {refresh}; RETURN NULL; END $$",
        f"CREATE TRIGGER {table}_head_stored AFTER INSERT ON {table} REFERENCING NEW TABLE AS stored "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {table}_heads_stored()",
        f"CREATE TRIGGER {table}_head_requeued AFTER UPDATE OF status ON {table} FOR EACH ROW "
        f"WHEN ({BECAME_PENDING}) EXECUTE FUNCTION {table}_head_pushed()",
        f"CREATE TRIGGER {table}_head_settled AFTER UPDATE OF {SETTLED_COLUMNS} ON {table} FOR EACH ROW "
        f"WHEN ({SETTLED}) EXECUTE FUNCTION {table}_head_settled()",
    ]


def upgrade() -> None:
    op.create_table(
        "chatflow_queue_heads",
        sa.Column("queue", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("next_id", sa.BigInteger(), nullable=True),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("queue", "session_id", name=op.f("pk_chatflow_queue_heads")),
    )
    op.create_index(
        "ix_chatflow_queue_heads_due",
        "chatflow_queue_heads",
        ["queue", "due_at"],
        sqlite_where=WITH_WORK,
        postgresql_where=WITH_WORK,
    )
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table in TABLES:
        op.create_index(
            f"ix_{table}_pending", table, ["session_id", "id"], sqlite_where=PENDING, postgresql_where=PENDING
        )
        # A leased row keeps its lease: its head is due when the lease ends.
        op.execute(
            "INSERT INTO chatflow_queue_heads (queue, session_id, next_id, due_at, lease_owner) "
            f"SELECT '{table}', r.session_id, r.id, "
            "CASE WHEN r.lease_until IS NOT NULL AND r.lease_until > r.next_attempt_at "
            "THEN r.lease_until ELSE r.next_attempt_at END, "
            "CASE WHEN r.lease_until IS NOT NULL THEN r.lease_owner END "
            f"FROM {table} AS r WHERE r.id IN "
            f"(SELECT min(id) FROM {table} WHERE status = 'pending' GROUP BY session_id)"
        )
        for statement in _postgresql_triggers(table) if postgresql else _sqlite_triggers(table):
            op.execute(statement)


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table in TABLES:
        for trigger in ("stored", "requeued", "settled"):
            op.execute(
                f"DROP TRIGGER {table}_head_{trigger} ON {table}"
                if postgresql
                else f"DROP TRIGGER {table}_head_{trigger}"
            )
        if postgresql:
            op.execute(f"DROP FUNCTION {table}_heads_stored()")
            op.execute(f"DROP FUNCTION {table}_head_pushed()")
            op.execute(f"DROP FUNCTION {table}_head_settled()")
        op.drop_index(f"ix_{table}_pending", table_name=table)
    op.drop_index("ix_chatflow_queue_heads_due", table_name="chatflow_queue_heads")
    op.drop_table("chatflow_queue_heads")
