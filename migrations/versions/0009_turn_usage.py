"""Turn usage: per turn and model, the calls, tokens, model seconds and tool calls (no message text).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chatflow_turn_usage",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("inbox_id", sa.BigInteger(), nullable=True),
        sa.Column("session_id", sa.String(length=255), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("latency_ms", sa.Integer(), nullable=False),
        sa.Column("tool_calls", sa.Integer(), nullable=False),
        sa.Column("day", sa.String(length=10), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_chatflow_turn_usage")),
    )
    op.create_index("ix_chatflow_turn_usage_session_id", "chatflow_turn_usage", ["session_id"])
    op.create_index("ix_chatflow_turn_usage_day_model", "chatflow_turn_usage", ["day", "model"])


def downgrade() -> None:
    op.drop_index("ix_chatflow_turn_usage_day_model", table_name="chatflow_turn_usage")
    op.drop_index("ix_chatflow_turn_usage_session_id", table_name="chatflow_turn_usage")
    op.drop_table("chatflow_turn_usage")
