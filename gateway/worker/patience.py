"""Outage patience: how long a conversation's turn waits out transient model failures, and when its user
hears about it.

A turn whose model failed transiently (timeout, 429, 5xx, connection: `ModelError.transient`) is tried
again in its own task, which keeps its inbox row's lease (the claim loop's heartbeat renews it), so the
conversation's later messages wait behind it, in order. It gives up (the row is dead) once the row's
outage has lasted `retry_seconds`. After `holding_after_seconds` of outage, the user gets one holding
reply. The later messages wait behind the row, so one outage of a conversation is one waiting row, and
the reply goes out at most once per outage.

The outage is the row's, not the process's: its start and its holding reply are kept on the inbox row
(gateway/store/outages.py). The worker reads them at the row's first failure in this process, so after
a restart, or when another replica takes the row over, the budget counts from the outage's first failure
and no second holding reply goes out. Hence a wall clock (UTC), which processes share, not a monotonic
one. What this object keeps is that state's copy for the rows this process runs, plus their failures.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from gateway.domain.messages import utcnow

__all__ = ["BACKOFF_CAP_SECONDS", "Outage", "Patience"]

BACKOFF_CAP_SECONDS = 30.0  # a recovered provider is used again within this time
BACKOFF_FIRST_SECONDS = 1.0


@dataclass
class Outage:
    """One conversation's run of transient model failures, as this process knows it."""

    started: datetime
    failures: int = 0
    holding_sent: bool = False
    recorded: bool = False  # read from (and written to) the row: else tried again at the next failure


class Patience:
    def __init__(
        self,
        retry_seconds: float,
        holding_after_seconds: float = 0.0,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """`holding_after_seconds` 0: no holding reply."""
        self.retry_seconds = retry_seconds
        self.holding_after_seconds = holding_after_seconds
        self._clock = clock
        self._outages: dict[str, Outage] = {}

    def now(self) -> datetime:
        return self._clock()

    def failed(self, session_id: str) -> Outage:
        """A turn of the conversation failed transiently: its outage, started now if this process knew
        of none (`recorded` then says the row was not read yet)."""
        outage = self._outages.get(session_id)
        if outage is None:
            outage = self._outages[session_id] = Outage(self._clock())
        outage.failures += 1
        return outage

    def recorded(self, outage: Outage, started: datetime, holding_sent: bool) -> None:
        """What the row holds of its outage: it may have begun before, in a process that ran the turn
        earlier, which may have sent the holding reply."""
        outage.started = started
        outage.holding_sent = outage.holding_sent or holding_sent
        outage.recorded = True

    def ended(self, session_id: str) -> None:
        """The worker is done with a row of the conversation here (committed, dead, failed, or handed
        back): forget this process's copy. The row keeps its own until it is done or dead, and the next
        row starts a patience of its own."""
        self._outages.pop(session_id, None)

    def elapsed(self, outage: Outage) -> float:
        return (self._clock() - outage.started).total_seconds()

    def gives_up(self, outage: Outage) -> bool:
        return self.elapsed(outage) >= self.retry_seconds

    def holding_due(self, outage: Outage) -> bool:
        """Whether the holding reply should go out now (then mark it sent with `outage.holding_sent`)."""
        return (
            self.holding_after_seconds > 0
            and not outage.holding_sent
            and self.elapsed(outage) >= self.holding_after_seconds
        )

    def delay(self, outage: Outage) -> float:
        """Seconds before the next try: jittered exponential backoff, capped, within the time left, and
        not past the holding reply's moment."""
        base = min(BACKOFF_CAP_SECONDS, BACKOFF_FIRST_SECONDS * 2.0 ** (outage.failures - 1))
        delay = base * random.uniform(0.5, 1.0)
        until = [self.retry_seconds - self.elapsed(outage)]
        if self.holding_after_seconds > 0 and not outage.holding_sent:
            until.append(self.holding_after_seconds - self.elapsed(outage))
        return max(0.0, min([delay, *until]))

    def __len__(self) -> int:
        return len(self._outages)
