"""Delivery: claims outbox rows in order per conversation and sends them through the platform's sender.

The platform's message id is stored in the same statement that marks the row sent, so a row is sent at
most once after the platform accepted it (the only window is a crash between the two; on an SQLite
file that statement commits with the other writes queued at the same moment, see store/database.py).
Transient failures back off (honouring the platform's retry-after); permanent ones are recorded with
the platform's code. A platform without a sending token is dry-run: the row is marked `dry_run` and
logged (its length, never its text), so the whole path can be watched offline.

Up to `concurrency` rows are in flight at once (worker/claim_loop.py), each recorded as soon as its
platform answered. A conversation's next row becomes claimable only once the row before it is
recorded, so replies leave in order.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import structlog

from gateway.domain.messages import utcnow
from gateway.domain.outbound import OutboundKind, ReplyTarget
from gateway.platforms.base import DeliveryError, Sender
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSpec
from gateway.store import outbox
from gateway.store.database import Database
from gateway.store.outbox import ClaimedReply
from gateway.worker.claim_loop import ClaimLoop
from gateway.worker.pacing import Pacer, PacingLimits

log = structlog.get_logger(__name__)

DEFAULT_CONCURRENCY = 16  # sends in flight at once
LEASE_SECONDS = 60
MAX_ATTEMPTS = 8
BACKOFF_CAP_SECONDS = 600


class OutboxDelivery:
    def __init__(
        self,
        database: Database,
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
        self.database = database
        self.senders = senders
        self.pacing = pacing
        self.target_types = {spec.name: spec.target_type for spec in platforms}
        self._pacer = Pacer()
        self.max_attempts = max_attempts
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}:out"
        self.loop = ClaimLoop(
            "delivery", lambda limit: self.claim(limit), lambda row: self.deliver(row), concurrency
        )
        self._recording: set[asyncio.Task[bool]] = set()
        self._typing: set[asyncio.Task[None]] = set()

    @property
    def concurrency(self) -> int:
        return self.loop.concurrency

    def wake(self) -> None:
        self.loop.wake()

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
        try:
            await self.loop.run()
        finally:
            # What the platforms accepted is recorded before this returns (and the database closes).
            await asyncio.gather(*self._recording, return_exceptions=True)
            for typing in self._typing:
                typing.cancel()
            await asyncio.gather(*self._typing, return_exceptions=True)

    async def run_until_idle(self) -> int:
        """Deliver until no row is claimable; return how many were handled (for tests and one-shot use)."""
        return await self.loop.run_until_idle()

    async def claim(self, limit: int) -> list[ClaimedReply]:
        return await outbox.claim(
            self.database, self.owner, timedelta(seconds=LEASE_SECONDS), limit, self.target_types
        )

    async def deliver(self, row: ClaimedReply) -> None:
        message = row.message
        if message is None:  # a kind this version cannot send: retrying will not help
            error = DeliveryError(f"unknown outbox kind {row.kind!r}", permanent=True)
            await self._failed(row.id, row.attempts + 1, error)
            return
        if not row.reachable:
            log.warning(
                "reply_skipped_unreachable",
                outbox_id=row.id,
                platform=message.platform,
                session_id=message.session_id,
            )
            await self._finish(
                row.id,
                status="failed",
                error_code="unreachable",
                error_message="the bot was removed or blocked",
            )
            return
        sender = self.senders.get(message.platform)
        if sender is None:
            log.info(
                "reply_dry_run",
                outbox_id=row.id,
                platform=message.platform,
                session_id=message.session_id,
                kind=message.kind.value,
                chars=len(message.text or ""),  # never the text itself: `gateway simulate` prints it
            )
            await self._finish(row.id, status="dry_run")
            return
        if self.pacing is not None and message.kind is OutboundKind.TEXT:
            delay = self._pacer.reserve(self.pacing.limits(message.platform, message.target))
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
            "reply_sent",
            outbox_id=row.id,
            platform=message.platform,
            session_id=message.session_id,
            kind=message.kind.value,
        )

    async def _finish(self, row_id: int, **values: Any) -> None:
        # A task of its own, shielded: a send the platform accepted is recorded even when shutdown
        # cancels the delivery, which waits for it (see run).
        recording = asyncio.ensure_future(outbox.finish(self.database, row_id, **values))
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
            "next_attempt_at": utcnow() + timedelta(seconds=delay),
        }
        if final:
            values["status"] = "failed"
        await self._finish(row_id, **values)
        if final:
            log.error("reply_failed", outbox_id=row_id, code=exc.code, attempts=attempts)
        else:
            log.warning(
                "reply_retry", outbox_id=row_id, code=exc.code, attempts=attempts, retry_in_s=round(delay, 1)
            )
