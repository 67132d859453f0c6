"""Coalescing: a burst of messages from one user (a question split over several) becomes one turn.

Why: on WhatsApp and Telegram people often send "hi", "my order 1001", "where is it?" a second apart.
Answered one by one, each gets a reply of its own, the first ones to half a question. With a window
(GATEWAY_COALESCE_MS, off by default), the worker that claimed a conversation's oldest pending message
also takes the pending messages behind it whose arrival times chain within the window of each other
(gateway/store/runs.py), and waits, holding their leases (the claim loop's heartbeat renews them all),
until the window has passed since the newest of them, taking those that arrive meanwhile. One turn then
answers them all, and its commit marks every one done.

Bounds, so a chatty user is still answered: the wait ends at most MAX_WAIT_WINDOWS windows after the
first message arrived, and a run holds at most MAX_RUN_ROWS messages and MAX_RUN_CHARS characters (the
first message always). A backlog is not waited for: messages that arrived longer than a window ago are
taken at once if they chain. Arrival is the inbox row's `received_at`, stamped by the process that
acknowledged the webhook: replicas' clocks must agree to well within the window.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import structlog

from gateway.domain.messages import utcnow
from gateway.store import runs
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage

log = structlog.get_logger(__name__)

MAX_WAIT_WINDOWS = 10  # the longest wait for a burst to end, in windows from its first message
MAX_RUN_ROWS = 20
MAX_RUN_CHARS = 16_000  # about four of the platforms' longest messages


class Coalescer:
    def __init__(
        self,
        window_ms: float,
        *,
        max_rows: int = MAX_RUN_ROWS,
        max_chars: int = MAX_RUN_CHARS,
        clock: Callable[[], datetime] = utcnow,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`clock` and `sleep` are the wall clock and the wait (tests move both)."""
        if window_ms <= 0:
            raise ValueError("the coalescing window must be positive (0 turns coalescing off)")
        self.window = timedelta(milliseconds=window_ms)
        self.max_wait = self.window * MAX_WAIT_WINDOWS
        self.max_rows = max_rows
        self.max_chars = max_chars
        self._clock = clock
        self._sleep = sleep

    async def gather(
        self,
        db: Database,
        run: list[ClaimedMessage],
        owner: str,
        lease: timedelta,
        attach: Callable[[list[int]], None],
    ) -> None:
        """Extend `run` (the claimed head row alone) with the rows of its burst, in order, leased to
        `owner`; `attach` hands each new row's id to the heartbeat. `run` holds what was taken so far if
        this is cancelled (its rows are then to be handed back). A database error ends the gathering:
        the turn answers what was taken."""
        head = run[0]
        try:
            found = await runs.pending_from(db, head.session_id, head.id, self.max_rows + 1)
            if not found or found[0].message.id != head.id:
                return  # the head is not pending any more: its turn's commit will say so
            deadline = found[0].received_at + self.max_wait
            newest = found[0].received_at
            chars = len(head.text or "")
            candidates = found[1:]
            while True:
                chosen, closed = self._chain(candidates, newest, len(run), chars)
                if chosen:
                    ids = [pending.message.id for pending in chosen]
                    if await runs.take_over(db, head.id, ids, owner, lease) != set(ids):
                        log.warning("coalesce_rows_lost", rows=len(ids))
                        return  # the head is not ours any more: this turn's commit will find out
                    attach(ids)
                    run.extend(pending.message for pending in chosen)
                    newest = chosen[-1].received_at
                    chars += sum(len(pending.message.text or "") for pending in chosen)
                if closed:
                    return
                wait = (min(newest + self.window, deadline) - self._clock()).total_seconds()
                if wait <= 0:
                    return
                await self._sleep(wait)
                candidates = await runs.pending_from(db, head.session_id, run[-1].id + 1, self.max_rows)
        except Exception as exc:
            log.warning("coalesce_failed", error=type(exc).__name__, rows=len(run))

    def _chain(
        self, candidates: list[runs.Pending], newest: datetime, rows: int, chars: int
    ) -> tuple[list[runs.Pending], bool]:
        """The candidates that join the run, in order, and whether the run is closed: a message came
        more than a window after the one before it, or the run is full."""
        chosen: list[runs.Pending] = []
        for pending in candidates:
            if pending.received_at - newest > self.window:
                return chosen, True
            size = len(pending.message.text or "")
            if rows + len(chosen) >= self.max_rows or chars + size > self.max_chars:
                return chosen, True
            chosen.append(pending)
            newest = pending.received_at
            chars += size
        return chosen, rows + len(chosen) >= self.max_rows
