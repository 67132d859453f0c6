"""Outbox: how long a reply is retried after transient failures (the delivery time budget).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: set at a row's first transient failure; rows written before stay NULL until then.
    op.add_column("chatflow_outbox", sa.Column("retry_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("chatflow_outbox") as batch:
        batch.drop_column("retry_until")
