"""PostgreSQL: autovacuum settings of the queue tables, set here rather than left to each operator.

Every message inserts a dedup key and an inbox row and updates the row 2-3 times, its outbox row as
often, and its conversation's queue head 4 times (leased and moved on, for the inbox and the outbox).
PostgreSQL's default (vacuum once 20 % of a table is dead) lets the big tables carry millions of dead
rows and the small, hot heads table thousands of dead versions per live one, which every claim's index
scan then steps over (measured by `python benchmarks/soak.py`). No effect on SQLite.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SETTINGS = {
    # Big, append-mostly tables: vacuum (and analyze) after 1 % (2 %) of them changed.
    "chatflow_inbox": "autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02",
    "chatflow_outbox": "autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02",
    "chatflow_processed_messages": "autovacuum_vacuum_scale_factor = 0.01, "
    "autovacuum_analyze_scale_factor = 0.02",
    # One row per conversation, rewritten by every claim and turn: vacuum every 1,000 dead versions,
    # without the cost-based pauses (the table is small), and leave room on each page for new versions.
    "chatflow_queue_heads": "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 1000, "
    "autovacuum_vacuum_cost_delay = 0, fillfactor = 70",
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, settings in SETTINGS.items():
        op.execute(f"ALTER TABLE {table} SET ({settings})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, settings in SETTINGS.items():
        names = ", ".join(part.split("=")[0].strip() for part in settings.split(","))
        op.execute(f"ALTER TABLE {table} RESET ({names})")
