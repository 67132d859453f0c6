"""Session store tables: sessions, their messages, and processed platform message keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "chatflow_sessions",
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("active_agent_name", sa.String(length=255), nullable=True),
        sa.Column("title", sa.String(length=255), nullable=True),
        sa.Column("metadata_json", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("message_count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_chatflow_sessions")),
    )
    op.create_index(
        op.f("ix_chatflow_sessions_updated_at_session_id"), "chatflow_sessions", ["updated_at", "session_id"]
    )
    op.create_table(
        "chatflow_messages",
        sa.Column("id", BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("message_json", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chatflow_sessions.session_id"],
            name=op.f("fk_chatflow_messages_session_id_chatflow_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chatflow_messages")),
    )
    op.create_index(
        op.f("ix_chatflow_messages_session_id_position"),
        "chatflow_messages",
        ["session_id", "position"],
        unique=True,
    )
    op.create_table(
        "chatflow_processed_messages",
        sa.Column("message_key", sa.String(length=255), nullable=False),
        sa.Column("platform", sa.String(length=32), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("message_key", name=op.f("pk_chatflow_processed_messages")),
    )
    op.create_index(
        op.f("ix_chatflow_processed_messages_expires_at"), "chatflow_processed_messages", ["expires_at"]
    )


def downgrade() -> None:
    op.drop_table("chatflow_processed_messages")
    op.drop_table("chatflow_messages")
    op.drop_table("chatflow_sessions")
