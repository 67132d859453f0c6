"""Ingest on its own: group commit of dedup keys and inbox rows, on an SQLite file (through its writer
thread, in multi-row statements) and on PostgreSQL (through the engine)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.bootstrap import SWITCH_INTERVAL_SECONDS, tune_interpreter
from gateway.domain.inbound import ConversationKey, InboundMessage, MessageKind, ParsedUpdate
from gateway.store import migrations
from gateway.store.database import Database, refused_value
from gateway.store.engine import create_engine
from gateway.store.ingest import BUSY_WAITING_REQUESTS, MAX_ROWS_PER_STATEMENT
from gateway.store.ingest import Ingest as IngestRepository
from gateway.store.tables import InboxRow, ProcessedMessageRow

Item = tuple[InboundMessage, bool]  # a message, and whether it starts a turn


class Writer:
    """Ingest as the webhooks call it, one request (a list of messages) at a time."""

    def __init__(self, database: Database) -> None:
        self.repository = IngestRepository(database, timedelta(hours=192))

    @property
    def busy(self) -> bool:
        return self.repository.busy

    async def write(self, items: list[Item]) -> list[bool]:
        update = ParsedUpdate(messages=[message for message, _ in items])
        return await self.repository.write(update, [pending for _, pending in items])


@dataclass
class Ingest:
    engine: AsyncEngine
    writer: Writer
    database: Database


@pytest.fixture
async def ingest(database_url: str) -> AsyncIterator[Ingest]:
    database = Database.open(database_url)
    await migrations.upgrade(database)
    yield Ingest(database.engine, Writer(database), database)
    await database.aclose()


def item(key: str, text: str = "hello", *, session: str = "telegram:1", status: str = "pending") -> Item:
    chat = session.split(":")[1]
    message = InboundMessage(
        platform="telegram",
        message_id=key,
        dedup_key=key,
        conversation=ConversationKey("telegram", chat),
        kind=MessageKind.TEXT,
        timestamp=datetime.now(UTC),
        text=text,
        raw={"text": text, "nested": {"ünïcode": "✓", "list": [1, None]}},
    )
    return message, status == "pending"


async def inbox_rows(engine: AsyncEngine) -> list[tuple[str, str | None, dict[str, Any], str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(InboxRow.dedup_key, InboxRow.text, InboxRow.message_json, InboxRow.status).order_by(
                InboxRow.id
            )
        )
        return [tuple(row) for row in rows]


async def key_count(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(ProcessedMessageRow))).scalar_one())


async def test_a_batch_claims_new_keys_once_and_stores_their_rows(ingest: Ingest) -> None:
    first = await ingest.writer.write([item("k1", "one"), item("k2", "two"), item("k1", "again")])
    assert first == [True, True, False]  # a key twice in one batch: only its first item is new
    second = await ingest.writer.write([item("k2", "two"), item("k3", "three", status="recorded")])
    assert second == [False, True]
    rows = await inbox_rows(ingest.engine)
    assert [(key, text, status) for key, text, _, status in rows] == [
        ("k1", "one", "pending"),
        ("k2", "two", "pending"),
        ("k3", "three", "recorded"),
    ]
    assert rows[0][2]["raw"] == {"text": "one", "nested": {"ünïcode": "✓", "list": [1, None]}}
    assert await key_count(ingest.engine) == 3


async def test_batches_larger_than_one_statement(ingest: Ingest) -> None:
    count = 2 * MAX_ROWS_PER_STATEMENT + 37
    items = [item(f"big{i}", f"text {i}", session=f"telegram:{i % 7}") for i in range(count)]
    assert await ingest.writer.write(items) == [True] * count
    # The same keys again, mixed with new ones: only the new ones are written.
    again = [item(f"big{i}") for i in range(0, count, 3)] + [item(f"more{i}") for i in range(300)]
    result = await ingest.writer.write(again)
    assert result == [False] * len(range(0, count, 3)) + [True] * 300
    rows = await inbox_rows(ingest.engine)
    assert [key for key, *_ in rows] == [f"big{i}" for i in range(count)] + [f"more{i}" for i in range(300)]
    assert await key_count(ingest.engine) == count + 300


async def test_an_expired_key_is_claimed_again_and_keeps_its_first_row(ingest: Ingest) -> None:
    assert await ingest.writer.write([item("old", "first"), item("live", "first")]) == [True, True]
    past = datetime.now(UTC) - timedelta(hours=1)
    async with ingest.engine.begin() as conn:
        await conn.execute(
            update(ProcessedMessageRow)
            .where(ProcessedMessageRow.message_key == "old")
            .values(expires_at=past)
        )
    result = await ingest.writer.write([item("old", "second"), item("live", "second"), item("new")])
    assert result == [True, False, True]
    rows = await inbox_rows(ingest.engine)
    assert [(key, text) for key, text, *_ in rows] == [("old", "first"), ("live", "first"), ("new", "hello")]
    async with ingest.engine.connect() as conn:
        expires = (
            await conn.execute(
                select(ProcessedMessageRow.expires_at).where(ProcessedMessageRow.message_key == "old")
            )
        ).scalar_one()
    assert expires.replace(tzinfo=expires.tzinfo or UTC) > datetime.now(UTC) + timedelta(hours=191)


async def test_concurrent_writers_share_commits_and_each_key_is_new_once(ingest: Ingest) -> None:
    # 400 requests at once, every key sent twice (as a platform's re-delivery racing the original).
    keys = [f"c{i}" for i in range(200)]
    requests = [[item(key, f"text of {key}")] for key in keys + keys]
    results = await asyncio.gather(*(ingest.writer.write(request) for request in requests))
    new_per_key: dict[str, int] = {}
    for request, result in zip(requests, results, strict=True):
        key = request[0][0].dedup_key
        new_per_key[key] = new_per_key.get(key, 0) + sum(result)
    assert new_per_key == dict.fromkeys(keys, 1)
    rows = await inbox_rows(ingest.engine)
    assert [key for key, *_ in rows] == keys  # stored in the order the requests arrived


async def test_a_value_the_database_refuses_fails_only_its_own_request(ingest: Ingest) -> None:
    """The finding: one poison update failed its whole group commit, so every innocent webhook that
    joined its batch got 503 too. Now the batch is committed again one request at a time."""
    message, pending = item("broken")
    # No column takes it, on any backend (nor does the field's type: a deliberate type error).
    broken = (replace(message, text={"not": "a string"}), pending)  # type: ignore[arg-type]
    # All requests are queued before the writer wakes, so they share the first batch.
    results = await asyncio.gather(
        ingest.writer.write([item("fine-1")]),
        ingest.writer.write([broken]),
        ingest.writer.write([item("fine-2")]),
        return_exceptions=True,
    )
    assert results[0] == [True]
    assert results[2] == [True]
    assert isinstance(results[1], Exception)
    assert refused_value(results[1])
    assert sorted(key for key, *_ in await inbox_rows(ingest.engine)) == ["fine-1", "fine-2"]
    assert await ingest.writer.write([item("fine-3")]) == [True]  # the writer goes on


async def test_closing_the_database_finishes_what_is_queued(database_url: str) -> None:
    database = Database.open(database_url)
    await migrations.upgrade(database)
    writer = Writer(database)
    pending = [asyncio.ensure_future(writer.write([item(f"s{i}")])) for i in range(50)]
    await asyncio.sleep(0)  # every write is queued
    engine = create_engine(database_url)
    await database.aclose()
    assert [future.result() for future in pending] == [[True]] * 50
    assert len(await inbox_rows(engine)) == 50
    await engine.dispose()


def test_serving_lowers_the_gil_switch_interval() -> None:
    # The writer thread takes the GIL back after each statement; 5 ms each while the loop is busy.
    before = sys.getswitchinterval()
    try:
        tune_interpreter()
        assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_SECONDS))
    finally:
        sys.setswitchinterval(before)


async def test_the_writer_is_busy_only_while_many_requests_wait(ingest: Ingest) -> None:
    """A flood (many webhooks waiting for a commit) makes the writer busy; a steady trickle does not."""

    async def waiting_after(count: int, prefix: str) -> bool:
        writes = [asyncio.create_task(ingest.writer.write([item(f"{prefix}{n}")])) for n in range(count)]
        await asyncio.sleep(0)  # every write is queued and waits for its commit, none is answered yet
        busy = ingest.writer.busy
        assert all(result == [True] for result in await asyncio.gather(*writes))
        return busy

    assert not await waiting_after(BUSY_WAITING_REQUESTS - 1, "few")
    assert await waiting_after(BUSY_WAITING_REQUESTS, "many")
    assert not ingest.writer.busy  # all answered
