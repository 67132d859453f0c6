"""The inbox worker: claims pending messages and runs their agent turns, one conversation at a time.

Rows are claimed in arrival order within a conversation (gateway/store/leases.py), whatever the
number of workers or replicas, while different conversations run in parallel. The turn commits
together with its inbox row (done) and its replies (outbox rows, gateway/store/turns.py); a worker
that dies before that commit leaves the row to be claimed again when its lease expires, and one that
lost its lease commits nothing.

With coalescing on (gateway/worker/coalesce.py), the claimed row is the first of a run: the rows of
its conversation's burst, leased with it, answered by one turn and marked done by its commit. A run
shares its outcome: its rows fail, wait or are handed back together (its first row, the claimed one,
carries the outage and the attempts).

Failures: a transient model failure is tried again within the outage patience (gateway/worker/
patience.py), in the same task and lease; a permanent one (a 4xx such as 400 or 401) makes the row
dead at once; anything else is retried with backoff up to `max_attempts` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog

from gateway.agents import Message, Runner
from gateway.agents.models.base import ModelError
from gateway.domain.inbound import InboundMessage
from gateway.domain.messages import utcnow
from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.domain.text import split_message
from gateway.domain.usage import ModelStats, TurnUsage, turn_usage
from gateway.logs import will_log
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSpec, message_target
from gateway.store import inbox, outages, runs
from gateway.store.database import Database
from gateway.store.inbox import ClaimedMessage, LeaseLostError
from gateway.store.turns import TurnCompletion, TurnReceipt
from gateway.worker.claim_loop import DEFAULT_LEASE_SECONDS, ClaimLoop, owner_id
from gateway.worker.coalesce import Coalescer
from gateway.worker.patience import Outage, Patience

log = structlog.get_logger(__name__)
_logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 2000  # turns in flight: mostly waiting for their model (GATEWAY_MAX_TURNS_IN_FLIGHT)
MAX_ATTEMPTS = 5
BACKOFF_CAP_SECONDS = 300
DEFAULT_MODEL_RETRY_SECONDS = 1800.0
DEFAULT_HOLDING_REPLY = "We're having trouble answering right now. We'll reply as soon as we can."


class InboxWorker:
    def __init__(
        self,
        database: Database,
        runner: Runner,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        max_attempts: int = MAX_ATTEMPTS,
        owner: str | None = None,
        on_committed: Callable[[str], None] = lambda session_id: None,
        busy: Callable[[], bool] = lambda: False,
        before_turn: Callable[[str, ReplyTarget], None] = lambda platform, target: None,
        platforms: Iterable[PlatformSpec[Any]] = PLATFORMS,
        patience: Patience | None = None,
        holding_reply: str = DEFAULT_HOLDING_REPLY,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        coalescer: Coalescer | None = None,
    ) -> None:
        """`on_committed` runs after each committed turn with its session (it wakes the delivery of
        the replies);
        `busy` says whether this process's webhooks are waiting for a commit; `before_turn` gets the
        platform and reply target of each turn about to run (the typing indicator); `platforms`
        build the reply targets; `patience` rules transient model failures (`holding_reply` is sent
        when it says so); `sleep` waits between tries (tests); `coalescer` (None: off) gathers a
        burst of a conversation's messages into one turn."""
        self.database = database
        self.runner = runner
        self.on_committed = on_committed
        self.before_turn = before_turn
        self.reply_targets: ReplyTargets = {spec.name: spec.reply_target for spec in platforms}
        self.lease = timedelta(seconds=lease_seconds)
        self.max_attempts = max_attempts
        self.owner = owner or owner_id("in")
        self.patience = Patience(DEFAULT_MODEL_RETRY_SECONDS) if patience is None else patience
        self.holding_reply = holding_reply
        self.coalescer = coalescer
        self.model_stats = ModelStats()  # the committed turns' model usage, for /metrics
        self._sleep = sleep
        # Through lambdas, so the loop always calls the current methods (tests wrap them).
        self.loop = ClaimLoop(
            "worker",
            lambda limit, sessions: self.claim(limit, sessions),
            lambda row: self.process(row),
            concurrency,
            renew=lambda ids: inbox.renew(self.database, ids, self.owner, self.lease),
            release=lambda ids: inbox.release_many(self.database, ids, self.owner),
            lease_seconds=lease_seconds,
            busy=busy,
        )

    @property
    def concurrency(self) -> int:
        return self.loop.concurrency

    def wake(self, sessions: Iterable[str] = ()) -> None:
        """New pending rows were stored in this process for `sessions`: look there now instead of at
        the next poll (none named: look everywhere)."""
        self.loop.wake(sessions)

    async def run(self) -> None:
        """Claim and process rows until cancelled."""
        log.info("worker_started", owner=self.owner, concurrency=self.concurrency)
        await self.loop.run()

    async def run_until_idle(self) -> int:
        """Process rows until none is claimable; return how many turns ran (for tests and one-shot use)."""
        return await self.loop.run_until_idle()

    async def claim(self, limit: int, sessions: Sequence[str] | None = None) -> list[ClaimedMessage]:
        return await inbox.claim(self.database, self.owner, self.lease, limit, sessions)

    async def process(self, row: ClaimedMessage) -> None:
        """Run the row's turn (with the rows of its burst, when coalescing); after a transient model
        failure, again, until it commits or gives up."""
        with structlog.contextvars.bound_contextvars(inbox_id=row.id, session_id=row.session_id):
            run = [row]
            try:
                if self.coalescer is not None:
                    await self._gather(run, self.coalescer)
                while await self._try(run):
                    pass
            finally:  # done with the row, whatever the outcome: this process's copy of its outage goes
                self.patience.ended(row.session_id)

    async def _gather(self, run: list[ClaimedMessage], coalescer: Coalescer) -> None:
        try:
            await coalescer.gather(self.database, run, self.owner, self.lease, self.loop.attach)
        except asyncio.CancelledError:  # shutting down, or the lease was lost: hand the rows back now
            await asyncio.shield(self._release(run))
            raise

    async def _try(self, run: list[ClaimedMessage]) -> bool:
        """One try of the run's turn: True when it is worth another (after the wait it did). The reply
        answers the newest message of the run (its reply target, its user's details)."""
        row = run[-1]
        message = row.message
        metadata = {
            key: value
            for key in ("platform", "user_id", "user_name", "phone")
            if (value := getattr(message, key))
        }

        usages: list[TurnUsage] = []
        receipt = TurnReceipt()
        until: datetime | None = None

        def commit_with(new_messages: list[Message]) -> TurnCompletion:
            nonlocal usages, until
            reply = new_messages[-1].content or ""
            usages = turn_usage(new_messages)
            replies = _replies(run, reply, self.reply_targets)
            done = tuple(earlier.id for earlier in run[:-1])
            until = self._hand_on_until()
            return TurnCompletion(
                row.id, self.owner, replies, usages, also_done=done, hand_on_until=until, receipt=receipt
            )

        texts = [earlier.text or "" for earlier in run]
        self.before_turn(row.platform, _reply_target(row, self.reply_targets))
        try:
            await self.runner.run_async(
                row.session_id,
                texts[0] if len(texts) == 1 else texts,
                metadata,
                commit_with=commit_with,
                leased=True,
                session_version=run[0].session_version,
            )
        except LeaseLostError:
            log.warning("turn_lease_lost")
        except asyncio.CancelledError:
            # Shutting down: hand the rows back now rather than when their leases expire.
            await asyncio.shield(self._release(run))
            raise
        except ModelError as exc:
            if exc.transient:
                return await self._wait_out(run, exc)
            await self._failed(run, exc, dead=exc.permanent)
        except Exception as exc:
            await self._failed(run, exc)
        else:
            if will_log(_logger, logging.INFO):  # once a turn: a dropped event costs ~6 us to build
                if len(run) > 1:
                    log.info("turn_committed", rows=len(run))
                else:
                    log.info("turn_committed")
            self.model_stats.record(usages)
            self.on_committed(row.session_id)
            if receipt.handed_on_until is not None:
                await self._take_handed_on(row, receipt.handed_on_until)
            elif until is not None:  # asked to hand on, and the commit saw nothing waiting
                self.loop.nothing_waiting(row.id)
        return False

    def _hand_on_until(self) -> datetime | None:
        """Until when the conversation's next row is leased to this worker by the turn's commit, or
        None to let it go: on PostgreSQL, while the loop runs and acks are not waiting (the flood rule
        starts new rows sparingly then). Under load a conversation's next message is usually there;
        taking it this way writes one version of its queue head instead of two (migration 0015)."""
        if self.database.postgres is None or not self.loop.running or self.loop.busy():
            return None
        return utcnow() + self.lease

    async def _take_handed_on(self, row: ClaimedMessage, until: datetime) -> None:
        """Start the row the commit handed on, if it did; shutting down meanwhile, hand it back."""
        taking = asyncio.ensure_future(
            inbox.take_handed_on(self.database, row.session_id, row.id, self.owner, until)
        )
        try:
            handed = await asyncio.shield(taking)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                if (handed := await taking) is not None:
                    await self._release([handed])
            raise
        except Exception as exc:  # its lease expires and a claim takes it then
            log.warning("handed_on_row_not_taken", error=type(exc).__name__)
            return
        if handed is not None:
            self.loop.adopt(handed, after=row.id)

    async def _wait_out(self, run: list[ClaimedMessage], exc: ModelError) -> bool:
        """A transient model failure: send the holding reply if due, wait, and say to try again; or,
        once the outage lasted the patience, give the run up (dead). The outage is the first row's."""
        row = run[0]
        outage = self.patience.failed(row.session_id)
        if not outage.recorded and not await self._record_outage(row, outage):
            log.warning("turn_lease_lost")
            return False
        if self.patience.gives_up(outage):
            await self._failed(run, exc, dead=True)
            return False
        if self.patience.holding_due(outage):
            outage.holding_sent = await self._send_holding_reply(row, run[-1])
        delay = self.patience.delay(outage)
        log.warning(
            "turn_waiting_for_model",
            failures=outage.failures,
            outage_s=round(self.patience.elapsed(outage), 1),
            retry_in_s=round(delay, 1),
            status=exc.status,
            provider=exc.provider,
        )
        try:
            await self._sleep(delay)  # the lease is kept meanwhile: the heartbeat renews rows in flight
        except asyncio.CancelledError:
            await asyncio.shield(self._release(run))  # shutting down: hand the rows back now
            raise
        return True

    async def _record_outage(self, row: ClaimedMessage, outage: Outage) -> bool:
        """The row's first failure here: read its outage from the row, which says whether it began
        earlier (a restart, a takeover), or record it there. False when the row is no longer ours."""
        try:
            recorded = await outages.begin(self.database, row.id, self.owner, outage.started)
        except Exception as exc:  # go on with this process's copy; recorded at the next failure
            log.warning("outage_not_recorded", error=type(exc).__name__)
            return True
        if recorded is None:
            return False
        self.patience.recorded(outage, recorded.started, recorded.holding_queued)
        return True

    async def _send_holding_reply(self, row: ClaimedMessage, newest: ClaimedMessage) -> bool:
        """Queue the holding reply through the outbox, like any reply (to the `newest` message of the
        run), marking it on the row in the same transaction (at most once per outage, whichever process
        runs the turn); False if it could not be."""
        target = _reply_target(newest, self.reply_targets)
        reply = OutboundMessage(row.platform, row.session_id, OutboundKind.TEXT, target, self.holding_reply)
        try:
            queued = await outages.queue_holding_reply(self.database, row.id, self.owner, [reply], utcnow())
        except Exception as exc:  # tried again at the next failure
            log.warning("holding_reply_not_queued", error=type(exc).__name__)
            return False
        if queued:
            log.info("holding_reply_queued")
            self.on_committed(row.session_id)
        else:  # queued before (by whichever process), or the row is not ours any more
            log.info("holding_reply_not_due")
        return True

    async def _release(self, run: list[ClaimedMessage]) -> None:
        try:
            if len(run) == 1:
                await inbox.release(self.database, run[0].id, self.owner)
            else:  # together: handing back one row of a run ends the lease of its conversation's head
                await inbox.release_many(self.database, [row.id for row in run], self.owner)
        except Exception as exc:  # the leases expire on their own
            log.warning("turn_release_failed", error=type(exc).__name__)

    async def _failed(self, run: list[ClaimedMessage], exc: Exception, *, dead: bool = False) -> None:
        """Record the failure on every row of the run: retried later with backoff, or dead (`dead`, or
        out of attempts, counted on the first row)."""
        attempts = run[0].attempts + 1
        error = f"{type(exc).__name__}: {exc}"[:1000]
        dead = dead or attempts >= self.max_attempts
        delay = min(BACKOFF_CAP_SECONDS, 2**attempts) * random.uniform(0.5, 1.0)
        retry_at = utcnow() + timedelta(seconds=delay)
        try:
            if len(run) == 1:
                await inbox.fail(
                    self.database,
                    run[0].id,
                    self.owner,
                    attempts=attempts,
                    error=error,
                    retry_at=retry_at,
                    dead=dead,
                )
            else:
                ids = [row.id for row in run]
                await runs.fail(
                    self.database,
                    ids,
                    self.owner,
                    attempts=attempts,
                    error=error,
                    retry_at=retry_at,
                    dead=dead,
                )
        except Exception as store_error:  # the lease expires and the row is retried anyway
            log.warning("turn_failure_not_recorded", error=type(store_error).__name__)
        if dead:
            log.error("turn_dead_lettered", attempts=attempts, error=type(exc).__name__)
        else:
            log.warning(
                "turn_failed", attempts=attempts, retry_in_s=round(delay, 1), error=type(exc).__name__
            )


# Each platform's builder of reply targets from a message (its spec's `reply_target`).
ReplyTargets = Mapping[str, Callable[[InboundMessage], ReplyTarget]]


def _reply_target(row: ClaimedMessage, builders: ReplyTargets) -> ReplyTarget:
    """Where the reply goes, as the platform reads it from the stored message (chat, topic, recipient,
    what it answers); a platform no spec knows any more gets just the chat and the message."""
    build = builders.get(row.platform)
    return build(row.message) if build is not None else message_target(ReplyTarget, row.message)


def _replies(run: list[ClaimedMessage], reply: str, builders: ReplyTargets) -> list[OutboundMessage]:
    """The reply to the run's newest message, after the answer to each button press among the run (the
    user's spinner stops only when its query is answered)."""
    entries = [
        OutboundMessage(
            row.platform, row.session_id, OutboundKind.ANSWER_CALLBACK, _reply_target(row, builders)
        )
        for row in run
        if row.message.callback_query_id
    ]
    row = run[-1]
    target = _reply_target(row, builders)
    # Platforms cap a message at 4,096 characters: a longer reply goes out as several, in order.
    entries.extend(
        OutboundMessage(row.platform, row.session_id, OutboundKind.TEXT, target, part)
        for part in split_message(reply)
    )
    return entries
