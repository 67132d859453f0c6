"""Send pacing: spaces sends per chat and overall so the platforms' rate limits are never hit.

Each send reserves the next free slot of every limit it falls under (its chat, its group, the
platform as a whole) and waits until the latest of them. Reservations are made in the order sends
are attempted, so a burst is spread out rather than rejected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

FORGET_AFTER_SECONDS = 3600  # a key idle this long has no say in the next slot


class Pacer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next_free: dict[str, float] = {}
        self._last_sweep = clock()

    def reserve(self, limits: Iterable[tuple[str, float]]) -> float:
        """Take a slot under every (key, minimum interval in seconds); return how long to wait for it."""
        limits = [(key, interval) for key, interval in limits if interval > 0]
        now = self._clock()
        start = max([now, *(self._next_free.get(key, now) for key, _ in limits)])
        for key, interval in limits:
            self._next_free[key] = start + interval
        self._sweep(now)
        return start - now

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < FORGET_AFTER_SECONDS:
            return
        self._last_sweep = now
        self._next_free = {k: t for k, t in self._next_free.items() if t > now - FORGET_AFTER_SECONDS}


def interval(per_period: float, period_seconds: float) -> float:
    """`per_period` sends per `period_seconds` as the gap between two sends (0 means unlimited)."""
    return period_seconds / per_period if per_period > 0 else 0.0


class PacingLimits:
    """Which limits a send falls under, as (key, interval) pairs, from the configured rates."""

    def __init__(
        self,
        telegram_chat_per_second: float,
        telegram_group_per_minute: float,
        telegram_global_per_second: float,
        whatsapp_global_per_second: float,
    ) -> None:
        self.telegram_chat = interval(telegram_chat_per_second, 1)
        self.telegram_group = interval(telegram_group_per_minute, 60)
        self.telegram_global = interval(telegram_global_per_second, 1)
        self.whatsapp_global = interval(whatsapp_global_per_second, 1)

    def limits(self, platform: str, target: dict[str, object]) -> list[tuple[str, float]]:
        chat = str(target.get("chat_id") or "")
        if platform == "telegram":
            per_chat = (
                self.telegram_group if chat.startswith("-") else self.telegram_chat
            )  # groups are negative
            return [(f"telegram:chat:{chat}", per_chat), ("telegram:global", self.telegram_global)]
        return [(f"{platform}:global", self.whatsapp_global)]
