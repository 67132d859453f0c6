"""Housekeeping that runs inside `gateway serve`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gateway.store import dedup
from gateway.store.database import Database

log = structlog.get_logger(__name__)
PURGE_INTERVAL_SECONDS = 3600


async def purge_dedup_keys_periodically(
    database: Database,
    interval: float = PURGE_INTERVAL_SECONDS,
    on_purged: Callable[[int], None] | None = None,
) -> None:
    """Delete expired message keys now and then every `interval` seconds, until cancelled.

    A failed round is logged and retried at the next interval; it never stops the loop.
    """
    while True:
        try:
            purged = await dedup.purge_expired(database)
        except Exception as exc:
            log.warning("dedup_purge_failed", error=type(exc).__name__)
        else:
            if purged:
                log.info("dedup_keys_purged", count=purged)
            if on_purged is not None:
                on_purged(purged)
        await asyncio.sleep(interval)
