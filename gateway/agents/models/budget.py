"""A model provider's budget: calls in flight, requests and tokens per minute, and its 429 pauses.

Every call to one provider (whatever the model or agent) passes through its `ProviderBudget`. When
a budget is full the call waits rather than fails, and waiters are admitted first come, first
served: admission goes through one FIFO lock, so a later call never overtakes an earlier one (and
the conversations, each with at most one turn in flight, keep their order). A 429 pauses the whole
provider until its `Retry-After`, so one refusal slows every call instead of each learning it alone;
a provider that keeps failing opens its breaker (gateway/agents/models/breaker.py).

Requests per minute are spaced evenly (one every 60/RPM s), which stays under the limit whether
the provider counts in a sliding minute or refills a token bucket. Tokens per minute are counted
over a sliding minute: a call reserves an estimate of its input tokens and, once answered, the
tokens the provider says it used replace the estimate.

The limits are the provider account's, shared by every process that runs turns on the database
(`--workers`, replicas, `gateway worker`): each process keeps `1 / processes` of each limit
(`share_among`, kept up to date by gateway/worker/budget_shares.py), and at least one call in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from gateway.agents.models.breaker import Breaker

__all__ = ["DEFAULT_429_PAUSE_SECONDS", "Grant", "ProviderBudget", "estimate_tokens"]

WINDOW_SECONDS = 60.0
DEFAULT_429_PAUSE_SECONDS = 1.0  # a 429 without Retry-After pauses the provider this long
CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English; the provider's count replaces it after the call


def estimate_tokens(text_chars: int) -> int:
    """The tokens a request of this many characters is reserved before the provider counts them."""
    return max(1, text_chars // CHARS_PER_TOKEN)


@dataclass
class Grant:
    """One admitted call: the tokens it reserved (replaced by `ProviderBudget.spend`)."""

    started: float
    tokens: int


class ProviderBudget:
    """The limits of one provider; 0 means unlimited. `clock` and `sleep` are for tests."""

    def __init__(
        self,
        name: str,
        *,
        max_concurrency: int = 0,
        rpm: int = 0,
        tpm: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if min(max_concurrency, rpm, tpm) < 0:
            raise ValueError("budget limits are 0 (unlimited) or more")
        self.name = name
        self.max_concurrency = max_concurrency
        self.rpm = rpm
        self.tpm = tpm
        self._clock = clock
        self._sleep = sleep
        self._admission = asyncio.Lock()  # FIFO: waiters are admitted in arrival order
        self.processes = 1  # the processes sharing the limits (share_among)
        self._held = 0  # calls holding one of the max_concurrency slots
        self._slot_freed = asyncio.Event()
        self._next_request = 0.0  # the earliest start of the next request under the RPM spacing
        self._paused_until = 0.0
        self._tokens: deque[Grant] = deque()  # the calls of the last minute, for the TPM window
        self.in_flight = 0
        self.max_in_flight = 0  # the most calls in flight at once so far (benchmarks, /metrics)
        self.waiting = 0
        self.breaker = Breaker(clock)  # fails calls fast while the provider keeps failing

    def __repr__(self) -> str:
        limits = f"max_concurrency={self.max_concurrency}, rpm={self.rpm}, tpm={self.tpm}"
        return f"ProviderBudget({self.name!r}, {limits}, processes={self.processes})"

    @property
    def limited(self) -> bool:
        """Whether any limit is set (an unlimited budget has nothing to share)."""
        return bool(self.max_concurrency or self.rpm or self.tpm)

    def share_among(self, processes: int) -> None:
        """This process keeps 1 / `processes` of each limit from now on (at least one call in flight)."""
        self.processes = max(1, processes)
        self._slot_freed.set()  # a waiter for a slot looks again: a larger share may have room

    def _concurrency_share(self) -> int:
        return max(1, self.max_concurrency // self.processes)

    @asynccontextmanager
    async def call(self, tokens: int = 1) -> AsyncIterator[Grant]:
        """Wait for room for one call reserving `tokens`, hold it while the call runs."""
        self.waiting += 1
        try:
            async with self._admission:
                probe = self.breaker.admit()  # ProviderDown while it keeps failing
                try:
                    await self._take_slot()
                    try:
                        grant = await self._admit(tokens)
                    except BaseException:
                        self._give_slot()
                        raise
                except BaseException:
                    if probe:
                        self.breaker.probe_ended()
                    raise
        finally:
            self.waiting -= 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield grant
        finally:
            self.in_flight -= 1
            if probe:
                self.breaker.probe_ended()  # no-op once succeeded() or failed() gave the verdict
            self._give_slot()

    def pause(self, seconds: float | None) -> None:
        """The provider answered 429: no call of this provider starts for `seconds` (its Retry-After)."""
        delay = DEFAULT_429_PAUSE_SECONDS if seconds is None else max(0.0, seconds)
        self._paused_until = max(self._paused_until, self._clock() + delay)

    def paused_for(self) -> float:
        """Seconds until calls may start again after a 429 (0 when not paused)."""
        return max(0.0, self._paused_until - self._clock())

    def spend(self, grant: Grant, tokens: int) -> None:
        """The provider counted `tokens` for the call: they replace its estimate in the TPM window."""
        grant.tokens = max(0, tokens)

    async def _take_slot(self) -> None:
        """Wait for one of this process's concurrency slots (only the admission lock's holder waits)."""
        if not self.max_concurrency:
            return
        while self._held >= self._concurrency_share():
            self._slot_freed.clear()
            await self._slot_freed.wait()
        self._held += 1

    def _give_slot(self) -> None:
        if self.max_concurrency:
            self._held -= 1
            self._slot_freed.set()

    async def _admit(self, tokens: int) -> Grant:
        # A sleep of d seconds counts as d seconds passed, whatever the clock says (an injected sleep).
        slept_until = 0.0
        while (delay := self._delay(tokens, now := max(self._clock(), slept_until))) > 0:
            slept_until = now + delay
            await self._sleep(delay)
        now = max(self._clock(), slept_until)
        if self.rpm:
            self._next_request = max(now, self._next_request) + WINDOW_SECONDS * self.processes / self.rpm
        grant = Grant(now, tokens)
        if self.tpm:
            self._tokens.append(grant)
        return grant

    def _delay(self, tokens: int, now: float) -> float:
        """How long from `now` before a call of `tokens` fits every limit (0: at once)."""
        delay = max(0.0, self._paused_until - now, self._next_request - now if self.rpm else 0.0)
        if self.tpm:
            delay = max(delay, self._tokens_delay(now, tokens))
        return delay

    def _tokens_delay(self, now: float, tokens: int) -> float:
        window = self._tokens
        while window and window[0].started <= now - WINDOW_SECONDS:
            window.popleft()
        used = sum(grant.tokens for grant in window)
        share = self.tpm / self.processes
        if not window or used + tokens <= share:
            return 0.0  # a call larger than the whole budget still goes, alone
        # Wait until enough of the oldest calls leave the window.
        for grant in window:
            used -= grant.tokens
            if used + tokens <= share:
                return grant.started + WINDOW_SECONDS - now
        return window[-1].started + WINDOW_SECONDS - now  # pragma: no cover - the loop always returns
