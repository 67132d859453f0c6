"""The SQL schema. Table and column names are part of the contract (other tools read them).

Every datetime is timezone-aware UTC on the Python side, whatever the backend stores.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TextClause,
    func,
)
from sqlalchemy import text as sql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from gateway.domain.messages import utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
# Ids are BIGINT on PostgreSQL: a larger one names no row (PostgreSQL refuses the statement, sqlite3
# overflows), so it is answered as one that names none (`names_a_row`).
MAX_ID = 2**63 - 1


def names_a_row(row_id: int) -> bool:
    return 1 <= row_id <= MAX_ID


# The status indexes' rows: a queue's pending rows are few by the statistics, so an index holding them
# lured PostgreSQL into walking all of them for statements that name one conversation or a few ids.
NOT_PENDING = sql("status <> 'pending'")


def pending_by_row(status: Any) -> Any:
    """`status = 'pending'` checked on each row an id found, in a spelling no index matches: for a
    statement naming many rows by id, PostgreSQL otherwise read the whole pending index instead of
    probing the ids (it holds few rows by the statistics; while a snapshot is held, every version)."""
    return func.coalesce(status, "") == "pending"


def of_status_index(status: str) -> tuple[TextClause, ...]:
    """The clause that lets a listing of one (bound) status use its table's status index, which
    PostgreSQL can use only where the statement itself rules pending rows out."""
    return () if status == "pending" else (NOT_PENDING,)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores aware datetimes as UTC; SQLite hands back naive values, which are UTC by construction."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; the gateway stores timezone-aware UTC only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class SessionRow(Base):
    """One conversation: who is answering it, its title and how many messages it holds."""

    __tablename__ = "chatflow_sessions"

    session_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    active_agent_name: Mapped[str | None] = mapped_column(String(255))
    title: Mapped[str | None] = mapped_column(String(255))
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    message_count: Mapped[int] = mapped_column(default=0)

    # Newest-first listing with a stable keyset (updated_at, session_id).
    __table_args__ = (Index(None, "updated_at", "session_id"),)


class MessageRow(Base):
    """One message of a session, at its position; pruning deletes the oldest positions."""

    __tablename__ = "chatflow_messages"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("chatflow_sessions.session_id", ondelete="CASCADE")
    )
    position: Mapped[int]
    role: Mapped[str] = mapped_column(String(16))
    message_json: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    # Loading a session reads one indexed range; a position is taken once per session.
    __table_args__ = (Index(None, "session_id", "position", unique=True),)


class ProcessedMessageRow(Base):
    """A platform message key already accepted; re-deliveries with the same key are dropped."""

    __tablename__ = "chatflow_processed_messages"

    message_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    platform: Mapped[str] = mapped_column(String(32))
    processed_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class InboxRow(Base):
    """A platform message accepted by a webhook, waiting for (or done with) its agent turn.

    Written in the same transaction as its dedup key, before the webhook answers 200. Rows of one
    conversation are handled in id order; `lease_until` lets a crashed worker's claim expire.
    """

    __tablename__ = "chatflow_inbox"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    dedup_key: Mapped[str] = mapped_column(String(255), unique=True)
    platform: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[str] = mapped_column(String(255))
    message_id: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32))
    text: Mapped[str | None] = mapped_column(Text)
    message_json: Mapped[dict[str, Any]]
    # pending (a turn is due), recorded (kept, no turn), done, dead (gave up after retries)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    # Its turn's model outage, kept across restarts and takeovers (gateway/store/outages.py).
    outage_started_at: Mapped[datetime | None]
    holding_reply_at: Mapped[datetime | None]

    __table_args__ = (
        # Operators' listing by status; pending rows are reached by conversation (migration 0012).
        Index(None, "status", "id", sqlite_where=NOT_PENDING, postgresql_where=NOT_PENDING),
        Index(None, "session_id", "id"),  # a conversation in arrival order
        # A conversation's oldest pending row, in one index probe whatever its history (queue_heads.py).
        Index(
            "ix_chatflow_inbox_pending",
            "session_id",
            "id",
            sqlite_where=sql("status = 'pending'"),
            postgresql_where=sql("status = 'pending'"),
        ),
    )


class OutboxRow(Base):
    """A reply (or other platform call) to deliver, written in the same transaction as its turn.

    `platform_message_id` is set once the platform accepted it, so it is never sent twice; status
    webhooks then move it on (delivered, read, failed).
    """

    __tablename__ = "chatflow_outbox"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    inbox_id: Mapped[int | None] = mapped_column(BigIntPK)
    platform: Mapped[str] = mapped_column(String(32))
    session_id: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32))  # text, answer_callback
    text: Mapped[str | None] = mapped_column(Text)
    target_json: Mapped[dict[str, Any]]  # where it goes: chat, thread, recipient, reply-to
    # pending, sent, delivered, read, failed (refused for good), dead (gave up after retrying for the
    # delivery budget), dry_run
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Transient failures are retried until then: set at the first, cleared by an operator's retry.
    retry_until: Mapped[datetime | None]
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]
    platform_message_id: Mapped[str | None] = mapped_column(String(255), index=True)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        Index(None, "status", "next_attempt_at", sqlite_where=NOT_PENDING, postgresql_where=NOT_PENDING),
        Index(None, "session_id", "id"),
        Index(
            "ix_chatflow_outbox_pending",
            "session_id",
            "id",
            sqlite_where=sql("status = 'pending'"),
            postgresql_where=sql("status = 'pending'"),
        ),
    )


class QueueHeadRow(Base):
    """Per work table (`queue`: chatflow_inbox, chatflow_outbox) and conversation: its oldest pending
    row and who holds it. Claims read these, not the rows waiting behind them (queue_heads.py)."""

    __tablename__ = "chatflow_queue_heads"

    queue: Mapped[str] = mapped_column(String(32), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    # PostgreSQL: one more than the version before, and the key's last column, so a look-up reads the
    # newest version first, past those a held snapshot keeps (migration 0019). Always 0 on SQLite.
    ver: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    next_id: Mapped[int | None] = mapped_column(BigInteger)  # None: nothing pending
    # When the head may be claimed: its row's next attempt, or while leased the lease's end.
    due_at: Mapped[datetime | None]
    lease_owner: Mapped[str | None] = mapped_column(String(64))

    # Claimable heads, due first; conversations with nothing pending are not in the index. On PostgreSQL
    # it names `due_at` alone (NULL exactly while `next_id` is), so a hand-on that moves `next_id` is
    # a HOT update (migration 0018).
    __table_args__ = (
        Index(
            "ix_chatflow_queue_heads_due",
            "queue",
            "due_at",
            sqlite_where=sql("next_id IS NOT NULL"),
            postgresql_where=sql("due_at IS NOT NULL"),
        ),
    )


class ChatRow(Base):
    """What the gateway knows of a chat beyond its messages: whether it may still send there."""

    __tablename__ = "chatflow_chats"

    platform: Mapped[str] = mapped_column(String(32), primary_key=True)
    chat_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    reachable: Mapped[bool]
    membership: Mapped[str] = mapped_column(String(32))  # the platform's word, e.g. kicked, member
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class HealthRow(Base):
    """One row per gateway process, rewritten by each readiness probe: proof that a write commits."""

    __tablename__ = "chatflow_health"

    owner: Mapped[str] = mapped_column(String(255), primary_key=True)  # host:pid
    checked_at: Mapped[datetime]


class TurnUsageRow(Base):
    """What a turn's calls to one model cost: written with the turn (gateway/store/turns.py), added up
    per session and per day (gateway/store/usage.py). No message text."""

    __tablename__ = "chatflow_turn_usage"
    __table_args__ = (
        Index("ix_chatflow_turn_usage_session_id", "session_id"),
        Index("ix_chatflow_turn_usage_day_model", "day", "model"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    inbox_id: Mapped[int | None] = mapped_column(BigInteger)
    session_id: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(255))  # a spec string: openai:gpt-4o-mini, scripted
    calls: Mapped[int] = mapped_column(Integer)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    latency_ms: Mapped[int] = mapped_column(Integer)  # the model calls' seconds, added up
    tool_calls: Mapped[int] = mapped_column(Integer)
    day: Mapped[str] = mapped_column(String(10))  # UTC, YYYY-MM-DD: per-day totals on every backend
    created_at: Mapped[datetime]


class BudgetMemberRow(Base):
    """A process that shares the model providers' budgets, as last seen (gateway/store/budget_members.py)."""

    __tablename__ = "chatflow_budget_members"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)  # the inbox worker's owner id
    seen_at: Mapped[datetime]
