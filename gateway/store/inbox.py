"""The inbox (`chatflow_inbox`): messages accepted by the webhooks, waiting for (or done with) their turn.

A row is written with its dedup key before the webhook answers 200 (gateway/store/ingest.py); the
worker claims it (gateway/store/leases.py) and its turn marks it done in the turn's own transaction
(gateway/store/turns.py). Operators list, read and requeue rows (`gateway inbox …`, the admin API).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import BigInteger, DateTime, bindparam, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.inbound import InboundMessage, agent_text
from gateway.domain.messages import utcnow
from gateway.domain.sessions import StoredVersion
from gateway.errors import GatewayError
from gateway.store import leases, outbox, storable
from gateway.store.database import Database
from gateway.store.postgres_lanes import Statement
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import InboxRow, names_a_row, of_status_index

STATUSES = ("pending", "recorded", "done", "dead")
_CLAIMED = ("platform", "session_id", "text", "message_json", "attempts", leases.SESSION_VERSION)


class LeaseLostError(GatewayError):
    """The inbox row is no longer ours (its lease expired and another worker took it); nothing was written."""


# --- writing new rows (the webhooks) ---------------------------------------------------------------
InsertParams = tuple[Any, ...]  # 10 per row, in the column order of insert_sql


def status_of(pending: bool) -> str:
    """ "pending" when a turn is due, "recorded" when the message is only kept."""
    return "pending" if pending else "recorded"


def insert_params(message: InboundMessage, pending: bool, stamp: str) -> InsertParams:
    return (
        message.dedup_key,
        message.platform,
        message.session_id,
        message.message_id,
        message.kind.value,
        agent_text(message),
        storable.json_text(message.to_dict()),
        status_of(pending),
        stamp,
        stamp,
    )


@cache
def insert_sql(count: int) -> str:
    """`count` new rows; a key re-claimed after its TTL keeps its old row (parameters: InsertParams each)."""
    rows = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)"] * count)
    return (
        "INSERT OR IGNORE INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
        f"message_json, status, attempts, next_attempt_at, received_at) VALUES {rows}"
    )


# The insert inside the ingest trigger (gateway/store/ingest.py), after its key's claim changed a row.
TRIGGER_INSERT = (
    "INSERT OR IGNORE INTO chatflow_inbox (dedup_key, platform, session_id, message_id, kind, text, "
    "message_json, status, attempts, next_attempt_at, received_at) SELECT NEW.message_key, "
    "NEW.inbox_platform, NEW.session_id, NEW.message_id, NEW.kind, NEW.text, NEW.message_json, NEW.status, "
    "0, NEW.processed_at, NEW.processed_at WHERE NEW.inbox AND changes() = 1"
)


def insert_values(message: InboundMessage, pending: bool, now: datetime) -> dict[str, Any]:
    """A new row for SQLAlchemy's insert (on conflict do nothing, as insert_sql)."""
    return {
        "dedup_key": message.dedup_key,
        "platform": message.platform,
        "session_id": message.session_id,
        "message_id": message.message_id,
        "kind": message.kind.value,
        "text": agent_text(message),
        "message_json": message.to_dict(),
        "status": status_of(pending),
        "attempts": 0,
        "next_attempt_at": now,
        "received_at": now,
    }


def insert(db: Database, rows: list[dict[str, Any]]) -> Any:
    return db.insert(InboxRow).values(rows).on_conflict_do_nothing()


# --- the worker ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClaimedMessage:
    id: int
    platform: str
    session_id: str
    text: str | None
    message: InboundMessage
    attempts: int
    # Its session's version as the claim read it (leases.SESSION_VERSION); None for rows leased otherwise.
    session_version: StoredVersion | None = None


async def claim(
    db: Database, owner: str, lease: timedelta, limit: int, sessions: Sequence[str] | None = None
) -> list[ClaimedMessage]:
    """Lease up to `limit` messages whose turns may run, `sessions` first (see leases.claim)."""
    return _claimed(await leases.claim(db, InboxRow, _CLAIMED, owner, lease, limit, sessions))


# PostgreSQL: the row a turn's commit handed on to its worker (turns.TurnCompletion.hand_on_until),
# known by its lease's end, which the settle copied from the finished row: a row the worker's own
# claim leased meanwhile (its lease ends at another instant) is running already. Found through the
# pending index from the finished row on: the conversation's earlier rows, whose entries a held
# snapshot keeps, are not read. `status = 'pending'` is spelled out for that index.
_HANDED_ON = Statement(
    text(
        "SELECT id, platform, session_id, text, message_json, attempts, "
        f"{leases.SESSION_VERSION_SQL.format(queue='chatflow_inbox')} FROM chatflow_inbox "
        "WHERE session_id = :session_id AND id > :after AND status = 'pending' AND lease_owner = :owner "
        "AND lease_until = :until ORDER BY id LIMIT 1"
    ).bindparams(bindparam("after", type_=BigInteger), bindparam("until", type_=DateTime(timezone=True)))
)


async def take_handed_on(
    db: Database, session_id: str, after: int, owner: str, until: datetime
) -> ClaimedMessage | None:
    """The row of `session_id` after row `after` that a turn's commit leased to `owner` until `until`,
    if it did (on PostgreSQL; elsewhere nothing is handed on)."""
    if db.postgres is None:
        return None
    params = {"session_id": session_id, "after": after, "owner": owner, "until": until}
    rows = await db.postgres.fetch(_HANDED_ON, params)
    return next(iter(_claimed([tuple(row) for row in rows])), None)


def _claimed(rows: list[leases.Row]) -> list[ClaimedMessage]:
    return [
        ClaimedMessage(
            row_id,
            platform,
            session_id,
            text,
            InboundMessage.from_dict(
                stored if isinstance(stored, dict) else {}, platform=platform, session_id=session_id
            ),
            attempts,
            StoredVersion(version),
        )
        for row_id, platform, session_id, text, stored, attempts, version in rows
    ]


_COMPLETE = (
    "UPDATE chatflow_inbox SET status = 'done', finished_at = ?, lease_owner = NULL, lease_until = NULL "
    "WHERE id = ? AND lease_owner = ? AND status = 'pending'"
)


def complete_on_file(conn: sqlite3.Connection, inbox_id: int, owner: str, now: datetime) -> None:
    """Mark the row done if `owner` still holds it; LeaseLostError (nothing kept) otherwise."""
    if conn.execute(_COMPLETE, (to_sqlite_datetime(now), inbox_id, owner)).rowcount != 1:
        raise LeaseLostError(f"inbox row {inbox_id} is no longer held by {owner}")


_COMPLETE_STATEMENT = (
    update(InboxRow)
    .where(
        InboxRow.id == bindparam("inbox_id"),
        InboxRow.lease_owner == bindparam("owner"),
        InboxRow.status == "pending",
    )
    .values(
        status="done",
        finished_at=bindparam("now", type_=InboxRow.finished_at.type),
        lease_owner=None,
        lease_until=None,
    )
)


async def complete_on_engine(conn: AsyncConnection, inbox_id: int, owner: str, now: datetime) -> None:
    done = await conn.execute(_COMPLETE_STATEMENT, {"inbox_id": inbox_id, "owner": owner, "now": now})
    if done.rowcount != 1:
        raise LeaseLostError(f"inbox row {inbox_id} is no longer held by {owner}")


async def renew(db: Database, ids: list[int], owner: str, lease: timedelta) -> set[int]:
    return await leases.renew(db, InboxRow, ids, owner, lease)


async def release_many(db: Database, ids: list[int], owner: str) -> None:
    await leases.release_many(db, InboxRow, ids, owner)


async def release(db: Database, inbox_id: int, owner: str) -> bool:
    return await leases.release(db, InboxRow, inbox_id, owner)


async def fail(
    db: Database, inbox_id: int, owner: str, *, attempts: int, error: str, retry_at: datetime, dead: bool
) -> bool:
    """Record a failed turn: retried at `retry_at`, or `dead` (an operator may requeue it)."""
    values = failure_values(attempts=attempts, error=error, retry_at=retry_at, dead=dead)
    return await leases.settle(db, InboxRow, inbox_id, owner, values)


def failure_values(*, attempts: int, error: str, retry_at: datetime, dead: bool) -> dict[str, Any]:
    """What a failed turn writes on its row (or on each row of a coalesced run): its lease ends."""
    values: dict[str, Any] = {
        "attempts": attempts,
        "last_error": error,
        "lease_owner": None,
        "lease_until": None,
        "next_attempt_at": retry_at,
    }
    if dead:
        values.update(status="dead", finished_at=utcnow())
    return values


# --- operators -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InboxItem:
    id: int
    platform: str
    session_id: str
    kind: str
    status: str
    attempts: int
    text: str | None
    last_error: str | None
    received_at: datetime


_ITEM_COLUMNS = (
    InboxRow.id,
    InboxRow.platform,
    InboxRow.session_id,
    InboxRow.kind,
    InboxRow.status,
    InboxRow.attempts,
    InboxRow.text,
    InboxRow.last_error,
    InboxRow.received_at,
)


async def list_items(db: Database, status: str | None = None, limit: int = 50) -> list[InboxItem]:
    """Newest first, optionally of one status."""
    query = select(*_ITEM_COLUMNS).order_by(InboxRow.id.desc())
    if status is not None:
        query = query.where(InboxRow.status == status, *of_status_index(status))
    async with db.connect() as conn:
        return [InboxItem(*row) for row in await conn.execute(query.limit(limit))]


async def get_item(db: Database, inbox_id: int) -> InboxItem | None:
    if not names_a_row(inbox_id):
        return None
    async with db.connect() as conn:
        row = (await conn.execute(select(*_ITEM_COLUMNS).where(InboxRow.id == inbox_id))).one_or_none()
    return None if row is None else InboxItem(*row)


async def retry(db: Database, inbox_id: int) -> bool:
    """Put a dead row back in the queue with fresh attempts; False if there is no dead row with that id."""
    return await requeue(db, inbox_id) is not None


async def requeue(db: Database, inbox_id: int) -> InboxItem | None:
    """Like `retry`, answering the row as the requeue left it (None if there is no dead row with that id).
    Its model outage is forgotten: a row that gave up after GATEWAY_MODEL_RETRY_S gets a patience anew."""
    if not names_a_row(inbox_id):
        return None
    statement = (
        update(InboxRow)
        .where(InboxRow.id == inbox_id, InboxRow.status == "dead")
        .values(
            status="pending",
            attempts=0,
            next_attempt_at=utcnow(),
            lease_owner=None,
            lease_until=None,
            outage_started_at=None,
            holding_reply_at=None,
        )
        .returning(*_ITEM_COLUMNS)
    )
    async with db.begin() as conn:
        row = (await conn.execute(statement)).one_or_none()
    return None if row is None else InboxItem(*row)


@dataclass(frozen=True)
class Outcome:
    """Where a message stands: its inbox row's status, and the replies its turn put in the outbox."""

    status: str
    last_error: str | None
    replies: list[str]


async def outcome(db: Database, dedup_key: str) -> Outcome | None:
    """None while no inbox row has that key; the replies are there once the status is `done`."""
    async with db.connect() as conn:
        row = (
            await conn.execute(
                select(InboxRow.id, InboxRow.status, InboxRow.last_error).where(
                    InboxRow.dedup_key == dedup_key
                )
            )
        ).first()
        if row is None:
            return None
        return Outcome(row.status, row.last_error, await outbox.reply_texts(conn, row.id))
