"""Budget members: the processes that share the model providers' budgets, as last seen.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chatflow_budget_members",
        sa.Column("owner", sa.String(length=64), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", name=op.f("pk_chatflow_budget_members")),
    )


def downgrade() -> None:
    op.drop_table("chatflow_budget_members")
