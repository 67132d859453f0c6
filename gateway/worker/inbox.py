"""The inbox worker: claims pending messages and runs their agent turns, one conversation at a time.

Rows are claimed through store/queue.py: in arrival order within a conversation, whatever the number
of workers or replicas, while different conversations run in parallel. The turn commits together with
its inbox row (done) and its replies (outbox rows); a worker that dies before that commit leaves the
row to be claimed again when its lease expires, and one that lost its lease commits nothing.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.agents import Message, Runner
from gateway.domain.outbound import ReplyTarget
from gateway.domain.text import split_message
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSpec, message_target
from gateway.store import queue
from gateway.store.tables import InboxRow
from gateway.store.turns import InboxCompletion, LeaseLostError, OutboxEntry
from gateway.worker.maintenance import wait_for_wake

log = structlog.get_logger(__name__)

DEFAULT_CONCURRENCY = 32
LEASE_SECONDS = 300  # longer than any turn should take; a dead worker's rows wait this long
MAX_ATTEMPTS = 5
IDLE_POLL_SECONDS = 0.5  # how often an idle worker looks for rows other processes stored
BACKOFF_CAP_SECONDS = 300
# While webhooks wait for their commit, at most BUSY_CLAIM_ROWS new turns start every
# BUSY_CLAIM_DELAY_SECONDS (turns in flight go on): acknowledgements come first, and a flood's
# backlog is worked off right after it. A scripted turn costs the event loop ~0.8 ms, so 32 every
# 0.2 s still took 13% of it during a flood.
BUSY_CLAIM_DELAY_SECONDS = 0.2
BUSY_CLAIM_ROWS = 4


@dataclass(frozen=True)
class ClaimedRow:
    id: int
    platform: str
    session_id: str
    text: str | None
    message: dict[str, Any]
    attempts: int


class InboxWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        runner: Runner,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        lease_seconds: float = LEASE_SECONDS,
        max_attempts: int = MAX_ATTEMPTS,
        owner: str | None = None,
        on_committed: Callable[[], None] = lambda: None,
        busy: Callable[[], bool] = lambda: False,
        before_turn: Callable[[str, ReplyTarget], None] = lambda platform, target: None,
        platforms: Iterable[PlatformSpec[Any]] = PLATFORMS,
    ) -> None:
        """`on_committed` runs after each committed turn (it wakes the delivery of the replies);
        `busy` says whether this process's webhooks are waiting for a commit; `before_turn` gets the
        platform and reply target of each turn about to run (the typing indicator); `platforms`
        build the reply targets."""
        self.engine = engine
        self.runner = runner
        self.on_committed = on_committed
        self.busy = busy
        self.before_turn = before_turn
        self.reply_targets: ReplyTargets = {spec.name: spec.reply_target for spec in platforms}
        self.concurrency = concurrency
        self.lease = timedelta(seconds=lease_seconds)
        self.max_attempts = max_attempts
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._wake = asyncio.Event()
        self._claim_at = max(1, concurrency // 4)  # free slots worth a claim while others are busy
        self._postgres = engine.dialect.name == "postgresql"

    def wake(self) -> None:
        """New pending rows were stored in this process: look now instead of at the next poll."""
        self._wake.set()

    async def run(self) -> None:
        """Claim and process rows until cancelled."""
        running: set[asyncio.Task[None]] = set()
        log.info("worker_started", owner=self.owner, concurrency=self.concurrency)
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
                    # Let a few slots free up: one claim then takes several rows (a claim reads the
                    # backlog, whatever its limit).
                    await wait_for_wake(self._wake, IDLE_POLL_SECONDS)
                    continue
                if free <= 0:
                    await wait_for_wake(self._wake, IDLE_POLL_SECONDS)
                    continue
                claimed = await self._claim_safely(free)
                for row in claimed:
                    task = asyncio.create_task(self.process(row), name=f"turn-{row.id}")
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: self._wake.set())
                if not claimed:
                    await wait_for_wake(self._wake, IDLE_POLL_SECONDS)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def run_until_idle(self) -> int:
        """Process rows until none is claimable; return how many turns ran (for tests and one-shot use)."""
        total = 0
        while claimed := await self.claim(self.concurrency):
            await asyncio.gather(*(self.process(row) for row in claimed))
            total += len(claimed)
        return total

    async def _claim_safely(self, limit: int) -> list[ClaimedRow]:
        try:
            return await self.claim(limit)
        except Exception as exc:  # the database may be briefly away; try again at the next poll
            log.warning("worker_claim_failed", error=type(exc).__name__)
            return []

    async def claim(self, limit: int) -> list[ClaimedRow]:
        columns = [
            InboxRow.platform,
            InboxRow.session_id,
            InboxRow.text,
            InboxRow.message_json,
            InboxRow.attempts,
        ]
        rows = await queue.claim(self.engine, InboxRow, columns, self.owner, self.lease, limit)
        return [ClaimedRow(*row) for row in rows]

    async def process(self, row: ClaimedRow) -> None:
        message = row.message
        metadata = {
            key: message[key] for key in ("platform", "user_id", "user_name", "phone") if message.get(key)
        }

        def commit_with(new_messages: list[Message]) -> InboxCompletion:
            reply = new_messages[-1].content or ""
            return InboxCompletion(row.id, self.owner, _replies(row, reply, self.reply_targets))

        with structlog.contextvars.bound_contextvars(inbox_id=row.id, session_id=row.session_id):
            self.before_turn(row.platform, _reply_target(row, self.reply_targets))
            try:
                await self.runner.run_async(row.session_id, row.text or "", metadata, commit_with=commit_with)
            except LeaseLostError:
                log.warning("turn_lease_lost")
            except asyncio.CancelledError:
                # Shutting down: hand the row back now rather than when its lease expires.
                await asyncio.shield(self._release(row))
                raise
            except Exception as exc:
                await self._failed(row, exc)
            else:
                log.info("turn_committed")
                self.on_committed()

    async def _release(self, row: ClaimedRow) -> None:
        try:
            await queue.update_row(
                self.engine,
                InboxRow,
                row.id,
                {"lease_owner": None, "lease_until": None},
                lease_owner=self.owner,
                status="pending",
            )
        except Exception as exc:  # the lease expires on its own
            log.warning("turn_release_failed", error=type(exc).__name__)

    async def _failed(self, row: ClaimedRow, exc: Exception) -> None:
        attempts = row.attempts + 1
        error = f"{type(exc).__name__}: {exc}"[:1000]
        now = datetime.now(UTC)
        dead = attempts >= self.max_attempts
        delay = min(BACKOFF_CAP_SECONDS, 2**attempts) * random.uniform(0.5, 1.0)
        values: dict[str, Any] = {
            "attempts": attempts,
            "last_error": error,
            "lease_owner": None,
            "lease_until": None,
            "next_attempt_at": now + timedelta(seconds=delay),
        }
        if dead:
            values.update(status="dead", finished_at=now)
        try:
            await queue.update_row(self.engine, InboxRow, row.id, values, lease_owner=self.owner)
        except Exception as store_error:  # the lease expires and the row is retried anyway
            log.warning("turn_failure_not_recorded", error=type(store_error).__name__)
        if dead:
            log.error("turn_dead_lettered", attempts=attempts, error=error)
        else:
            log.warning("turn_failed", attempts=attempts, retry_in_s=round(delay, 1), error=error)


# Each platform's builder of reply targets from a stored message (its spec's `reply_target`).
ReplyTargets = Mapping[str, Callable[[Mapping[str, Any]], ReplyTarget]]


def _reply_target(row: ClaimedRow, builders: ReplyTargets) -> ReplyTarget:
    """Where the reply goes, as the platform reads it from the stored message (chat, topic, recipient,
    what it answers); a platform no spec knows any more gets just the chat and the message."""
    build = builders.get(row.platform)
    return build(row.message) if build is not None else message_target(ReplyTarget, row.message)


def _replies(row: ClaimedRow, reply: str, builders: ReplyTargets) -> list[OutboxEntry]:
    message = row.message
    target = _reply_target(row, builders).to_json()
    entries = []
    if message.get("callback_query_id"):  # the user's spinner stops only when the query is answered
        entries.append(
            OutboxEntry(
                row.platform, row.session_id, "answer_callback", None, {"id": message["callback_query_id"]}
            )
        )
    # Platforms cap a message at 4,096 characters: a longer reply goes out as several, in order.
    entries.extend(
        OutboxEntry(row.platform, row.session_id, "text", part, target) for part in split_message(reply)
    )
    return entries
