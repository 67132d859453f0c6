"""A turn's unit of work: the session's changes, its inbox row (or coalesced run of rows) done and its
replies, in one transaction.

The worker's turn must leave all three or none: a crash before the commit leaves the inbox row to be
claimed again; a lost lease (another worker took the row) or a deleted session writes nothing.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, Integer, String, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.outbound import OutboundMessage
from gateway.domain.usage import TurnUsage
from gateway.store import inbox, outbox, runs, sessions, usage
from gateway.store.database import Database
from gateway.store.inbox import LeaseLostError
from gateway.store.postgres_lanes import PostgresLanes, Statement
from gateway.store.storable import json_text

__all__ = ["LeaseLostError", "TurnCompletion", "TurnReceipt", "commit"]


@dataclass
class TurnReceipt:
    """What a commit did beyond its writes, for the worker that asked for it."""

    # Set when the conversation's next row may be leased to the worker: that lease's end, which
    # inbox.take_handed_on knows it by (hand_on_until).
    handed_on_until: datetime | None = None


@dataclass(frozen=True)
class TurnCompletion:
    """Marks inbox row `inbox_id` done, if `lease_owner` still holds it, queues `outbound` and records
    what its model calls cost (`usage`, per model). `also_done`: the other rows of a coalesced run
    (store/runs.py), answered by the same turn and marked done with it, each if still held.
    `hand_on_until` (PostgreSQL; None: let go): the conversation's next pending row, if one is due,
    is leased to `lease_owner` until then by the same commit (migration 0015); `receipt.handed_on_until`
    then says to take it with `inbox.take_handed_on` instead of claiming it."""

    inbox_id: int
    lease_owner: str
    outbound: list[OutboundMessage] = field(default_factory=list)
    usage: list[TurnUsage] = field(default_factory=list)
    also_done: tuple[int, ...] = ()
    hand_on_until: datetime | None = None
    receipt: TurnReceipt = field(default_factory=TurnReceipt)


async def commit(db: Database, turn: sessions.TurnWrite, completion: TurnCompletion | None = None) -> bool:
    """Write the turn; False when its session was deleted meanwhile, LeaseLostError when the inbox row
    is no longer ours (nothing written either way)."""
    if completion is not None and db.postgres is not None:
        return await _commit_on_postgres(db.postgres, turn, completion)
    now = turn.fields.updated_at
    save_file = sessions.save_on_file(turn)
    replies_file = (
        None if completion is None else outbox.insert_on_file(completion.inbox_id, completion.outbound, now)
    )
    usage_file = (
        None
        if completion is None
        else usage.insert_on_file(completion.inbox_id, turn.session_id, completion.usage, now)
    )

    def on_file(conn: sqlite3.Connection) -> bool:
        if not save_file(conn):
            return False
        if completion is not None and replies_file is not None and usage_file is not None:
            inbox.complete_on_file(conn, completion.inbox_id, completion.lease_owner, now)
            if completion.also_done:
                runs.complete_on_file(conn, completion.also_done, completion.lease_owner, now)
            replies_file(conn)
            usage_file(conn)
        return True

    async def on_engine(conn: AsyncConnection) -> bool:
        if not await sessions.save_on_engine(conn, turn):
            await conn.rollback()
            return False
        if completion is not None:
            await inbox.complete_on_engine(conn, completion.inbox_id, completion.lease_owner, now)
            if completion.also_done:
                await runs.complete_on_engine(conn, completion.also_done, completion.lease_owner, now)
            await outbox.insert_on_engine(conn, completion.inbox_id, completion.outbound, now)
            await usage.insert_on_engine(conn, completion.inbox_id, turn.session_id, completion.usage, now)
        return True

    return await db.write(on_file, on_engine)


# PostgreSQL: a worker's turn in one statement, outside any transaction: one round trip instead of
# eight (BEGIN, five statements, an executemany, COMMIT): on the 2-core benchmark machine a round trip
# costs the gateway ~150 us of CPU in the driver and the kernel alone, and this cut its CPU per message
# by a fifth (benchmarks/postgres.py). A statement is atomic by itself, and each write in it is gated
# on the one before through EXISTS: the session row is locked first (a concurrent delete then waits
# for this commit, or won before it and nothing is written), the inbox rows (the turn's, and a
# coalesced run's, store/runs.py) are locked and marked done only while every lease is ours, and the
# rest only once they were. Rows go in through unnest() of one array per
# column, in their order. The run's rows are named with their conversation too: by their ids alone
# PostgreSQL read the whole pending index (its statistics say few rows are pending), dead entries and
# all while a snapshot was held open; with the conversation it reads that conversation's entries.
# A row done with its lease kept hands the conversation on to its owner (migration 0015): asked for
# only when this statement sees a next row waiting, so the worker looks for one only then.
_DONE = (
    "held AS MATERIALIZED (SELECT id FROM chatflow_inbox WHERE session_id = :session_id AND id = ANY(:run) "
    "AND lease_owner = :owner AND status = 'pending' ORDER BY id FOR UPDATE), "
    "waiting AS MATERIALIZED (SELECT EXISTS (SELECT FROM chatflow_inbox WHERE session_id = :session_id "
    "AND status = 'pending' AND id > :last AND CAST(:kept_until AS TIMESTAMPTZ) IS NOT NULL) AS seen), "
    "done AS (UPDATE chatflow_inbox SET status = 'done', finished_at = :now, "
    "lease_owner = CASE WHEN (SELECT seen FROM waiting) THEN :owner END, "
    "lease_until = CASE WHEN (SELECT seen FROM waiting) THEN :kept_until END "
    "WHERE id IN (SELECT id FROM held) AND (SELECT count(*) FROM held) = :run_size "
    "AND EXISTS (SELECT FROM live) RETURNING 1)"
)
_SESSION_UPDATED = (
    "WITH live AS MATERIALIZED (SELECT 1 FROM chatflow_sessions WHERE session_id = :session_id FOR UPDATE), "
    f"{_DONE}, "
    "written AS (UPDATE chatflow_sessions SET active_agent_name = :agent, title = COALESCE(title, :title), "
    "metadata_json = CAST(:metadata AS JSON), updated_at = :updated_at, message_count = :message_count "
    "WHERE session_id = :session_id AND EXISTS (SELECT FROM done) RETURNING 1), "
)
_SESSION_CREATED = (
    f"WITH live AS (SELECT 1), {_DONE}, "
    "written AS (INSERT INTO chatflow_sessions (session_id, active_agent_name, title, metadata_json, "
    "created_at, updated_at, message_count) SELECT :session_id, :agent, :title, CAST(:metadata AS JSON), "
    ":created_at, :updated_at, :message_count WHERE EXISTS (SELECT FROM done) RETURNING 1), "
)
_REST = (
    "pruned AS (DELETE FROM chatflow_messages WHERE session_id = :session_id AND position = ANY(:pruned) "
    "AND EXISTS (SELECT FROM written)), "
    "added AS (INSERT INTO chatflow_messages (session_id, position, role, message_json, created_at) "
    "SELECT :session_id, m.position, m.role, CAST(m.message AS JSON), m.created_at "
    "FROM unnest(:positions, :roles, :messages, :created) AS m(position, role, message, created_at) "
    "WHERE EXISTS (SELECT FROM written)), "
    "replies AS (INSERT INTO chatflow_outbox (inbox_id, platform, session_id, kind, text, target_json, "
    "status, attempts, next_attempt_at, created_at, updated_at) "
    "SELECT :inbox_id, r.platform, r.session_id, r.kind, r.text, CAST(r.target AS JSON), 'pending', 0, "
    ":now, :now, :now FROM unnest(:r_platforms, :r_sessions, :r_kinds, :r_texts, :r_targets) "
    "WITH ORDINALITY AS r(platform, session_id, kind, text, target, n) "
    "WHERE EXISTS (SELECT FROM written) ORDER BY r.n), "
    "used AS (INSERT INTO chatflow_turn_usage (inbox_id, session_id, model, calls, input_tokens, "
    "output_tokens, latency_ms, tool_calls, day, created_at) "
    "SELECT :inbox_id, :session_id, u.*, :day, :now "
    "FROM unnest(:u_models, :u_calls, :u_inputs, :u_outputs, :u_latencies, :u_tools) AS u "
    "WHERE EXISTS (SELECT FROM written)) "
    "SELECT (SELECT count(*) FROM live), (SELECT count(*) FROM done), (SELECT seen FROM waiting)"
)
_ARRAY_TYPES: dict[str, Any] = {
    "positions": ARRAY(Integer),
    "roles": ARRAY(String),
    "messages": ARRAY(Text),
    "created": ARRAY(DateTime(timezone=True)),
    "pruned": ARRAY(Integer),
    "r_platforms": ARRAY(String),
    "r_sessions": ARRAY(String),
    "r_kinds": ARRAY(String),
    "r_texts": ARRAY(Text),
    "r_targets": ARRAY(Text),
    "u_models": ARRAY(String),
    "u_calls": ARRAY(Integer),
    "u_inputs": ARRAY(BigInteger),
    "u_outputs": ARRAY(BigInteger),
    "u_latencies": ARRAY(Integer),
    "u_tools": ARRAY(Integer),
    "run": ARRAY(BigInteger),
}
_SCALAR_TYPES: dict[str, Any] = {
    "now": DateTime(timezone=True),
    "kept_until": DateTime(timezone=True),
    "last": BigInteger,
    "updated_at": DateTime(timezone=True),
    "created_at": DateTime(timezone=True),
    "inbox_id": BigInteger,
    "message_count": Integer,
    "run_size": Integer,
    "title": String,
    "metadata": Text,
}


def _postgres_statement(head: str) -> Statement:
    sql = head + _REST
    types = {**_ARRAY_TYPES, **_SCALAR_TYPES}
    bound = (bindparam(name, type_=kind) for name, kind in types.items() if re.search(rf":{name}\b", sql))
    return Statement(text(sql).bindparams(*bound))


_TURN_SESSION_UPDATED = _postgres_statement(_SESSION_UPDATED)
_TURN_SESSION_CREATED = _postgres_statement(_SESSION_CREATED)


async def _commit_on_postgres(
    lanes: PostgresLanes, turn: sessions.TurnWrite, completion: TurnCompletion
) -> bool:
    fields, now = turn.fields, turn.fields.updated_at
    replies, usages = completion.outbound, completion.usage
    params: dict[str, Any] = {
        "session_id": turn.session_id,
        "inbox_id": completion.inbox_id,
        "owner": completion.lease_owner,
        "run": [completion.inbox_id, *completion.also_done],
        "run_size": 1 + len(completion.also_done),
        "last": max((completion.inbox_id, *completion.also_done)),
        "kept_until": completion.hand_on_until,
        "now": now,
        "agent": fields.active_agent_name,
        "title": fields.title,
        "metadata": json_text(fields.metadata),
        "updated_at": fields.updated_at,
        "message_count": fields.message_count,
        "pruned": turn.pruned,
        "positions": [r.position for r in turn.rows],
        "roles": [r.role for r in turn.rows],
        "messages": [json_text(r.message) for r in turn.rows],
        "created": [r.created_at for r in turn.rows],
        "r_platforms": [m.platform for m in replies],
        "r_sessions": [m.session_id for m in replies],
        "r_kinds": [m.kind.value for m in replies],
        "r_texts": [m.text for m in replies],
        "r_targets": [json_text(m.target.to_json()) for m in replies],
        "u_models": [u.model for u in usages],
        "u_calls": [u.calls for u in usages],
        "u_inputs": [u.input_tokens for u in usages],
        "u_outputs": [u.output_tokens for u in usages],
        "u_latencies": [round(u.latency_s * 1000) for u in usages],
        "u_tools": [u.tool_calls for u in usages],
        "day": now.date().isoformat(),
    }
    if turn.created_at is None:
        statement = _TURN_SESSION_UPDATED
    else:
        statement, params["created_at"] = _TURN_SESSION_CREATED, turn.created_at

    ((live, done, handed_on),) = await lanes.fetch(statement, params)
    if done and handed_on:
        completion.receipt.handed_on_until = completion.hand_on_until
    if not live:
        return False
    if not done:
        run = [completion.inbox_id, *completion.also_done]
        raise LeaseLostError(f"inbox rows {run} are not all held by {completion.lease_owner} any more")
    return True
