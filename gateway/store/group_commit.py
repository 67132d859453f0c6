"""Group commit: what many tasks submit while earlier commits run is committed together, in one go.

One transaction per webhook or per turn caps a database near a thousand writes per second (each commit
is a round trip through the driver); batched, the same writes go a hundred times faster. `GroupCommit`
is the one batcher of the gateway: it knows nothing of SQL. It collects submissions, hands each batch
to its `commit` function (chosen by `Database` for its backend) and answers every submitter from the
batch's outcomes, one outcome per submission. Nobody is answered before their batch committed.

Up to `in_flight` batches are handed over at once: on an SQLite file the writer thread then goes
from one to the next without waiting for the event loop between them.

When a batch fails as a whole with an error that `isolate` says is about one submission's values (the
database refused a value), its submissions are committed again one at a time: only the offender gets
the error, the others their own outcomes. Other errors (the database is away) fail the whole batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
# A submission's outcome: (True, its result) or (False, the exception it gets).
Outcome = tuple[bool, Any]
Done = Callable[[list[Outcome] | None, BaseException | None], None]
# Starts committing a batch and calls `done` on the event loop when it is over: an outcome per item,
# or an exception for the whole batch.
Commit = Callable[[list[Item], Done], None]


@dataclass(slots=True)
class _Submission(Generic[Item]):
    item: Item
    future: asyncio.Future[Any]


class GroupCommit(Generic[Item]):
    """Batches submissions; `submit(item)` resolves once the batch holding it committed."""

    def __init__(
        self,
        commit: Commit[Item],
        *,
        in_flight: int,
        max_batch: int,
        isolate: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self._commit = commit
        self._in_flight_limit = in_flight
        self._max_batch = max_batch
        self._isolate = isolate
        self._queue: list[_Submission[Item]] = []
        self._alone: list[_Submission[Item]] = []  # of a failed batch: committed one at a time
        self._in_flight = 0
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.waiting = 0  # submissions not answered yet (queued or committing)
        self._idle: asyncio.Event | None = None

    async def submit(self, item: Item) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (asyncio.run once per call): start afresh
            self._loop, self._queue, self._in_flight, self._scheduled, self._idle = loop, [], 0, False, None
            self._alone = []
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append(_Submission(item, future))
        self.waiting += 1
        self._schedule()
        try:
            return await future
        finally:
            self.waiting -= 1
            if self.waiting == 0 and self._idle is not None:
                self._idle.set()

    async def drain(self) -> None:
        """Wait until everything submitted so far has been answered."""
        if self.waiting:
            self._idle = asyncio.Event()
            await self._idle.wait()

    def _schedule(self) -> None:
        """Start a batch at the loop's next turn (what ready tasks submit meanwhile joins it), if one may."""
        ready = self._queue or self._alone
        if ready and not self._scheduled and self._in_flight < self._in_flight_limit and self._loop:
            self._scheduled = True
            self._loop.call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        self._alone = [s for s in self._alone if not s.future.done()]
        if self._alone:
            batch = [self._alone.pop(0)]
        else:
            pending = [s for s in self._queue if not s.future.done()]  # a cancelled caller's item never runs
            batch, self._queue = pending[: self._max_batch], pending[self._max_batch :]
        if not batch:
            return
        self._in_flight += 1
        try:
            self._commit([s.item for s in batch], lambda outcomes, exc: self._finished(batch, outcomes, exc))
        except (
            Exception
        ) as exc:  # e.g. the writer thread is closed: fail the callers, never leave them waiting
            self._finished(batch, None, exc)
            return
        self._schedule()

    def _finished(
        self, batch: list[_Submission[Item]], outcomes: list[Outcome] | None, exc: BaseException | None
    ) -> None:
        self._in_flight -= 1
        if exc is not None and len(batch) > 1 and self._isolate(exc):
            self._alone.extend(batch)
            self._schedule()
            return
        for index, submission in enumerate(batch):
            future = submission.future
            if future.done():
                continue
            if exc is not None:
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
                continue
            assert outcomes is not None
            ok, value = outcomes[index]
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        self._schedule()
