"""The work tables' status indexes leave pending rows out: pending rows are found by conversation.

`ix_chatflow_inbox_status_id` (status, id) and `ix_chatflow_outbox_status_next_attempt_at` (status,
next_attempt_at) held every row. A queue's pending rows are few by the planner's statistics (the queue
drains), so PostgreSQL picked these indexes for statements that name pending rows by id or by
conversation: the queue-head triggers' look-up of a conversation's oldest pending row walked every
pending entry in id order, and a lease renewal of 130 rows read 4,815 index pages instead of probing
130 ids. Each of those entries stays while a snapshot is held open (every row version a message
leaves while it waits), so those statements slowed down with every message stored during the hold:
a turn's commit went from 145 pages read to 14,493 in a held-xmin run. Without pending rows these
indexes serve what they are for, operators' listings of done, failed and dead rows; pending rows are
reached through `ix_<table>_pending` (session, id), whose scans are bounded by one conversation.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_chatflow_inbox_status_id", "chatflow_inbox", ["status", "id"]),
    ("ix_chatflow_outbox_status_next_attempt_at", "chatflow_outbox", ["status", "next_attempt_at"]),
)
NOT_PENDING = sa.text("status <> 'pending'")


def upgrade() -> None:
    for name, table, columns in INDEXES:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, columns, sqlite_where=NOT_PENDING, postgresql_where=NOT_PENDING)


def downgrade() -> None:
    for name, table, columns in INDEXES:
        op.drop_index(name, table_name=table)
        op.create_index(name, table, columns)
