"""Chats (`chatflow_chats`): whether the bot may still send to a chat, as the platform last said.

A later membership change always wins over an earlier one, whatever order the webhooks arrive in.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Iterable
from typing import Any

from sqlalchemy import String, bindparam, false, select, text, tuple_
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.inbound import MembershipChange
from gateway.store.database import Database
from gateway.store.postgres_lanes import PostgresLanes, Statement
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import ChatRow

Chat = tuple[str, str]  # (platform, chat id)

UPSERT_SQL = (
    "INSERT INTO chatflow_chats (platform, chat_id, reachable, membership, updated_at) "
    "VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (platform, chat_id) DO UPDATE SET reachable = excluded.reachable, "
    "membership = excluded.membership, updated_at = excluded.updated_at "
    "WHERE chatflow_chats.updated_at <= excluded.updated_at"
)


def upsert_on_file(conn: sqlite3.Connection, change: MembershipChange) -> None:
    params = (
        change.platform,
        change.chat_id,
        change.reachable,
        change.status,
        to_sqlite_datetime(change.timestamp),
    )
    conn.execute(UPSERT_SQL, params)


def upsert(db: Database, change: MembershipChange) -> Any:
    """The same upsert as UPSERT_SQL, in SQLAlchemy."""
    statement = db.insert(ChatRow).values(
        platform=change.platform,
        chat_id=change.chat_id,
        reachable=change.reachable,
        membership=change.status,
        updated_at=change.timestamp,
    )
    return statement.on_conflict_do_update(
        index_elements=[ChatRow.platform, ChatRow.chat_id],
        set_={
            "reachable": statement.excluded.reachable,
            "membership": statement.excluded.membership,
            "updated_at": statement.excluded.updated_at,
        },
        where=ChatRow.updated_at <= statement.excluded.updated_at,
    )


@functools.cache
def _unreachable_sql(count: int) -> str:
    marks = ", ".join("?" * count)
    return f"SELECT platform, chat_id FROM chatflow_chats WHERE reachable = 0 AND chat_id IN ({marks})"


def unreachable_on_file(conn: sqlite3.Connection, chats: Iterable[Chat]) -> set[Chat]:
    """Of these chats, those the platform said the bot was removed from or blocked in."""
    wanted = set(chats)
    if not wanted:
        return set()
    ids = sorted({chat_id for _, chat_id in wanted})
    found = set()
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        found.update(conn.execute(_unreachable_sql(len(chunk)), chunk).fetchall())
    return {(platform, chat_id) for platform, chat_id in found} & wanted


async def unreachable_on_engine(conn: AsyncConnection, chats: Iterable[Chat]) -> set[Chat]:
    wanted = sorted(set(chats))
    if not wanted:
        return set()
    query = select(ChatRow.platform, ChatRow.chat_id).where(
        ChatRow.reachable == false(), tuple_(ChatRow.platform, ChatRow.chat_id).in_(wanted)
    )
    return {(platform, chat_id) for platform, chat_id in await conn.execute(query)}


_UNREACHABLE_ON_POSTGRES = Statement(
    text(
        "SELECT c.platform, c.chat_id FROM chatflow_chats AS c JOIN unnest(:platforms, :chat_ids) "
        "AS w(platform, chat_id) ON c.platform = w.platform AND c.chat_id = w.chat_id WHERE NOT c.reachable"
    ).bindparams(bindparam("platforms", type_=ARRAY(String)), bindparam("chat_ids", type_=ARRAY(String)))
)


async def unreachable_on_postgres(lanes: PostgresLanes, chats: Iterable[Chat]) -> set[Chat]:
    wanted = sorted(set(chats))
    if not wanted:
        return set()
    params = {"platforms": [p for p, _ in wanted], "chat_ids": [c for _, c in wanted]}
    return {(platform, chat_id) for platform, chat_id in await lanes.fetch(_UNREACHABLE_ON_POSTGRES, params)}


async def unreachable(db: Database, chats: Iterable[Chat]) -> set[Chat]:
    wanted = sorted(set(chats))
    return await db.read(
        lambda conn: unreachable_on_file(conn, wanted),
        lambda conn: unreachable_on_engine(conn, wanted),
    )
