"""The loop shared by the inbox worker and delivery: claim rows as slots free up, process each in a task.

Up to `concurrency` rows are in flight at once, claimed several per claim: while others are busy a
claim waits until a quarter of the slots are free, since a claim reads the backlog whatever its limit.
While `busy()` says this process's webhooks wait for their commit (a flood), at most BUSY_CLAIM_ROWS
new rows start every BUSY_CLAIM_DELAY_SECONDS (rows in flight go on): acknowledgements come first,
and a flood's backlog is worked off right after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

Row = TypeVar("Row")
IDLE_POLL_SECONDS = 0.5  # how often an idle loop looks for rows other processes stored
# A scripted turn costs the event loop ~0.8 ms, so 32 every 0.2 s still took 13% of it during a flood.
BUSY_CLAIM_DELAY_SECONDS = 0.2
BUSY_CLAIM_ROWS = 4


class ClaimLoop(Generic[Row]):
    def __init__(
        self,
        name: str,
        claim: Callable[[int], Awaitable[list[Row]]],
        process: Callable[[Row], Coroutine[Any, Any, None]],
        concurrency: int,
        *,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.name = name
        self.claim = claim
        self.process = process
        self.concurrency = concurrency
        self.busy = busy
        self._wake = asyncio.Event()
        self._claim_at = max(1, concurrency // 4)  # free slots worth a claim while others are busy

    def wake(self) -> None:
        """New rows were stored in this process: look now instead of at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        """Claim and process rows until cancelled; rows in flight are cancelled with it."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                busy = self.busy()
                if busy:
                    await asyncio.sleep(BUSY_CLAIM_DELAY_SECONDS)
                self._wake.clear()
                free = self.concurrency - len(running)
                if busy:
                    free = min(free, BUSY_CLAIM_ROWS)
                elif free < self._claim_at and running:
                    await self._idle()  # let a few slots free up: one claim then takes several rows
                    continue
                if free <= 0:
                    await self._idle()
                    continue
                claimed = await self._claim_safely(free)
                for row in claimed:
                    task = asyncio.create_task(self.process(row), name=self.name)
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: self._wake.set())
                if not claimed:
                    await self._idle()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def run_until_idle(self) -> int:
        """Process rows until none is claimable; return how many (for tests and one-shot use)."""
        total = 0
        while claimed := await self.claim(self.concurrency):
            await asyncio.gather(*(self.process(row) for row in claimed))
            total += len(claimed)
        return total

    async def _claim_safely(self, limit: int) -> list[Row]:
        try:
            return await self.claim(limit)
        except Exception as exc:  # the database may be briefly away; try again at the next poll
            log.warning(f"{self.name}_claim_failed", error=type(exc).__name__)
            return []

    async def _idle(self) -> None:
        """Sleep until woken or IDLE_POLL_SECONDS pass: new work here, or time to poll for others'."""
        try:
            async with asyncio.timeout(IDLE_POLL_SECONDS):
                await self._wake.wait()
        except TimeoutError:
            pass
