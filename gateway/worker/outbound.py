"""Delivery: claims outbox rows in order per conversation and sends them through the platform's sender.

The platform's message id is stored in the same statement that marks the row sent, so a row is sent at
most once after the platform accepted it (the only window is a crash between the two). Transient
failures back off (honouring the platform's retry-after); permanent ones are recorded with the
platform's code. A platform without a sending token is dry-run: the row is marked `dry_run` and its
text logged, so the whole path can be watched offline.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.platforms.base import DeliveryError, Sender
from gateway.store import queue
from gateway.store.engine import SQLITE_IMMEDIATE
from gateway.store.tables import ChatRow, OutboxRow
from gateway.worker.maintenance import wait_for_wake
from gateway.worker.pacing import Pacer, PacingLimits

log = structlog.get_logger(__name__)

LEASE_SECONDS = 60
MAX_ATTEMPTS = 8
BACKOFF_CAP_SECONDS = 600
IDLE_POLL_SECONDS = 0.5


class OutboxDelivery:
    def __init__(
        self,
        engine: AsyncEngine,
        senders: dict[str, Sender],
        *,
        concurrency: int = 8,
        max_attempts: int = MAX_ATTEMPTS,
        owner: str | None = None,
        pacing: PacingLimits | None = None,
    ) -> None:
        """`pacing`: the platforms' rate limits to stay under (None: send as fast as claimed)."""
        self.engine = engine
        self.senders = senders
        self.pacing = pacing
        self._pacer = Pacer()
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}:out"
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Deliver until cancelled."""
        while True:
            self._wake.clear()
            try:
                delivered = await self.run_until_idle()
            except Exception as exc:  # the database may be briefly away
                log.warning("delivery_round_failed", error=type(exc).__name__)
                delivered = 0
            if not delivered:
                await wait_for_wake(self._wake, IDLE_POLL_SECONDS)

    async def run_until_idle(self) -> int:
        total = 0
        columns = [
            OutboxRow.platform,
            OutboxRow.session_id,
            OutboxRow.kind,
            OutboxRow.text,
            OutboxRow.target_json,
            OutboxRow.attempts,
        ]
        lease = timedelta(seconds=LEASE_SECONDS)
        while rows := await queue.claim(self.engine, OutboxRow, columns, self.owner, lease, self.concurrency):
            await asyncio.gather(*(self.deliver(*row) for row in rows))
            total += len(rows)
        return total

    async def deliver(
        self,
        row_id: int,
        platform: str,
        session_id: str,
        kind: str,
        text: str | None,
        target: dict[str, Any],
        attempts: int,
    ) -> None:
        if not await self._reachable(platform, target):
            log.warning(
                "reply_skipped_unreachable", outbox_id=row_id, platform=platform, session_id=session_id
            )
            await self._finish(
                row_id,
                status="failed",
                error_code="unreachable",
                error_message="the bot was removed or blocked",
            )
            return
        sender = self.senders.get(platform)
        if sender is None:
            log.info(
                "reply_dry_run",
                outbox_id=row_id,
                platform=platform,
                session_id=session_id,
                kind=kind,
                text=text,
            )
            await self._finish(row_id, status="dry_run")
            return
        if self.pacing is not None and kind == "text":
            delay = self._pacer.reserve(self.pacing.limits(platform, target))
            if delay > 0:
                await asyncio.sleep(delay)  # pacing: wait for this chat's next free slot
        try:
            message_id = await sender.send(kind, text, target)
        except DeliveryError as exc:
            await self._failed(row_id, attempts + 1, exc)
            return
        except Exception as exc:  # a bug or an unexpected answer: retried like a transient failure
            await self._failed(
                row_id, attempts + 1, DeliveryError(f"{type(exc).__name__}: {exc}", permanent=False)
            )
            return
        await self._finish(row_id, status="sent", platform_message_id=message_id)
        log.info("reply_sent", outbox_id=row_id, platform=platform, session_id=session_id, kind=kind)

    async def _reachable(self, platform: str, target: dict[str, Any]) -> bool:
        """False once the platform said the bot was removed from (or blocked in) the chat."""
        chat_id = target.get("chat_id")
        if chat_id is None:
            return True
        async with self.engine.connect() as conn:
            reachable = await conn.scalar(
                select(ChatRow.reachable).where(ChatRow.platform == platform, ChatRow.chat_id == str(chat_id))
            )
        return reachable is not False

    async def _finish(self, row_id: int, **values: Any) -> None:
        now = datetime.now(UTC)
        async with self.engine.execution_options(**{SQLITE_IMMEDIATE: True}).begin() as conn:
            await conn.execute(
                update(OutboxRow)
                .where(OutboxRow.id == row_id)
                .values(lease_owner=None, lease_until=None, updated_at=now, **values)
            )

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
