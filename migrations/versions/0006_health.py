"""Health: one row per gateway process, written by each readiness probe (a read alone passes on a full
disk or a read-only database, while every webhook fails).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chatflow_health",
        sa.Column("owner", sa.String(length=255), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_chatflow_health")),
    )


def downgrade() -> None:
    op.drop_table("chatflow_health")
