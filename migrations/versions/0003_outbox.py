"""Outbox: replies written with their turn, waiting for (or done with) delivery.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "chatflow_outbox",
        sa.Column("id", BIGINT, autoincrement=True, nullable=False),
        sa.Column("inbox_id", BIGINT, nullable=True),
        sa.Column("platform", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("target_json", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("platform_message_id", sa.String(length=255), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chatflow_outbox")),
    )
    op.create_index(
        op.f("ix_chatflow_outbox_status_next_attempt_at"), "chatflow_outbox", ["status", "next_attempt_at"]
    )
    op.create_index(op.f("ix_chatflow_outbox_session_id_id"), "chatflow_outbox", ["session_id", "id"])
    op.create_index(
        op.f("ix_chatflow_outbox_platform_message_id"), "chatflow_outbox", ["platform_message_id"]
    )


def downgrade() -> None:
    op.drop_table("chatflow_outbox")
