"""chatflow_turn_usage: what each turn's model calls cost, written with the turn, added up per session and
per day for the admin API."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.domain.usage import TurnUsage
from gateway.store.database import Database
from gateway.store.sqlite_thread import to_sqlite_datetime
from gateway.store.tables import TurnUsageRow

_INSERT = (
    "INSERT INTO chatflow_turn_usage (inbox_id, session_id, model, calls, input_tokens, output_tokens, "
    "latency_ms, tool_calls, day, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _values(usage: TurnUsage) -> tuple[str, int, int, int, int, int]:
    return (
        usage.model,
        usage.calls,
        usage.input_tokens,
        usage.output_tokens,
        round(usage.latency_s * 1000),
        usage.tool_calls,
    )


def insert_on_file(
    inbox_id: int | None, session_id: str, usages: Sequence[TurnUsage], now: datetime
) -> Callable[[sqlite3.Connection], None]:
    rows = [
        (inbox_id, session_id, *_values(u), now.date().isoformat(), to_sqlite_datetime(now)) for u in usages
    ]

    def work(conn: sqlite3.Connection) -> None:
        if rows:
            conn.executemany(_INSERT, rows)

    return work


async def insert_on_engine(
    conn: AsyncConnection, inbox_id: int | None, session_id: str, usages: Sequence[TurnUsage], now: datetime
) -> None:
    if not usages:
        return
    names = ("model", "calls", "input_tokens", "output_tokens", "latency_ms", "tool_calls")
    await conn.execute(
        insert(TurnUsageRow),
        [
            {
                "inbox_id": inbox_id,
                "session_id": session_id,
                **dict(zip(names, _values(u), strict=True)),
                "day": now.date().isoformat(),
                "created_at": now,
            }
            for u in usages
        ],
    )


@dataclass(frozen=True)
class Totals:
    """Usage added up over a group of turns (a session's, a day's) for one model."""

    model: str
    turns: int
    calls: int
    input_tokens: int
    output_tokens: int
    latency_ms: int
    tool_calls: int
    day: str | None = None


_SUMS = (
    TurnUsageRow.model,
    func.count(),
    func.sum(TurnUsageRow.calls),
    func.sum(TurnUsageRow.input_tokens),
    func.sum(TurnUsageRow.output_tokens),
    func.sum(TurnUsageRow.latency_ms),
    func.sum(TurnUsageRow.tool_calls),
)


async def session_totals(db: Database, session_id: str) -> list[Totals]:
    """Per model, the usage of a session's turns (empty if it has none)."""
    query = (
        select(*_SUMS)
        .where(TurnUsageRow.session_id == session_id)
        .group_by(TurnUsageRow.model)
        .order_by(TurnUsageRow.model)
    )
    async with db.connect() as conn:
        return [_totals(row) for row in await conn.execute(query)]


async def daily_totals(db: Database, since: str) -> list[Totals]:
    """Per UTC day (newest first) and model, the usage of the turns from day `since` (YYYY-MM-DD) on."""
    query = (
        select(*_SUMS, TurnUsageRow.day)
        .where(TurnUsageRow.day >= since)
        .group_by(TurnUsageRow.day, TurnUsageRow.model)
        .order_by(TurnUsageRow.day.desc(), TurnUsageRow.model)
    )
    async with db.connect() as conn:
        return [_totals(row, row[7]) for row in await conn.execute(query)]


def _totals(row: Any, day: str | None = None) -> Totals:
    turns, calls, input_tokens, output_tokens, latency_ms, tool_calls = (int(v or 0) for v in row[1:7])
    return Totals(row[0], turns, calls, input_tokens, output_tokens, latency_ms, tool_calls, day)
