"""Outage patience: how long a conversation's turn waits out transient model failures, and when its user
hears about it.

A turn whose model failed transiently (timeout, 429, 5xx, connection: `ModelError.transient`) is tried
again in its own task, which keeps its inbox row's lease (the claim loop's heartbeat renews it), so the
conversation's later messages wait behind it, in order. It gives up (the row is dead) once the
conversation's outage has lasted `retry_seconds`. After `holding_after_seconds` of outage, the user gets
one holding reply; an outage of a conversation ends when the worker is done with the waiting row
(committed, or dead), and later messages waited behind that row, so the reply goes out at most once
per outage. Outages are known to this process
only: after a restart the count starts again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BACKOFF_CAP_SECONDS", "Outage", "Patience"]

BACKOFF_CAP_SECONDS = 30.0  # a recovered provider is used again within this time
BACKOFF_FIRST_SECONDS = 1.0


@dataclass
class Outage:
    """One conversation's run of transient model failures."""

    started: float
    failures: int = 0
    holding_sent: bool = False


class Patience:
    def __init__(
        self,
        retry_seconds: float,
        holding_after_seconds: float = 0.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`holding_after_seconds` 0: no holding reply."""
        self.retry_seconds = retry_seconds
        self.holding_after_seconds = holding_after_seconds
        self._clock = clock
        self._outages: dict[str, Outage] = {}

    def failed(self, session_id: str) -> Outage:
        """A turn of the conversation failed transiently: its outage, started now if it was not on."""
        outage = self._outages.get(session_id)
        if outage is None:
            outage = self._outages[session_id] = Outage(self._clock())
        outage.failures += 1
        return outage

    def ended(self, session_id: str) -> None:
        """The worker is done with a row of the conversation (committed, dead, or another's now): its
        outage, if any, is over; the next message starts a patience of its own."""
        self._outages.pop(session_id, None)

    def elapsed(self, outage: Outage) -> float:
        return self._clock() - outage.started

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
