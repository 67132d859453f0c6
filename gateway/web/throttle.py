"""The admin API's throttle of wrong tokens, per client address.

After `max_failures` missing or wrong tokens from one address within `window` seconds, that address is
locked out for `window` seconds: every request from it gets 429 with Retry-After, the right token
included, since a lockout that let the right guess through would not slow guessing. Other addresses
are never affected, so a correct token is never refused for someone else's failures (behind a reverse
proxy this relies on the proxy's X-Forwarded-For, see docs/deploy.md). An IPv6 client counts as its
/64, which anyone holding one address of it holds whole.

The state is bounded: at most `max_clients` addresses are remembered, the least recently failed
forgotten first (a forgotten address starts afresh; per-address counting cannot stop an attacker with
that many addresses anyway). No lock: it runs on the event loop's one thread.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_FAILURES = 10
WINDOW_SECONDS = 60.0
MAX_CLIENTS = 10_000  # about 1 MB at most


@dataclass(slots=True)
class _Record:
    failures: int
    since: float  # the first failure of the current count
    locked_until: float = 0.0


class FailureThrottle:
    def __init__(
        self,
        max_failures: int = MAX_FAILURES,
        window: float = WINDOW_SECONDS,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures, self.window, self.max_clients = max_failures, window, max_clients
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def retry_after(self, client: str) -> float | None:
        """Seconds until `client` may try again, or None when it may now."""
        record = self._records.get(_key(client))
        if record is None:
            return None
        left = record.locked_until - self._clock()
        return left if left > 0 else None

    def failed(self, client: str) -> bool:
        """Count a failure; True when it locks the client out (once per lockout: the moment to log)."""
        key, now = _key(client), self._clock()
        record = self._records.pop(key, None)
        if record is None or now - record.since >= self.window:
            record = _Record(0, now)
        record.failures += 1
        locked = record.failures >= self.max_failures
        if locked:
            record.locked_until = now + self.window
            record.failures, record.since = 0, record.locked_until  # counting starts afresh after it
        self._records[key] = record  # the most recently failed last
        while len(self._records) > self.max_clients:
            self._records.popitem(last=False)
        return locked

    def succeeded(self, client: str) -> None:
        """The right token: the client's failures are forgotten."""
        self._records.pop(_key(client), None)


def _key(client: str) -> str:
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return client  # not an address (a Unix socket, a test client): itself
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return client
