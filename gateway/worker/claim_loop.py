"""The loop shared by the inbox worker and delivery: claim rows as slots free up, process each in a task.

Up to `concurrency` rows are in flight at once, claimed several per claim: while others are busy a
claim waits until a quarter of the slots (at most MAX_CLAIM_ROWS / 2) are free, so one claim (a
transaction, a round trip or two) takes several rows, and it takes at most MAX_CLAIM_ROWS, so the
turns it starts do not hold the event loop for long.
While `busy()` says this process's webhooks wait for their commit (a flood), at most BUSY_CLAIM_ROWS
new rows start every BUSY_CLAIM_DELAY_SECONDS (rows in flight go on): acknowledgements come first,
and a flood's backlog is worked off right after it.

A claim looks where work is known to be: the conversations this process stored rows for (`wake`)
and those whose rows it just finished (the next may be waiting), unless that row's commit handed the
conversation on (`adopt`) or saw nothing of it waiting while nothing was stored here for it since
(`nothing_waiting`). Every IDLE_POLL_SECONDS (every
BUSY_SCAN_SECONDS while hinted claims keep taking rows), and again at once after such a scan found
rows nobody hinted, it looks at every due head instead, which finds the rest: other processes' rows,
retries come due, leases a crashed process left. On PostgreSQL a hinted claim names at most
MAX_HINTS_PER_CLAIM heads, which the planner then finds by primary key (store/queue_heads.py).

Leases are short (a crashed process's rows are taken over within one lease) and a heartbeat renews
those of the rows in flight every third of a lease (with the rows a task took on besides its own, see
`attach`), so a slow model call or a long wait for a pacing slot keeps its row. A row whose lease was
nevertheless lost (the database was away longer than the lease, and another process took the row)
has its task cancelled: its result could not be recorded.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import structlog

from gateway.domain.claims import ClaimHealth

log = structlog.get_logger(__name__)

IDLE_POLL_SECONDS = 0.5  # how often an idle loop looks for rows other processes stored
# How often a loop whose hinted claims keep taking rows looks at every due head: on PostgreSQL that scan
# reads the due index from its oldest entry, and while a snapshot is held open every head version
# written meanwhile is there to step over (29,000 pages a scan after 3 minutes, a tenth of the
# server's time at 2 scans a second); hinted claims name their heads instead.
BUSY_SCAN_SECONDS = 2.0
# A scripted turn costs the event loop ~0.8 ms, so 32 every 0.2 s still took 13% of it during a flood.
BUSY_CLAIM_DELAY_SECONDS = 0.2
BUSY_CLAIM_ROWS = 4
# Rows one claim takes at most. Turns waiting on a model stay in flight for seconds, so thousands may be:
# a claim of 500 started them in one stretch of the event loop (~0.75 ms each) and, a model latency
# later, their answers came back together; webhooks waited behind both (ack p99 140-280 ms instead of
# 30-70, acks/s 0.84-0.88 of the same run's without model traffic; with this bound 36 ms and 0.94-1.11).
MAX_CLAIM_ROWS = 64
HINTS_PER_ROW = 2  # conversations a hinted claim looks at, per row it may take
# Conversations one hinted claim names at most. On PostgreSQL a claim of 64 heads (128 named) was
# planned as a hash join over the whole heads table to update the heads it locked, where a dozen are
# updated by `ctid`; under a held snapshot that table holds every head version written since. Held
# runs of `benchmarks/soak.py --minutes 0` the same hour: 389 to 428 turns/s held (baselines 532 to
# 549) with this bound, 322 to 361 (baselines 450 to 530) without. The SQLite file ignores hints.
MAX_HINTS_PER_CLAIM = 12
DEFAULT_LEASE_SECONDS = 30.0  # how long a crashed process's rows wait before another takes them
HOST_CHARS = 32  # of the host name in an owner id: Kubernetes pod names reach 63, the column holds 64


class HasId(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def session_id(self) -> str: ...


Row = TypeVar("Row", bound=HasId)


def owner_id(role: str, host: str | None = None) -> str:
    """A lease owner id for one loop of this process: host (shortened), pid, a random tag and the role.

    Unique per start (a restarted process never mistakes its predecessor's leases for its own) and at
    most 32 + 1 + 7 + 1 + 6 + 1 + len(role) characters, within the lease_owner column's 64.
    """
    host = (host if host is not None else socket.gethostname())[:HOST_CHARS]
    return f"{host}:{os.getpid()}:{secrets.token_hex(3)}:{role}"


class ClaimLoop(Generic[Row]):
    def __init__(
        self,
        name: str,
        claim: Callable[[int, Sequence[str] | None], Awaitable[list[Row]]],
        process: Callable[[Row], Coroutine[Any, Any, None]],
        concurrency: int,
        *,
        renew: Callable[[list[int]], Awaitable[set[int]]],
        release: Callable[[list[int]], Awaitable[object]],
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        """`claim(limit, sessions)` leases rows for `lease_seconds` (of `sessions` only, or of any
        conversation when None: see gateway/store/leases.py); `renew(ids)` extends the leases of rows in
        flight and answers the ids still held; `release(ids)` hands rows back (shutting down)."""
        self.name = name
        self.claim = claim
        self.process = process
        self.concurrency = concurrency
        self.renew = renew
        self.release = release
        self.lease_seconds = lease_seconds
        self.busy = busy
        self.health = ClaimHealth()
        self._wake = asyncio.Event()
        # Free slots worth a claim while others are busy.
        self._claim_at = max(1, min(concurrency // 4, MAX_CLAIM_ROWS // 2))
        self._in_flight: dict[int, asyncio.Task[None]] = {}
        self._running_sessions: Counter[str] = Counter()  # conversations with a row running here
        self._running: set[asyncio.Task[None]] = set()
        self._attached: dict[asyncio.Task[None], list[int]] = {}
        self._hints: dict[str, None] = {}  # conversations worth a look, in the order they were named
        self._scan_at = 0.0  # the loop's time when a claim looks at every due head again
        self._hints_took_rows = False  # since the last scan
        self._hinted_before_scan: tuple[str, ...] = ()  # the hints when the running scan began
        self._went_on: set[asyncio.Task[None]] = set()  # tasks whose conversation went on (`adopt`)
        self._nothing_waiting: set[asyncio.Task[None]] = set()  # whose commit saw nothing waiting
        self._stored_here: set[str] = set()  # conversations woken while a row of theirs ran here
        self.running = False  # while `run` runs: rows may be adopted

    def wake(self, sessions: Iterable[str] = ()) -> None:
        """New rows were stored in this process for `sessions`: look there now instead of at the next
        poll. Without sessions (an operator's requeue), look everywhere now."""
        named = tuple(sessions)
        if not named:
            self._scan_at = 0.0
        else:
            # A conversation whose row runs here has its head leased to it: a claim looking there reads
            # the head for nothing (on PostgreSQL under a held snapshot, every version the head kept).
            # Its row's end names it again (`_finished`: remembered here, even if that row's commit
            # saw nothing waiting), or hands its next row on.
            running = [session for session in named if session in self._running_sessions]
            self._stored_here.update(running)
            waiting = [session for session in named if session not in self._running_sessions]
            if not waiting:
                return
            self._hints |= dict.fromkeys(waiting)
        self._wake.set()

    async def run(self) -> None:
        """Claim and process rows until cancelled; rows in flight are cancelled with it."""
        running = self._running
        heartbeat = asyncio.create_task(self._heartbeat(), name=f"{self.name}-heartbeat")
        self.running = True
        try:
            while True:
                busy = self.busy()
                if busy:
                    await asyncio.sleep(BUSY_CLAIM_DELAY_SECONDS)
                self._wake.clear()
                free = self.concurrency - len(running)
                if free >= MAX_CLAIM_ROWS + self._claim_at:
                    free = MAX_CLAIM_ROWS  # else all: a rest under _claim_at would wait for slots
                if busy:
                    free = min(free, BUSY_CLAIM_ROWS)
                elif free < self._claim_at and running:
                    await self._idle()  # let a few slots free up: one claim then takes several rows
                    continue
                if free <= 0:
                    await self._idle()
                    continue
                sessions = self._where_to_look(free)
                if sessions == []:
                    await self._idle()
                    continue
                claiming = asyncio.ensure_future(self._claim_safely(free, sessions))
                try:
                    claimed = await asyncio.shield(claiming)
                except asyncio.CancelledError:
                    # Shutting down while a claim ran: it may have leased rows in the database. Hand
                    # them back now, or their conversations wait a whole lease for another process.
                    await self._release(await claiming)
                    raise
                if len(claimed) >= free and sessions:  # the limit, not the work, ended it: again
                    taken = {row.session_id for row in claimed}
                    self._hints = dict.fromkeys(s for s in sessions if s not in taken) | self._hints
                if sessions is None:
                    self._scanned(claimed, free)
                elif claimed:
                    self._hints_took_rows = True
                for row in claimed:
                    self._start(row)
                if not claimed:
                    await self._idle()
        finally:
            self.running = False
            heartbeat.cancel()
            for task in running:
                task.cancel()
            await asyncio.gather(heartbeat, *running, return_exceptions=True)

    def _start(self, row: Row) -> None:
        if row.id in self._in_flight:  # one process must never run a row twice (a reply sent twice)
            log.error(f"{self.name}_row_already_running", row_id=row.id)
            return
        task = asyncio.create_task(self.process(row), name=self.name)
        self._running.add(task)
        self._in_flight[row.id] = task
        self._running_sessions[row.session_id] += 1
        task.add_done_callback(self._running.discard)
        task.add_done_callback(functools.partial(self._finished, row.id, row.session_id))

    def adopt(self, row: Row, after: int) -> None:
        """Run a row the store leased to this loop rather than one it claimed: the commit of row
        `after` handed its conversation on (store/turns.py, store/sent_replies.py). It takes that
        row's slot, and no claim looks at the conversation when that row ends: its next row is this
        one. By row, not by the current task: delivery records a sent row in a task of its own."""
        if (task := self._in_flight.get(after)) is not None:
            self._went_on.add(task)
        self._start(row)

    def nothing_waiting(self, row_id: int) -> None:
        """Row `row_id`'s commit saw no next row of its conversation waiting: when it ends, no claim
        looks there unless rows were stored here for it meanwhile (`wake`). Rows other processes
        store meanwhile are found by the scans; under a held snapshot every look-up of a head walks
        the versions the snapshot keeps, so one for nothing is not free."""
        if (task := self._in_flight.get(row_id)) is not None:
            self._nothing_waiting.add(task)

    async def _release(self, rows: list[Row]) -> None:
        if not rows:
            return
        try:
            await self.release([row.id for row in rows])
        except Exception as exc:  # their leases expire on their own
            log.warning(f"{self.name}_release_failed", error=type(exc).__name__, rows=len(rows))

    def _where_to_look(self, limit: int) -> list[str] | None:
        """None: every due head (at most every poll, or when woken without sessions); else the
        conversations hinted first, at most HINTS_PER_ROW for each row wanted (some may hold no
        due row: leased, or done already) and MAX_HINTS_PER_CLAIM in all (the next claims name the
        rest), [] when there are none."""
        now = asyncio.get_running_loop().time()
        if now >= self._scan_at:
            self._scan_at = now + (BUSY_SCAN_SECONDS if self._hints_took_rows else IDLE_POLL_SECONDS)
            self._hints_took_rows = False
            self._hinted_before_scan = tuple(self._hints)
            return None
        sessions = list(itertools.islice(self._hints, min(limit * HINTS_PER_ROW, MAX_HINTS_PER_CLAIM)))
        for session in sessions:
            del self._hints[session]
        return sessions

    def _scanned(self, claimed: list[Row], limit: int) -> None:
        """After a scan: rows nobody hinted (another process's, a retry come due) mean more may come
        the same way, so the next claim scans again; otherwise the next scan waits a poll."""
        if any(row.session_id not in self._hints for row in claimed):
            self._scan_at = 0.0
        if len(claimed) < limit:
            # The scan took every due head there was; hints named while it ran may be newer than it.
            for session in self._hinted_before_scan:
                self._hints.pop(session, None)

    def _finished(self, row_id: int, session_id: str, task: asyncio.Task[None]) -> None:
        went_on = task in self._went_on
        quiet = task in self._nothing_waiting and session_id not in self._stored_here
        self._went_on.discard(task)
        self._nothing_waiting.discard(task)
        self._running_sessions[session_id] -= 1
        if not self._running_sessions[session_id]:
            del self._running_sessions[session_id]
            self._stored_here.discard(session_id)
        if not went_on and not quiet:
            self._hints[session_id] = None  # its conversation's next row may be waiting
        self._in_flight.pop(row_id, None)
        for attached in self._attached.pop(task, ()):
            self._in_flight.pop(attached, None)
        self._wake.set()

    def attach(self, row_ids: list[int]) -> None:
        """Rows the current task leased besides the one it was started for (a coalesced run): the
        heartbeat renews them with it, and cancels the task if one of them is lost. Outside `run`
        (`run_until_idle`: no heartbeat) there is nothing to do."""
        task = asyncio.current_task()
        if task not in self._running:
            return
        self._attached.setdefault(task, []).extend(row_ids)
        for row_id in row_ids:
            self._in_flight[row_id] = task

    async def renew_now(self, row_id: int) -> bool:
        """Extend one row's lease before an action that must not be repeated (a send after a wait):
        False when the row is no longer ours. A failed renewal (database away) counts as not ours."""
        try:
            held = await self.renew([row_id])
        except Exception as exc:
            self.health.failed(exc)
            log.warning(f"{self.name}_lease_renewal_failed", error=type(exc).__name__)
            return False
        return row_id in held

    async def _heartbeat(self) -> None:
        """Every third of a lease, renew the leases of the rows in flight; cancel the tasks of rows
        found taken over. A failed renewal is retried at the next beat (two more before expiry)."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            ids = list(self._in_flight)
            if not ids:
                continue
            try:
                held = await self.renew(ids)
            except Exception as exc:
                self.health.failed(exc)
                log.warning(f"{self.name}_lease_renewal_failed", error=type(exc).__name__, rows=len(ids))
                continue
            for row_id in ids:
                task = self._in_flight.get(row_id)
                if row_id not in held and task is not None and not task.done():
                    log.warning(f"{self.name}_lease_lost", row_id=row_id)
                    task.cancel()

    async def run_until_idle(self) -> int:
        """Process rows until none is claimable; return how many (for tests and one-shot use)."""
        total = 0
        while claimed := await self.claim(self.concurrency, None):
            await asyncio.gather(*(self.process(row) for row in claimed))
            total += len(claimed)
        return total

    async def _claim_safely(self, limit: int, sessions: list[str] | None) -> list[Row]:
        try:
            claimed = await self.claim(limit, sessions)
        except Exception as exc:  # the database may be briefly away; try again at the next poll
            self.health.failed(exc)
            log.warning(f"{self.name}_claim_failed", error=type(exc).__name__)
            return []
        self.health.succeeded()
        return claimed

    async def _idle(self) -> None:
        """Sleep until woken or IDLE_POLL_SECONDS pass: new work here, or time to poll for others'."""
        try:
            async with asyncio.timeout(IDLE_POLL_SECONDS):
                await self._wake.wait()
        except TimeoutError:
            pass
