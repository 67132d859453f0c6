"""PostgreSQL's statement_timeout (GATEWAY_DATABASE_TIMEOUT_SECONDS) bounds the service's statements,
but not a turn's wait for another turn of its session, which is one statement as long as that turn."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec
from gateway.store import migrations
from gateway.store.database import Database

TIMEOUT = 0.5

pytestmark = pytest.mark.postgres


class FirstTurnHolds:
    """The first turn answers only when told; the others at once."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        if not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return Message(Role.MODEL, f"re: {history[-1].content}")


async def test_a_turn_waiting_for_its_session_outlives_the_statement_timeout(postgres_url: str) -> None:
    database = Database.open(postgres_url, statement_timeout=TIMEOUT)
    try:
        await migrations.upgrade(database)
        async with database.connect() as conn:  # the setting is in force on the service's statements
            with pytest.raises(DBAPIError, match="statement timeout"):
                await conn.execute(text("SELECT pg_sleep(2)"))
        model = FirstTurnHolds()
        store = SQLSessionStore(database)
        # Another process's store: its turn waits for the session in PostgreSQL, not in this process.
        other = Database.open(postgres_url, statement_timeout=TIMEOUT)
        other_store = SQLSessionStore(other)
        first = asyncio.create_task(Runner(Agent("A", "a", model=model), store).run_async("s", "one"))
        await model.entered.wait()
        second = asyncio.create_task(Runner(Agent("A", "a", model=model), other_store).run_async("s", "two"))
        await asyncio.sleep(4 * TIMEOUT)  # the fault: a turn holding its session past the timeout
        assert not second.done()
        model.release.set()
        await asyncio.gather(first, second)
        session = await store.get("s")
        assert session is not None
        assert [m.content for m in session.history] == ["one", "re: one", "two", "re: two"]
        await other_store.aclose()
        await other.aclose()
        await store.aclose()
    finally:
        await database.aclose()
