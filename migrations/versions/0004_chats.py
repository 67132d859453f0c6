"""Chats: whether the bot may still send to a chat (Telegram: kicked/blocked or back).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chatflow_chats",
        sa.Column("platform", sa.String(length=32), nullable=False),
        sa.Column("chat_id", sa.String(length=255), nullable=False),
        sa.Column("reachable", sa.Boolean(), nullable=False),
        sa.Column("membership", sa.String(length=32), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("platform", "chat_id", name=op.f("pk_chatflow_chats")),
    )


def downgrade() -> None:
    op.drop_table("chatflow_chats")
