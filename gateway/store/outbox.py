"""The outbox (`chatflow_outbox`): a turn's replies, their delivery, and the platforms' word on them.

A turn writes its replies in its own transaction (gateway/store/turns.py); delivery claims them in
order per conversation (gateway/store/leases.py), together with whether their chat is still
reachable, and records the outcome; status webhooks then move a sent row on (delivered, read,
failed). `platform_message_id` is set in the same statement that marks a row sent, so a row the
platform accepted is never sent twice.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, DateTime, bindparam, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.inbound import StatusUpdate
from gateway.domain.messages import utcnow
from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.store import chats, leases
from gateway.store.database import Database
from gateway.store.postgres_lanes import Statement
from gateway.store.sqlite_thread import from_sqlite_datetime, to_sqlite_datetime
from gateway.store.storable import json_text
from gateway.store.tables import OutboxRow, names_a_row, of_status_index

ROWS_PER_STATEMENT = 64  # rows per multi-row insert; far below SQLite's limits
_KINDS = frozenset(kind.value for kind in OutboundKind)
_CLAIMED = ("platform", "session_id", "kind", "text", "target_json", "attempts", "retry_until")
STATUSES = ("pending", "sent", "delivered", "read", "played", "failed", "dead", "dry_run")
# What an operator may send again: given up after the delivery budget, or refused by the platform.
RETRYABLE = ("dead", "failed")
# A status only moves a row forward: a late "delivered" does not undo "read"; "failed" always applies.
_STATUS_RANK = {"sent": 1, "delivered": 2, "read": 3, "played": 3}


@dataclass(frozen=True)
class ClaimedReply:
    id: int
    session_id: str
    message: OutboundMessage | None  # None for a kind this version does not know (see `kind`)
    attempts: int
    reachable: bool = True  # False once the platform said the bot was removed from (or blocked in) the chat
    kind: str = ""
    retry_until: datetime | None = None  # set at its first transient failure: retried until then


# --- a turn's replies ------------------------------------------------------------------------------
@functools.cache
def _insert_sql(count: int) -> str:
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?)"] * count)
    return (
        "INSERT INTO chatflow_outbox (inbox_id, platform, session_id, kind, text, target_json, status, "
        f"attempts, next_attempt_at, created_at, updated_at) VALUES {rows}"
    )


def insert_on_file(
    inbox_id: int | None, messages: Sequence[OutboundMessage], now: datetime
) -> Callable[[sqlite3.Connection], None]:
    """The rows' parameters are built here, on the event loop, so the writer thread only runs SQL."""
    stamp = to_sqlite_datetime(now)
    rows = [
        (
            inbox_id,
            m.platform,
            m.session_id,
            m.kind.value,
            m.text,
            json_text(m.target.to_json()),
            stamp,
            stamp,
            stamp,
        )
        for m in messages
    ]
    chunks = [
        (
            _insert_sql(len(rows[i : i + ROWS_PER_STATEMENT])),
            [v for row in rows[i : i + ROWS_PER_STATEMENT] for v in row],
        )
        for i in range(0, len(rows), ROWS_PER_STATEMENT)
    ]

    def work(conn: sqlite3.Connection) -> None:
        for statement, params in chunks:
            conn.execute(statement, params)

    return work


async def insert_on_engine(
    conn: AsyncConnection, inbox_id: int | None, messages: Sequence[OutboundMessage], now: datetime
) -> None:
    if not messages:
        return
    await conn.execute(
        insert(OutboxRow),
        [
            {
                "inbox_id": inbox_id,
                "platform": m.platform,
                "session_id": m.session_id,
                "kind": m.kind.value,
                "text": m.text,
                "target_json": m.target.to_json(),
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
                "updated_at": now,
            }
            for m in messages
        ],
    )


async def reply_texts(conn: AsyncConnection, inbox_id: int) -> list[str]:
    """The texts a turn queued for inbox row `inbox_id`, in order."""
    texts = await conn.execute(
        select(OutboxRow.text)
        .where(OutboxRow.inbox_id == inbox_id, OutboxRow.kind == OutboundKind.TEXT.value)
        .order_by(OutboxRow.id)
    )
    return [text or "" for (text,) in texts]


# --- status webhooks -------------------------------------------------------------------------------
def _allowed_before(status: str) -> list[str]:
    """The statuses a new `status` may replace: a sent row's only (a pending row has no platform message
    id yet; it leaves pending through the holder of its lease)."""
    if status == "failed":
        return ["sent", "delivered", "read"]
    rank = _STATUS_RANK.get(status, 0)
    return [s for s, r in _STATUS_RANK.items() if r < rank]


def _error_code(status: StatusUpdate) -> str | None:
    return None if status.error_code is None else str(status.error_code)


def apply_status_on_file(conn: sqlite3.Connection, status: StatusUpdate, now: datetime) -> None:
    allowed = _allowed_before(status.status)
    placeholders = ", ".join("?" * len(allowed))
    conn.execute(
        "UPDATE chatflow_outbox SET status = ?, error_code = ?, error_message = ?, updated_at = ? "
        f"WHERE platform = ? AND platform_message_id = ? AND status IN ({placeholders})",
        (
            status.status,
            _error_code(status),
            status.error_title,
            to_sqlite_datetime(now),
            status.platform,
            status.message_id,
            *allowed,
        ),
    )


def apply_status(status: StatusUpdate, now: datetime) -> Any:
    """The same update in SQLAlchemy."""
    return (
        update(OutboxRow)
        .where(
            OutboxRow.platform == status.platform,
            OutboxRow.platform_message_id == status.message_id,
            OutboxRow.status.in_(_allowed_before(status.status)),
        )
        .values(
            status=status.status,
            error_code=_error_code(status),
            error_message=status.error_title,
            updated_at=now,
        )
    )


# --- delivery --------------------------------------------------------------------------------------
async def claim(
    db: Database,
    owner: str,
    lease: timedelta,
    limit: int,
    targets: Mapping[str, type[ReplyTarget]],
    sessions: Sequence[str] | None = None,
) -> list[ClaimedReply]:
    """Lease up to `limit` deliverable rows, oldest first per conversation, with their chats' reachability.

    `targets` names each platform's ReplyTarget type, to read the rows' targets back with; `sessions`
    narrows the look-up as in leases.claim.
    """
    if limit <= 0 or (sessions is not None and not sessions):
        return []
    now = utcnow()
    if db.postgres is not None:
        rows = await leases.claim_on_postgres(
            db.postgres, OutboxRow, _CLAIMED, owner, now, now + lease, limit, sessions
        )
        unreachable = await chats.unreachable_on_postgres(db.postgres, _chats_of(rows))
    else:
        claim_file = leases.claim_on_file(OutboxRow, _CLAIMED, owner, now, now + lease, limit)
        claim_engine = leases.claim_on_engine(OutboxRow, _CLAIMED, owner, now, now + lease, limit)

        def on_file(conn: sqlite3.Connection) -> tuple[list[leases.Row], set[chats.Chat]]:
            rows = claim_file(conn)
            return rows, chats.unreachable_on_file(conn, _chats_of(rows))

        async def on_engine(conn: AsyncConnection) -> tuple[list[leases.Row], set[chats.Chat]]:
            rows = await claim_engine(conn)
            return rows, await chats.unreachable_on_engine(conn, _chats_of(rows))

        rows, unreachable = await db.write_alone(on_file, on_engine)  # see leases.claim_on_engine
    return _claimed(rows, unreachable, targets)


# PostgreSQL: the reply a sent one handed on to its delivery worker (sent_replies.Recorded.HANDED_ON),
# known by its lease's end as in inbox.take_handed_on, through the pending index from the sent row on
# (`status = 'pending'` spelled out for it), with whether its chat is unreachable (chats.py) in the
# same statement.
_HANDED_ON = Statement(
    text(
        f"SELECT id, {', '.join(_CLAIMED)}, EXISTS (SELECT FROM chatflow_chats AS c "
        "WHERE c.platform = o.platform AND c.chat_id = o.target_json ->> 'chat_id' AND NOT c.reachable) "
        "FROM chatflow_outbox AS o WHERE session_id = :session_id "
        "AND id > :after AND status = 'pending' AND lease_owner = :owner AND lease_until = :until "
        "ORDER BY id LIMIT 1"
    ).bindparams(bindparam("after", type_=BigInteger), bindparam("until", type_=DateTime(timezone=True)))
)


async def take_handed_on(
    db: Database,
    session_id: str,
    after: int,
    owner: str,
    until: datetime,
    targets: Mapping[str, type[ReplyTarget]],
) -> ClaimedReply | None:
    """The reply of `session_id` after row `after` that recording that row as sent leased to `owner`
    until `until`, if it did (on PostgreSQL; elsewhere nothing is handed on)."""
    if db.postgres is None:
        return None
    params = {"session_id": session_id, "after": after, "owner": owner, "until": until}
    found = await db.postgres.fetch(_HANDED_ON, params)
    if not found:
        return None
    *row, unreachable = found[0]
    return _claimed([tuple(row)], set(_chats_of([tuple(row)])) if unreachable else set(), targets)[0]


def _claimed(
    rows: list[leases.Row], unreachable: set[chats.Chat], targets: Mapping[str, type[ReplyTarget]]
) -> list[ClaimedReply]:
    claimed = []
    for row_id, platform, session_id, kind, body, target_json, attempts, retry_until in rows:
        target_type = targets.get(platform, ReplyTarget)
        target = target_type.from_json(target_json if isinstance(target_json, dict) else {})
        known = kind in _KINDS
        message = OutboundMessage(platform, session_id, OutboundKind(kind), target, body) if known else None
        reachable = (platform, target.chat_id) not in unreachable
        if isinstance(retry_until, str):  # the SQLite file's spelling
            retry_until = from_sqlite_datetime(retry_until)
        claimed.append(ClaimedReply(row_id, session_id, message, attempts, reachable, kind, retry_until))
    return claimed


def _chats_of(rows: list[leases.Row]) -> list[chats.Chat]:
    return [
        (row[1], str(row[5]["chat_id"]))
        for row in rows
        if isinstance(row[5], dict) and row[5].get("chat_id") is not None
    ]


async def renew(db: Database, ids: list[int], owner: str, lease: timedelta) -> set[int]:
    return await leases.renew(db, OutboxRow, ids, owner, lease)


async def release_many(db: Database, ids: list[int], owner: str) -> None:
    await leases.release_many(db, OutboxRow, ids, owner)


async def release(db: Database, row_id: int, owner: str) -> bool:
    return await leases.release(db, OutboxRow, row_id, owner)


async def finish(db: Database, row_id: int, owner: str, **values: Any) -> bool:
    """Record a delivery's outcome (its status, the platform's message id or error) and end the lease,
    if `owner` still holds it; False (nothing written) when another process took the row over."""
    values.update(lease_owner=None, lease_until=None, updated_at=utcnow())
    return await leases.settle(db, OutboxRow, row_id, owner, values)


# --- operators -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutboxItem:
    id: int
    inbox_id: int | None
    platform: str
    session_id: str
    kind: str
    status: str
    attempts: int
    error_code: str | None
    error_message: str | None
    created_at: datetime
    updated_at: datetime
    next_attempt_at: datetime
    retry_until: datetime | None


_ITEM_COLUMNS = (
    OutboxRow.id,
    OutboxRow.inbox_id,
    OutboxRow.platform,
    OutboxRow.session_id,
    OutboxRow.kind,
    OutboxRow.status,
    OutboxRow.attempts,
    OutboxRow.error_code,
    OutboxRow.error_message,
    OutboxRow.created_at,
    OutboxRow.updated_at,
    OutboxRow.next_attempt_at,
    OutboxRow.retry_until,
)


async def list_items(db: Database, status: str | None = None, limit: int = 50) -> list[OutboxItem]:
    """Newest first, optionally of one status (the `dead` view: replies given up on)."""
    query = select(*_ITEM_COLUMNS).order_by(OutboxRow.id.desc())
    if status is not None:
        query = query.where(OutboxRow.status == status, *of_status_index(status))
    async with db.connect() as conn:
        return [OutboxItem(**row._mapping) for row in await conn.execute(query.limit(limit))]


async def get_item(db: Database, outbox_id: int) -> OutboxItem | None:
    if not names_a_row(outbox_id):
        return None
    async with db.connect() as conn:
        row = (await conn.execute(select(*_ITEM_COLUMNS).where(OutboxRow.id == outbox_id))).one_or_none()
    return None if row is None else OutboxItem(**row._mapping)


async def requeue(db: Database, outbox_id: int) -> OutboxItem | None:
    """Send a dead or failed reply again, with fresh attempts and a fresh budget; the row as the requeue
    left it, or None if there is no dead or failed row with that id. Its conversation's later replies,
    already sent, stay sent: this one arrives after them."""
    if not names_a_row(outbox_id):
        return None
    now = utcnow()
    statement = (
        update(OutboxRow)
        .where(OutboxRow.id == outbox_id, OutboxRow.status.in_(RETRYABLE))
        .values(
            status="pending",
            attempts=0,
            next_attempt_at=now,
            retry_until=None,
            error_code=None,
            error_message=None,
            lease_owner=None,
            lease_until=None,
            updated_at=now,
        )
        .returning(*_ITEM_COLUMNS)
    )
    async with db.begin() as conn:
        row = (await conn.execute(statement)).one_or_none()
    return None if row is None else OutboxItem(**row._mapping)


@dataclass(frozen=True)
class Waiting:
    """A platform's replies held back by transient failures (an outage): how many, since when."""

    platform: str
    rows: int
    gives_up_at: datetime | None  # when the first of them is given up on (dead) if it keeps failing


async def waiting(db: Database) -> list[Waiting]:
    """Pending rows that have failed at least once, by platform: replies waiting on an unreachable
    (or throttling) platform. Read through the pending rows' index (a pending set's size)."""
    query = (
        select(OutboxRow.platform, func.count(), func.min(OutboxRow.retry_until))
        .where(OutboxRow.status == "pending", OutboxRow.attempts > 0)
        .group_by(OutboxRow.platform)
        .order_by(OutboxRow.platform)
    )
    async with db.connect() as conn:
        rows = list(await conn.execute(query))
    return [Waiting(platform, count, oldest) for platform, count, oldest in rows]
