"""A provider's circuit breaker: while it keeps failing, calls fail at once instead of adding to its load.

After OPEN_AFTER failures in a row (5xx, timeouts, dropped connections: not 429s, which pause the
provider instead, nor refusals, which prove it answers), the breaker opens: calls raise ProviderDown
without a request, and the turns waiting out the outage (gateway/worker/patience.py) back off. After a
cooldown one call goes through as a probe while the others still fail fast; its success closes the
breaker, its failure opens it again for twice the cooldown, up to MAX_COOLDOWN_SECONDS. Without it, a
2-minute outage with 1,000 waiting turns drew 36,582 calls (each turn's tries, each with the client's
own quick retries).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["MAX_COOLDOWN_SECONDS", "OPEN_AFTER", "Breaker", "ProviderDown"]

OPEN_AFTER = 10  # more than one call's own quick retries
FIRST_COOLDOWN_SECONDS = 1.0
MAX_COOLDOWN_SECONDS = 10.0  # a recovered provider is found within this time


class ProviderDown(Exception):
    """The breaker is open: the call was not made."""

    def __init__(self, retry_in: float) -> None:
        super().__init__(
            f"the provider kept failing; calls are held back ({retry_in:.1f} s to the next probe)"
        )
        self.retry_in = retry_in


class Breaker:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.failures = 0  # in a row
        self._open_until: float | None = None  # None: closed
        self._cooldown = FIRST_COOLDOWN_SECONDS
        self._probing = False

    @property
    def open(self) -> bool:
        return self._open_until is not None

    def admit(self) -> bool:
        """Before a call: True when it is the probe of an open breaker; ProviderDown when it may not go."""
        if self._open_until is None:
            return False
        now = self._clock()
        if self._probing or now < self._open_until:
            raise ProviderDown(max(0.0, self._open_until - now))
        self._probing = True
        return True

    def succeeded(self) -> None:
        """The provider answered (anything but a transient failure): closed."""
        self.failures = 0
        self._open_until = None
        self._cooldown = FIRST_COOLDOWN_SECONDS
        self._probing = False

    def failed(self) -> None:
        """A transient failure (5xx, timeout, connection): open after OPEN_AFTER in a row, or again after
        a failed probe, for a longer cooldown."""
        self.failures += 1
        if self._probing:
            self._probing = False
            self._cooldown = min(MAX_COOLDOWN_SECONDS, self._cooldown * 2)
            self._open_until = self._clock() + self._cooldown
        elif self._open_until is None and self.failures >= OPEN_AFTER:
            self._open_until = self._clock() + self._cooldown

    def probe_ended(self) -> None:
        """The probe's call ended without a verdict (cancelled): the next call may probe."""
        self._probing = False
