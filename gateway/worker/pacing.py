"""Send pacing: spaces sends per chat and overall so the platforms' rate limits are never hit.

Each send reserves the next free slot of every limit it falls under (its chat, its group, the
platform as a whole: its platform's pacing rule says which) and waits until the latest of them.
Reservations are made in the order sends are attempted, so a burst is spread out rather than rejected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from gateway.domain.outbound import ReplyTarget
from gateway.platforms.spec import Limit, PacingRule, interval

__all__ = ["FORGET_AFTER_SECONDS", "Pacer", "PacingLimits", "interval"]

FORGET_AFTER_SECONDS = 3600  # a key idle this long has no say in the next slot


class Pacer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next_free: dict[str, float] = {}
        self._last_sweep = clock()

    def reserve(self, limits: Iterable[tuple[str, float]]) -> float:
        """Take a slot under every (key, minimum interval in seconds); return how long to wait for it."""
        limits = [(key, gap) for key, gap in limits if gap > 0]
        now = self._clock()
        start = max([now, *(self._next_free.get(key, now) for key, _ in limits)])
        for key, gap in limits:
            self._next_free[key] = start + gap
        self._sweep(now)
        return start - now

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < FORGET_AFTER_SECONDS:
            return
        self._last_sweep = now
        self._next_free = {k: t for k, t in self._next_free.items() if t > now - FORGET_AFTER_SECONDS}


class PacingLimits:
    """Which limits a send falls under, as (key, interval) pairs: each platform's rule (from its spec
    and settings) says, for the target; a platform without one is not paced."""

    def __init__(self, rules: Mapping[str, PacingRule]) -> None:
        self._rules = dict(rules)

    def limits(self, platform: str, target: ReplyTarget) -> list[Limit]:
        rule = self._rules.get(platform)
        return [] if rule is None else rule(target)
