"""Delivery: claims outbox rows in order per conversation and sends them through the platform's sender.

The platform's message id is stored in the same statement that marks the row sent, so a row is sent at
most once after the platform accepted it (the only window is a crash between the two; on an SQLite
file that statement commits with the other writes queued at the same moment, see store/queue.py).
Transient failures back off (honouring the platform's retry-after); permanent ones are recorded with
the platform's code. A platform without a sending token is dry-run: the row is marked `dry_run` and
its text logged, so the whole path can be watched offline.

Up to `concurrency` rows are in flight at once: rows are claimed as slots free up, several per claim,
and each is recorded as soon as its platform answered. A conversation's next row becomes claimable
only once the row before it is recorded, so replies leave in order.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.platforms.base import DeliveryError, Sender
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSpec
from gateway.store import queue
from gateway.store.tables import OutboxRow
from gateway.worker.maintenance import wait_for_wake
from gateway.worker.pacing import Pacer, PacingLimits

log = structlog.get_logger(__name__)

DEFAULT_CONCURRENCY = 16  # sends in flight at once
LEASE_SECONDS = 60
MAX_ATTEMPTS = 8
BACKOFF_CAP_SECONDS = 600
IDLE_POLL_SECONDS = 0.5
_COLUMNS = [
    OutboxRow.platform,
    OutboxRow.session_id,
    OutboxRow.kind,
    OutboxRow.text,
    OutboxRow.target_json,
    OutboxRow.attempts,
]


@dataclass(frozen=True)
class ClaimedReply:
    id: int
    platform: str
    session_id: str
    kind: str
    text: str | None
    target: dict[str, Any]
    attempts: int
    reachable: bool = True  # False once the platform said the bot was removed from (or blocked in) the chat


class OutboxDelivery:
    def __init__(
        self,
        engine: AsyncEngine,
        senders: dict[str, Sender],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_attempts: int = MAX_ATTEMPTS,
        owner: str | None = None,
        pacing: PacingLimits | None = None,
        platforms: Iterable[PlatformSpec[Any]] = PLATFORMS,
    ) -> None:
        """`pacing`: the platforms' rate limits to stay under (None: send as fast as claimed);
        `platforms`: their specs, whose target types read the rows' targets."""
        self.engine = engine
        self.senders = senders
        self.pacing = pacing
        self.target_types = {spec.name: spec.target_type for spec in platforms}
        self._pacer = Pacer()
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}:out"
        self._wake = asyncio.Event()
        self._claim_at = max(1, concurrency // 4)  # free slots worth a claim while others are busy
        self._recording: set[asyncio.Task[bool]] = set()
        self._typing: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        self._wake.set()

    def indicate_typing(self, platform: str, target: ReplyTarget) -> None:
        """Start the platform's typing indicator for `target` in the background, where replies are
        sent for real. Best effort and unpaced: it never delays a turn, and the sender logs failures."""
        sender = self.senders.get(platform)
        if sender is None:
            return
        task = asyncio.create_task(sender.indicate_typing(target), name=f"typing-{platform}")
        self._typing.add(task)
        task.add_done_callback(self._typing.discard)

    async def run(self) -> None:
        """Deliver until cancelled."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                free = self.concurrency - len(running)
                if free < self._claim_at and running:
                    # Let a few slots free up: one claim then takes several rows (a claim reads the
                    # backlog, whatever its limit).
                    await wait_for_wake(self._wake, IDLE_POLL_SECONDS)
                    continue
                rows = await self._claim_safely(free)
                for row in rows:
                    task = asyncio.create_task(self.deliver(row), name=f"reply-{row.id}")
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: self._wake.set())
                if not rows:
                    await wait_for_wake(self._wake, IDLE_POLL_SECONDS)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            # What the platforms accepted is recorded before this returns (and the database closes).
            await asyncio.gather(*self._recording, return_exceptions=True)
            for typing in self._typing:
                typing.cancel()
            await asyncio.gather(*self._typing, return_exceptions=True)

    async def run_until_idle(self) -> int:
        """Deliver until no row is claimable; return how many were handled (for tests and one-shot use)."""
        total = 0
        while rows := await self.claim(self.concurrency):
            await asyncio.gather(*(self.deliver(row) for row in rows))
            total += len(rows)
        return total

    async def _claim_safely(self, limit: int) -> list[ClaimedReply]:
        try:
            return await self.claim(limit)
        except Exception as exc:  # the database may be briefly away; try again at the next poll
            log.warning("delivery_claim_failed", error=type(exc).__name__)
            return []

    async def claim(self, limit: int) -> list[ClaimedReply]:
        lease = timedelta(seconds=LEASE_SECONDS)
        claimed, unreachable = await queue.claim_with_chats(
            self.engine, OutboxRow, _COLUMNS, self.owner, lease, limit
        )
        rows = [ClaimedReply(*row) for row in claimed]
        if not unreachable:
            return rows
        return [
            replace(row, reachable=False)
            if (row.platform, str(row.target.get("chat_id"))) in unreachable
            else row
            for row in rows
        ]

    async def deliver(self, row: ClaimedReply) -> None:
        if not row.reachable:
            log.warning(
                "reply_skipped_unreachable",
                outbox_id=row.id,
                platform=row.platform,
                session_id=row.session_id,
            )
            await self._finish(
                row.id,
                status="failed",
                error_code="unreachable",
                error_message="the bot was removed or blocked",
            )
            return
        sender = self.senders.get(row.platform)
        if sender is None:
            log.info(
                "reply_dry_run",
                outbox_id=row.id,
                platform=row.platform,
                session_id=row.session_id,
                kind=row.kind,
                text=row.text,
            )
            await self._finish(row.id, status="dry_run")
            return
        try:
            message = self._message(row)
        except ValueError as exc:  # a kind this version cannot send: retrying will not help
            await self._failed(row.id, row.attempts + 1, DeliveryError(str(exc), permanent=True))
            return
        if self.pacing is not None and message.kind is OutboundKind.TEXT:
            delay = self._pacer.reserve(self.pacing.limits(row.platform, message.target))
            if delay > 0:
                await asyncio.sleep(delay)  # pacing: wait for this chat's next free slot
        try:
            message_id = await sender.send(message)
        except DeliveryError as exc:
            await self._failed(row.id, row.attempts + 1, exc)
            return
        except Exception as exc:  # a bug or an unexpected answer: retried like a transient failure
            await self._failed(
                row.id, row.attempts + 1, DeliveryError(f"{type(exc).__name__}: {exc}", permanent=False)
            )
            return
        await self._finish(row.id, status="sent", platform_message_id=message_id)
        log.info(
            "reply_sent", outbox_id=row.id, platform=row.platform, session_id=row.session_id, kind=row.kind
        )

    def _message(self, row: ClaimedReply) -> OutboundMessage:
        """The row as its platform's typed message (its target read by the platform's target type)."""
        target = self.target_types.get(row.platform, ReplyTarget).from_json(row.target)
        return OutboundMessage(row.platform, row.session_id, OutboundKind(row.kind), target, row.text)

    async def _finish(self, row_id: int, **values: Any) -> None:
        values.update(lease_owner=None, lease_until=None, updated_at=datetime.now(UTC))
        # A task of its own, shielded: a send the platform accepted is recorded even when shutdown
        # cancels the delivery, which waits for it (see run).
        recording = asyncio.ensure_future(queue.update_row(self.engine, OutboxRow, row_id, values))
        self._recording.add(recording)
        recording.add_done_callback(self._recording.discard)
        await asyncio.shield(recording)

    async def _failed(self, row_id: int, attempts: int, exc: DeliveryError) -> None:
        final = exc.permanent or attempts >= self.max_attempts
        delay = exc.retry_after or min(BACKOFF_CAP_SECONDS, 2**attempts) * random.uniform(0.5, 1.0)
        values: dict[str, Any] = {
            "attempts": attempts,
            "error_code": exc.code,
            "error_message": str(exc)[:1000],
            "next_attempt_at": datetime.now(UTC) + timedelta(seconds=delay),
        }
        if final:
            values["status"] = "failed"
        await self._finish(row_id, **values)
        if final:
            log.error("reply_failed", outbox_id=row_id, code=exc.code, attempts=attempts, error=str(exc))
        else:
            log.warning(
                "reply_retry", outbox_id=row_id, code=exc.code, attempts=attempts, retry_in_s=round(delay, 1)
            )
