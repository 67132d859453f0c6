"""Inbox: a row's model outage (when it started, when its holding reply was queued), kept on the row so
that a restart or another replica taking the row over continues it instead of starting again.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("outage_started_at", "holding_reply_at")


def upgrade() -> None:
    # Nullable: set at the row's first transient model failure and when its holding reply is queued.
    for name in COLUMNS:
        op.add_column("chatflow_inbox", sa.Column(name, sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite 3.35 and later): a batch operation would rebuild the table on SQLite
    # and lose its queue-head triggers (0007).
    for name in reversed(COLUMNS):
        op.execute(f"ALTER TABLE chatflow_inbox DROP COLUMN {name}")
