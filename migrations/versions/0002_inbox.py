"""Inbox: platform messages accepted by the webhooks, waiting for or done with their turn.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "chatflow_inbox",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("dedup_key", sa.String(length=255), nullable=False),
        sa.Column("platform", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("message_id", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("message_json", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chatflow_inbox")),
        sa.UniqueConstraint("dedup_key", name=op.f("uq_chatflow_inbox_dedup_key")),
    )
    op.create_index(op.f("ix_chatflow_inbox_status_id"), "chatflow_inbox", ["status", "id"])
    op.create_index(op.f("ix_chatflow_inbox_session_id_id"), "chatflow_inbox", ["session_id", "id"])


def downgrade() -> None:
    op.drop_table("chatflow_inbox")
