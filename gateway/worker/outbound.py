"""Delivery: claims outbox rows in order per conversation and sends them through the platform's sender.

The platform's message id is stored in the same statement that marks the row sent, so a row is sent at
most once after the platform accepted it (the only window is a crash between the two; on an SQLite
file that statement commits with the other writes queued at the same moment, see store/database.py).
Transient failures (network, 5xx, 429, throttling codes) back off, honouring the platform's
retry-after, and are retried for a time budget counted from the first failure (GATEWAY_DELIVERY_RETRY_HOURS,
24 h by default): a platform outage of hours loses nothing. A row still failing after it is `dead`;
a permanent failure (blocked bot, bad request) is `failed` at once. Operators list and retry both
(`gateway outbox`, the admin API, the console). A platform without a sending token is dry-run: the
row is marked `dry_run` and logged (its length, never its text), so the whole path can be watched offline.

Up to `concurrency` rows are in flight at once (worker/claim_loop.py), each recorded as soon as its
platform answered. A conversation's next row becomes claimable only once the row before it is
recorded, so replies leave in order. Every outcome is recorded only while this process still holds
the row's lease; a row that waited for its pacing slot has its lease renewed (and checked) right
before it is sent, so a row is never sent by two processes because one waited past its lease.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog

from gateway.domain.messages import utcnow
from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.logs import will_log
from gateway.platforms.base import DeliveryError, Sender
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSpec
from gateway.store import outbox
from gateway.store.database import Database
from gateway.store.outbox import ClaimedReply
from gateway.store.sent_replies import Recorded, SentReplies
from gateway.worker.claim_loop import DEFAULT_LEASE_SECONDS, ClaimLoop, owner_id
from gateway.worker.pacing import Pacer, PacingLimits

log = structlog.get_logger(__name__)
_logger = logging.getLogger(__name__)

# Sends in flight at once (GATEWAY_MAX_SENDS_IN_FLIGHT), those waiting for their pacing slot included.
# A send waits 0.1-0.3 s for a platform's answer, and a chat's next reply up to a second for its slot
# (Telegram): at 16, sixteen chats with a second reply waiting held up every other chat's replies.
DEFAULT_CONCURRENCY = 256
DEFAULT_RETRY_HOURS = 24.0  # how long transient failures are retried (WhatsApp itself retries 7 days)
BACKOFF_CAP_SECONDS = 600  # the longest wait between two attempts, a platform's retry-after included


class OutboxDelivery:
    def __init__(
        self,
        database: Database,
        senders: dict[str, Sender],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        retry_hours: float = DEFAULT_RETRY_HOURS,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        owner: str | None = None,
        pacing: PacingLimits | None = None,
        platforms: Iterable[PlatformSpec[Any]] = PLATFORMS,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        """`pacing`: the platforms' rate limits to stay under (None: send as fast as claimed);
        `platforms`: their specs, whose target types read the rows' targets; `busy`: while it says
        webhooks flood this process, new sends start sparingly (sends in flight go on), as turns do."""
        self.database = database
        self.senders = senders
        self.pacing = pacing
        self.target_types = {spec.name: spec.target_type for spec in platforms}
        self._pacer = Pacer()
        self.retry_budget = timedelta(hours=retry_hours)
        self.lease = timedelta(seconds=lease_seconds)
        self.owner = owner or owner_id("out")
        self.loop = ClaimLoop(
            "delivery",
            lambda limit, sessions: self.claim(limit, sessions),
            lambda row: self.deliver(row),
            concurrency,
            renew=lambda ids: outbox.renew(self.database, ids, self.owner, self.lease),
            release=lambda ids: outbox.release_many(self.database, ids, self.owner),
            lease_seconds=lease_seconds,
            busy=busy,
        )
        self._sent = SentReplies(database)  # accepted replies, recorded in batches
        self._recording: set[asyncio.Task[bool]] = set()
        self._typing: set[asyncio.Task[None]] = set()

    @property
    def concurrency(self) -> int:
        return self.loop.concurrency

    def wake(self, sessions: Iterable[str] = ()) -> None:
        """Replies were queued in this process for `sessions` (none named: look everywhere)."""
        self.loop.wake(sessions)

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

    async def claim(self, limit: int, sessions: Sequence[str] | None = None) -> list[ClaimedReply]:
        return await outbox.claim(self.database, self.owner, self.lease, limit, self.target_types, sessions)

    async def deliver(self, row: ClaimedReply) -> None:
        message = row.message
        if message is None:  # a kind this version cannot send: retrying will not help
            await self._failed(row, DeliveryError(f"unknown outbox kind {row.kind!r}", permanent=True))
            return
        if not row.reachable:
            log.warning("reply_skipped_unreachable", **_about(row, message))
            await self._finish(
                row,
                status="failed",
                error_code="unreachable",
                error_message="the bot was removed or blocked",
            )
            return
        sender = self.senders.get(message.platform)
        if sender is None:
            # The length, never the text itself: `gateway simulate` prints it.
            log.info("reply_dry_run", **_about(row, message), chars=len(message.text or ""))
            await self._finish(row, status="dry_run")
            return
        if self.pacing is not None and message.kind is OutboundKind.TEXT:
            delay = self._pacer.reserve(self.pacing.limits(message.platform, message.target))
            if delay > 0:
                try:
                    await asyncio.sleep(delay)  # pacing: wait for this chat's next free slot
                except asyncio.CancelledError:  # shutting down: hand the row back now
                    await asyncio.shield(self._release(row))
                    raise
                # The heartbeat kept the lease while we waited, unless the database was away: check
                # (and extend) it before sending, or another process may be sending this row too.
                if not await self.loop.renew_now(row.id):
                    log.warning("reply_lease_lost", outbox_id=row.id, platform=message.platform)
                    return
        try:
            message_id = await sender.send(message)
        except DeliveryError as exc:
            await self._failed(row, exc)
            return
        except Exception as exc:  # a bug or an unexpected answer: retried like a transient failure
            await self._failed(row, DeliveryError(f"{type(exc).__name__}: {exc}", permanent=False))
            return
        await self._finish(row, status="sent", platform_message_id=message_id)
        if will_log(_logger, logging.INFO):  # once a reply: a dropped event still costs ~8 us to build
            log.info("reply_sent", **_about(row, message))

    async def _finish(self, row: ClaimedReply, **values: Any) -> bool:
        """Record an outcome while this process holds the row; False (and logged) when it did not.

        A task of its own, shielded: a send the platform accepted is recorded even when shutdown
        cancels the delivery, which waits for it (see run)."""
        recording = asyncio.ensure_future(self._record(row, values))
        self._recording.add(recording)
        recording.add_done_callback(self._recording.discard)
        recorded = await asyncio.shield(recording)
        if not recorded:
            # Only after the database was away for longer than a lease: another process took the
            # row over and will decide its fate (for a sent row: the documented duplicate window).
            log.warning("reply_outcome_not_recorded", outbox_id=row.id, status=values.get("status"))
        return recorded

    async def _record(self, row: ClaimedReply, values: dict[str, Any]) -> bool:
        """Write the outcome, retrying while the database is away for up to a lease: given up sooner,
        a reply the platform accepted would be sent again by whoever takes the row over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease.total_seconds()
        delay = 0.2
        while True:
            try:
                if values.get("status") in ("sent", "dry_run"):
                    until = self._hand_on_until()
                    recorded = await self._sent.record(
                        row.id, self.owner, values["status"], values.get("platform_message_id"), until
                    )
                    if recorded is Recorded.HANDED_ON and until is not None:
                        await self._take_handed_on(row, until)
                    elif recorded is Recorded.WRITTEN and until is not None:
                        self.loop.nothing_waiting(row.id)  # asked to hand on: nothing was waiting
                    return bool(recorded)
                return await outbox.finish(self.database, row.id, self.owner, **values)
            except Exception as exc:
                if loop.time() + delay > deadline:
                    log.warning("reply_outcome_not_recorded", outbox_id=row.id, error=type(exc).__name__)
                    return False
            await asyncio.sleep(delay)  # backoff while the database is away
            delay = min(delay * 2, 5.0)

    def _hand_on_until(self) -> datetime | None:
        """Until when the conversation's next reply is leased to this delivery by the record of a
        sent one, or None to let it go: on PostgreSQL while the loop runs. A conversation whose
        answers came faster than its replies went out then writes one version of its outbox head per
        reply instead of two, and no claim walks them (migration 0016)."""
        if self.database.postgres is None or not self.loop.running:
            return None
        return utcnow() + self.lease

    async def _take_handed_on(self, row: ClaimedReply, until: datetime) -> None:
        """Send the reply recording `row` handed on, if there is one; stopping meanwhile, hand it back."""
        try:
            handed = await outbox.take_handed_on(
                self.database, row.session_id, row.id, self.owner, until, self.target_types
            )
        except Exception as exc:  # its lease expires and a claim takes it then
            log.warning("handed_on_reply_not_taken", error=type(exc).__name__)
            return
        if handed is None:
            return
        if self.loop.running:
            self.loop.adopt(handed, after=row.id)
        else:
            await self._release(handed)

    async def _release(self, row: ClaimedReply) -> None:
        try:
            await outbox.release(self.database, row.id, self.owner)
        except Exception as exc:  # the lease expires on its own
            log.warning("reply_release_failed", outbox_id=row.id, error=type(exc).__name__)

    async def _failed(self, row: ClaimedReply, exc: DeliveryError) -> None:
        now = utcnow()
        attempts = row.attempts + 1
        retry_until = row.retry_until or now + self.retry_budget
        delay = backoff_seconds(attempts, exc.retry_after)
        next_attempt = now + timedelta(seconds=delay)
        status = "failed" if exc.permanent else "dead" if next_attempt > retry_until else "pending"
        values: dict[str, Any] = {
            "attempts": attempts,
            "error_code": exc.code,
            "error_message": str(exc)[:1000],
            "next_attempt_at": next_attempt,
            "retry_until": retry_until,
            "status": status,
        }
        if not await self._finish(row, **values):
            return
        fields = {"outbox_id": row.id, "code": exc.code, "attempts": attempts}
        if status == "failed":
            log.error("reply_failed", **fields)
        elif status == "dead":
            log.error(
                "reply_dead",
                **fields,
                retried_for_s=round(_seconds_since(retry_until, self.retry_budget, now)),
            )
        else:
            log.warning("reply_retry", **fields, retry_in_s=round(delay, 1))


def _about(row: ClaimedReply, message: OutboundMessage) -> dict[str, Any]:
    """What a reply's events say of it (never its text)."""
    return {
        "outbox_id": row.id,
        "platform": message.platform,
        "session_id": message.session_id,
        "kind": message.kind.value,
    }


def backoff_seconds(attempts: int, retry_after: float | None) -> float:
    """The wait before attempt `attempts + 1`: the platform's retry-after when it gave a usable one,
    else exponential with jitter; at most BACKOFF_CAP_SECONDS either way (a huge or broken retry-after
    must not overflow a datetime nor park a reply for a year)."""
    if retry_after is not None and math.isfinite(retry_after) and retry_after > 0:
        return min(float(retry_after), BACKOFF_CAP_SECONDS)
    return min(BACKOFF_CAP_SECONDS, 2.0 ** min(attempts, 16)) * random.uniform(0.5, 1.0)


def _seconds_since(retry_until: datetime, budget: timedelta, now: datetime) -> float:
    """How long the row has been retried: from its first failure (its budget's start) to now."""
    return (now - (retry_until - budget)).total_seconds()
