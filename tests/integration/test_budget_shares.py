"""Processes on one database share the model providers' budgets: each keeps 1 / the processes that
beat in `chatflow_budget_members`; a stopped one leaves at once, a silent one is forgotten."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from gateway.agents.models.budget import ProviderBudget
from gateway.domain.messages import utcnow
from gateway.store import budget_members, migrations
from gateway.store.database import Database
from gateway.worker.budget_shares import share_budgets

STALE = timedelta(seconds=20)


async def test_members_are_counted_until_they_leave_or_fall_silent(migrated_database: Database) -> None:
    now = utcnow()
    assert await budget_members.beat(migrated_database, "a", now, STALE) == 1
    assert await budget_members.beat(migrated_database, "b", now, STALE) == 2
    assert await budget_members.beat(migrated_database, "a", now + timedelta(seconds=5), STALE) == 2
    # b has not beaten for longer than the stale window: crashed or frozen, forgotten
    assert await budget_members.beat(migrated_database, "a", now + timedelta(seconds=21), STALE) == 1
    assert await budget_members.beat(migrated_database, "c", now + timedelta(seconds=22), STALE) == 2
    await budget_members.leave(migrated_database, "c")
    assert await budget_members.beat(migrated_database, "a", now + timedelta(seconds=23), STALE) == 1


class Watched(ProviderBudget):
    """A budget that says when its share changes."""

    def __init__(self, *args: Any, **limits: Any) -> None:
        super().__init__(*args, **limits)
        self.changed = asyncio.Event()

    def share_among(self, processes: int) -> None:
        super().share_among(processes)
        self.changed.set()

    async def shared_by(self, processes: int) -> None:
        async with asyncio.timeout(30):
            while self.processes != processes:
                self.changed.clear()
                await self.changed.wait()


async def test_two_processes_halve_their_budgets_and_one_stopping_gives_it_back(
    migrated_database: Database, database_url: str
) -> None:
    other = Database.open(database_url)  # a second process's view of the same database
    await migrations.ensure_head(other)
    mine, theirs = Watched("openai", rpm=600), Watched("openai", rpm=600)
    unlimited = ProviderBudget("gemini")
    first = asyncio.create_task(share_budgets(migrated_database, [mine, unlimited], "p1", interval=0.05))
    second = asyncio.create_task(share_budgets(other, [theirs], "p2", interval=0.05))
    try:
        await mine.shared_by(2)
        await theirs.shared_by(2)
        assert unlimited.processes == 1  # nothing to share
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        await mine.shared_by(1)  # the whole budget back once the other left
    finally:
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await other.aclose()
    assert await budget_members.beat(migrated_database, "p3", utcnow(), STALE) == 1  # both left


async def test_without_limits_no_process_beats(migrated_database: Database) -> None:
    await share_budgets(migrated_database, [ProviderBudget("openai")], "p1", interval=0.05)  # returns at once
    assert await budget_members.beat(migrated_database, "p2", utcnow(), STALE) == 1
