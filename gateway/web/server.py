"""uvicorn, with what it lacks against clients the gateway does not control.

uvicorn 0.54's httptools protocol has a keep-alive timeout, and nothing else on a connection's clock or
size: a client that never finishes its request head, or sends its body a byte a second, holds its
connection (and file) for ever; a head is buffered however long it grows (h11's
`h11_max_incomplete_event_size` does not apply to httptools, the protocol uvicorn picks here); and
`limit_concurrency` answers 503 to requests, not to connections, so idle sockets that send nothing
still take every file the process may open. `GatewayHttpProtocol` adds, to the same protocol:

- a deadline on each request head (from the connection, or from the request's first byte on a
  keep-alive connection, to the end of its headers): 408 and closed, or closed silently when nothing
  was asked;
- a cap on a request head's size: 431 and closed;
- a deadline on each request body (from the end of the head): the app is told (see
  `gateway.web.bodies`), answers 408 and the connection closes; a body still arriving after the
  answer is read and dropped until the same deadline, then the connection closes;
- a cap on open connections: at the cap, a new connection closes the one that has waited longest
  without a request being served (an idle keep-alive, an unfinished head), as nginx reuses its
  idle connections; when every connection is being served, the new one gets 503 and is closed.

Why not uvicorn's h11 protocol, which has the head size cap (`h11_max_incomplete_event_size`) but
no deadline either: parsing a 0.5 KiB Telegram webhook took h11 about 120 us here and httptools 3-8 us,
against about 90 us of CPU for a whole acknowledgement on httptools.

Why not a timer per request: on this 2-core machine `loop.call_later` + `cancel` cost about 7 us
and `asyncio.timeout` 15-27 us under uvloop. Each connection instead keeps one timer set for its
earliest deadline; a new deadline that comes later than the timer costs a float assignment, and the
timer re-arms itself when it fires early.
"""

from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.web.bodies import BODY_DEADLINE_PASSED

DEFAULT_HEAD_TIMEOUT_SECONDS = 10.0
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0
# The request line and headers, as nginx's default buffers (4 x 8 KiB). Platforms send under 2 KiB.
MAX_HEAD_BYTES = 32 * 1024
# After the app was told its body's deadline passed, how long it has to answer before the close.
ANSWER_GRACE_SECONDS = 1.0
# Files the process needs besides its client connections. Measured on SQLite: 21 at rest and after
# 50 turns; on top of that, at worst: aiohttp's pool of 100 outbound connections, 32 session lock
# files (one per turn in flight), a PostgreSQL pool of 15 connections, and a margin.
RESERVED_FILES = 192


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout: float = DEFAULT_HEAD_TIMEOUT_SECONDS
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS
    max_connections: int | None = None  # None: no cap
    max_head_bytes: int = MAX_HEAD_BYTES


class GatewayConfig(uvicorn.Config):
    """uvicorn's Config serving with `GatewayHttpProtocol` under `limits`.

    uvicorn's own `limit_concurrency` stays on as the cap on requests in flight: it counts the
    request's own connection, so it is one above the connection cap to let every connection be served.
    The gateway serves no WebSocket, so upgrades are not offered.
    """

    def __init__(self, app: Any, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        cap = limits.max_connections
        super().__init__(
            app,
            http=GatewayHttpProtocol,
            ws="none",
            limit_concurrency=None if cap is None else cap + 1,
            **kwargs,
        )
        self.connection_limits = limits


def _raw_answer(status: int, phrase: str, error: str, detail: str, *headers: str) -> bytes:
    body = json.dumps({"error": error, "detail": detail}, separators=(",", ":")).encode()
    head = [
        f"HTTP/1.1 {status} {phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_HEAD_TIMEOUT = _raw_answer(
    408, "Request Timeout", "request_timeout", "the request head did not arrive in time"
)
_HEAD_TOO_LARGE = _raw_answer(
    431, "Request Header Fields Too Large", "headers_too_large", "the request head is too large"
)
_FULL = _raw_answer(
    503, "Service Unavailable", "unavailable", "too many connections; retry later", "retry-after: 1"
)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines, a head size cap and a connection cap (see above)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = getattr(config, "connection_limits", None)
        self.limits: ConnectionLimits = limits if isinstance(limits, ConnectionLimits) else ConnectionLimits()
        self._head_started: float | None = None  # receiving a request head since then
        self._head_begun = False  # a byte of that head has arrived
        self._head_bytes = 0
        self._began_in_data = False
        self._body_started: float | None = None  # receiving a request body since then
        self._app_told = False  # the app was told that body's deadline passed
        self._idle_since = 0.0  # last time no request was being served: the order of eviction
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    @property
    def serving(self) -> bool:
        """A request of this connection is with the app (from its complete head to its answer)."""
        return self.cycle is not None and not self.cycle.response_complete

    # --- the connection ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        now = self.loop.time()
        self._head_started = self._idle_since = now
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap and not self._make_room(cap):
            self._refuse(_FULL)
            return
        self._arm(now + self.limits.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _make_room(self, cap: int) -> bool:
        """Close the connections waiting longest without being served, down to `cap` open ones.
        False when too few are idle: this one must go instead."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        excess = len(open_) - cap
        if excess <= 0:
            return True
        idle = [c for c in open_ if isinstance(c, GatewayHttpProtocol) and c is not self and not c.serving]
        if len(idle) < excess:
            return False
        for evicted in sorted(idle, key=lambda c: c._idle_since)[:excess]:
            evicted._refuse(None)
        return True

    def _refuse(self, answer: bytes | None) -> None:
        """Answer (when there is something to say) and close. The connection stops counting at once:
        uvicorn forgets it only once the loop reports it lost, and counts it against
        `limit_concurrency` until then."""
        self.connections.discard(self)
        if not self.transport.is_closing():
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    # --- bytes and parser callbacks ----------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        mid_body = self._body_started is not None
        self._began_in_data = False
        super().data_received(data)
        # The bytes of a head still unfinished after this data: all of the data, unless it began with the
        # end of a body (then the head may pass the cap by one read). Pipelined requests read together
        # count whole; no platform pipelines.
        if self._head_started is not None and self._head_begun and not (mid_body and self._began_in_data):
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(_HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began_in_data = self._head_begun = True
        if self._head_started is None:  # the next request of a keep-alive connection
            now = self.loop.time()
            self._head_started = self._idle_since = now
            self._arm(now + self.limits.head_timeout)

    def on_headers_complete(self) -> None:
        now = self.loop.time()
        self._head_started = None
        self._head_begun = False
        self._head_bytes = 0
        self._body_started = now
        self._app_told = False
        self._arm(now + self.limits.body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        answered = self.cycle is not None and self.cycle.response_complete
        super().on_message_complete()
        self._body_started = None
        if answered and not self.transport.is_closing():
            # The body ended after the answer: uvicorn armed its keep-alive timer at the answer and
            # the body's bytes cancelled it, so arm it again, as after any finished exchange.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    # --- deadlines ---------------------------------------------------------------------------------
    def _arm(self, at: float) -> None:
        """Make sure the timer fires by `at`; one that fires earlier re-arms itself then."""
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer = self.loop.call_at(at, self._on_timer)
        self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        after = self._check(self.loop.time())
        if after is not None:
            self._arm(after)

    def _check(self, now: float) -> float | None:
        """Act on a deadline that has passed; the next deadline, or None when there is none."""
        limits = self.limits
        if self._head_started is not None:
            deadline = self._head_started + limits.head_timeout
            if now < deadline:
                return deadline
            self._refuse(_HEAD_TIMEOUT if self._head_begun else None)
            return None
        if self._body_started is not None:
            deadline = (
                self._body_started + limits.body_timeout + (ANSWER_GRACE_SECONDS if self._app_told else 0)
            )
            if now < deadline:
                return deadline
            cycle = self.cycle
            if not self._app_told and cycle is not None and not cycle.response_started:
                # The app answers (408, connection closed) when it next reads the body.
                self._app_told = True
                cycle.scope["state"][BODY_DEADLINE_PASSED] = True
                cycle.message_event.set()
                return now + ANSWER_GRACE_SECONDS
            self._refuse(None)  # answered already, or the app did not answer in its grace
        return None


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as Go's runtime does at start);
    the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. macOS caps it below the hard limit: keep what there is
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20
