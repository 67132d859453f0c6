"""How a claim loop fares: what /readyz and /metrics report of the inbox worker and of delivery.

Standard library only: the worker records it, the web reads it (neither imports the other).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

FAILING_AFTER = 3  # consecutive failed claims (or renewals) that make a loop "failing"


@dataclass
class ClaimHealth:
    """How this loop's claims fare, for /readyz and /metrics: a claim that keeps failing (database
    away, a schema or owner id it refuses) stops every turn or delivery of this process."""

    failures: int = 0  # claims (and lease renewals) that failed, since start
    consecutive_failures: int = 0
    last_error: str | None = None
    failing_since: float | None = None  # time.monotonic() of the first of the current failures

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.last_error = type(error).__name__
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self.failing_since = None

    @property
    def failing(self) -> bool:
        return self.consecutive_failures >= FAILING_AFTER

    def failing_for(self) -> float:
        """Seconds since the current run of failures began (0 when there is none)."""
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since
