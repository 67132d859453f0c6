"""Keeps this process's share of the model providers' budgets: 1 / the processes running turns.

GATEWAY_OPENAI_RPM and the other limits are the provider account's. Several processes on one
database (`gateway serve --workers`, replicas, `gateway worker`) would each spend the whole of them;
instead each beats among the budget members (gateway/store/budget_members.py) every `interval` and
keeps `1 / processes` of every limit (gateway/agents/models/budget.py). A process that stops leaves at
once; one that crashed or froze, or could not leave within LEAVE_SECONDS, is forgotten after
`stale_after`, and the others' shares grow back at their next beat. While the database cannot be
reached the last share stays (a process alone keeps the whole budget until its first beat).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from datetime import timedelta

import structlog

from gateway.agents.models.budget import ProviderBudget
from gateway.domain.messages import utcnow
from gateway.store import budget_members
from gateway.store.database import Database

log = structlog.get_logger(__name__)

BEAT_SECONDS = 5.0
STALE_AFTER_SECONDS = 20.0  # four beats missed: the process is gone
LEAVE_SECONDS = 2.0  # the longest a stopping process waits to leave (a frozen database: it goes stale)


async def share_budgets(
    database: Database,
    budgets: Iterable[ProviderBudget],
    owner: str,
    *,
    interval: float = BEAT_SECONDS,
    stale_after: float = STALE_AFTER_SECONDS,
) -> None:
    """Beat and apply the share until cancelled, then leave. Nothing to do when no limit is set."""
    limited = [budget for budget in budgets if budget.limited]
    if not limited:
        return
    processes = 1
    try:
        while True:
            try:
                counted = await budget_members.beat(database, owner, utcnow(), timedelta(seconds=stale_after))
            except Exception as exc:  # the last share stays; tried again at the next beat
                log.warning("budget_share_failed", error=type(exc).__name__)
            else:
                if counted != processes:
                    log.info("budget_shared", processes=counted)
                    processes = counted
                for budget in limited:
                    budget.share_among(processes)
            await asyncio.sleep(interval)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(LEAVE_SECONDS):
                await budget_members.leave(database, owner)
