"""HTTP/1.1 on kept-alive connections, parsed by httptools: the outbound calls that need no proxy.

Written by hand, not taken from a library, for its cost: with 64 calls in flight on loopback, a call
through aiohttp cost 93 us of CPU here, the same call on a bare asyncio protocol with httptools'
parser 9 us, and a turn at model latency makes two calls (benchmarks/http_client_cost.py). What it
does is what the gateway's calls need and no more: a request written whole (bytes or no body), its
answer read whole (Content-Length, chunked, or until the server closes), connections kept alive per
origin and dropped when the server closes them, when idle longer than the keep-alive expiry, or when
told `Connection: close`, TLS through `ssl` (the client's context), the host's addresses cached for
10 s (aiohttp's DNS cache) and tried in order, and httpx's connect, read (between bytes) and pool
timeouts. Every failure is the httpx error httpcore would raise. A request is never sent twice: a
kept-alive connection the server dropped unnoticed fails the call, as aiohttp does for a POST.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import select
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import httptools
import httpx

DNS_CACHE_S = 10.0
MAX_HEADS = 256  # kept request heads (Pool._heads)
_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNSAFE = re.compile("[\r\n\0]")
_FRAMING = frozenset({"content-length", "transfer-encoding"})

Origin: TypeAlias = tuple[str, str, int]  # scheme, host, port


@dataclass(slots=True)
class Answer:
    """A whole HTTP answer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _Connection(asyncio.Protocol):
    """One connection: one request at a time, its answer parsed as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[Answer] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.reusable = True
        self.last_active = loop.time()
        self.read_timer: asyncio.TimerHandle | None = None
        self.read_timeout = 0.0

    # asyncio's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        if self.answer is None:  # bytes nobody asked for: the connection is not in a known state
            self._drop()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP answer: {exc}"))

    def eof_received(self) -> bool:
        return False  # the transport closes, connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self.answer is None or self.answer.done():
            return
        if self.headers_done and not self._length_known():  # an answer delimited by the close
            self.on_message_complete()
            return
        self._fail(httpx.RemoteProtocolError("Server disconnected without sending a complete response."))

    # httptools' side
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.headers, self.body, self.headers_done = [], [], False
            return
        self.reusable = self.reusable and self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(Answer(status, self.headers, b"".join(self.body)))

    # the pool's side
    def ask(self, head: bytes, content: bytes | None, read_timeout: float | None) -> asyncio.Future[Answer]:
        """Write a request; its answer is the future's."""
        assert self.transport is not None
        self.answer = self.loop.create_future()
        self.headers, self.body, self.headers_done = [], [], False
        self.last_active = self.loop.time()
        if read_timeout is not None:
            self.read_timeout = read_timeout
            self.read_timer = self.loop.call_later(read_timeout, self._check_read)
        self.transport.write(head + content if content else head)
        return self.answer

    def finish(self) -> None:
        """The answer is in (or abandoned): stop its timer, forget it."""
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        answer = self.answer
        if answer is None or not answer.done() or answer.cancelled() or answer.exception() is not None:
            self.reusable = False  # abandoned (cancelled, timed out) or failed mid-answer
        self.answer = None

    def idle_and_open(self, now: float, keepalive_s: float) -> bool:
        """Whether a request may go on this idle connection. Besides what asyncio knows, the socket
        is asked at once whether the server closed it (as urllib3 does before reusing one): an idle
        connection that has anything to read was closed or is out of step, and a request written on it
        would be lost."""
        transport = self.transport
        if (
            not self.reusable
            or transport is None
            or transport.is_closing()
            or now - self.last_active >= keepalive_s
        ):
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        waiting = select.poll()  # not select.select: it cannot watch a descriptor above 1023
        waiting.register(sock, select.POLLIN)
        return not waiting.poll(0)

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def _check_read(self) -> None:
        """The read timeout is the longest wait between bytes, as httpx's is."""
        quiet = self.loop.time() - self.last_active
        if quiet < self.read_timeout:
            self.read_timer = self.loop.call_later(self.read_timeout - quiet, self._check_read)
            return
        self.read_timer = None
        self._fail(httpx.ReadTimeout("timed out waiting for the answer"))

    def _fail(self, error: Exception) -> None:
        self._drop()
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)

    def _drop(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def _length_known(self) -> bool:
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length" or (
                lowered == b"transfer-encoding" and b"chunked" in value.lower()
            ):
                return True
        return False


@dataclass
class Pool:
    """Connections per origin; at most `max_connections` requests at once, across origins."""

    max_connections: int
    keepalive_s: float
    tls: ssl.SSLContext
    _idle: dict[Origin, list[_Connection]] = field(default_factory=dict)
    _addresses: dict[tuple[str, int], tuple[float, asyncio.Future[list[Any]]]] = field(default_factory=dict)
    _slots: asyncio.Semaphore | None = None
    # Heads but for the body's length, by method, origin, path and headers: a platform's or a provider's
    # calls repeat theirs (7 us of CPU to build one here, 1.5 to take a kept one). They hold tokens and
    # keys, in memory only, as the clients that send them do.
    _heads: dict[tuple[str, Origin, bytes, tuple[tuple[str, str], ...]], bytes] = field(default_factory=dict)

    async def send(
        self,
        request: httpx.Request,
        headers: list[tuple[str, str]],
        content: bytes | None,
        waits: httpx.Timeout,
    ) -> Answer:
        """`request` sent with these headers (the Host and Content-Length are added) and body."""
        url = request.url
        if url.scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"{url.scheme!r} is not HTTP or HTTPS", request=request)
        origin = (url.scheme, url.host, url.port or _DEFAULT_PORTS[url.scheme])
        head = self._fixed_head(request.method, origin, url, headers) + _length(request.method, content)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        if self._slots.locked():
            try:
                async with asyncio.timeout(waits.pool):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout(
                    "no connection free within the pool timeout", request=request
                ) from None
        else:
            await self._slots.acquire()
        try:
            connection = self._take(origin) or await self._connect(origin, waits.connect, request)
            try:
                return await connection.ask(head, content, waits.read)
            except httpx.TransportError as exc:
                exc.request = request
                raise
            finally:
                connection.finish()
                if connection.reusable:
                    self._keep(origin, connection)
                else:
                    connection.close()
        finally:
            self._slots.release()

    def _fixed_head(
        self, method: str, origin: Origin, url: httpx.URL, headers: list[tuple[str, str]]
    ) -> bytes:
        key = (method, origin, url.raw_path, tuple(headers))
        head = self._heads.get(key)
        if head is None:
            head = _head(method, url, headers)
            if len(self._heads) >= MAX_HEADS:
                self._heads.clear()
            self._heads[key] = head
        return head

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _take(self, origin: Origin) -> _Connection | None:
        """The most recently used open connection to `origin`; closed and expired ones go on the way."""
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if connection.idle_and_open(now, self.keepalive_s):
                return connection
            connection.close()
        return None

    def _keep(self, origin: Origin, connection: _Connection) -> None:
        """Kept for the next call to `origin`; the ones idle past the expiry (the oldest, first) close."""
        idle = self._idle.setdefault(origin, [])
        idle.append(connection)
        oldest = connection.last_active - self.keepalive_s
        while idle[0].last_active <= oldest:
            idle.pop(0).close()

    async def _connect(self, origin: Origin, within: float | None, request: httpx.Request) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self.tls if scheme == "https" else None
        last: Exception | None = None
        try:
            async with asyncio.timeout(within):
                for address in await self._resolve(host, port):
                    try:
                        _, connection = await loop.create_connection(
                            lambda: _Connection(loop),
                            *address,
                            ssl=tls,
                            server_hostname=host if tls else None,
                        )
                    except (OSError, ssl.SSLError) as exc:
                        last = exc
                        continue
                    return connection
        except TimeoutError:
            raise httpx.ConnectTimeout(
                f"could not connect to {host}:{port} in time", request=request
            ) from None
        except OSError as exc:  # the name did not resolve
            raise httpx.ConnectError(str(exc), request=request) from exc
        raise httpx.ConnectError(str(last or f"{host} has no address"), request=request) from last

    async def _resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        """The host's addresses: an IP address as it is; a name looked up once for every call that
        needs it meanwhile (2,000 new connections at once make one lookup, not 2,000), then cached."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            return [(host, port)]
        loop = asyncio.get_running_loop()
        cached = self._addresses.get((host, port))
        if cached is None or cached[0] <= loop.time():
            lookup = asyncio.ensure_future(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            cached = self._addresses[(host, port)] = (loop.time() + DNS_CACHE_S, lookup)
        try:
            infos = await asyncio.shield(cached[1])  # one caller giving up does not end it for the rest
        except OSError:
            if self._addresses.get((host, port)) is cached:
                del self._addresses[(host, port)]  # the next call asks again
            raise
        return list(dict.fromkeys((str(info[4][0]), int(info[4][1])) for info in infos))


def _head(method: str, url: httpx.URL, headers: list[tuple[str, str]]) -> bytes:
    """The request line and headers but the body's length (`_length`). The Host is the URL's unless a
    header names one. A CR, LF or NUL in a header is refused: it would end the header early and let a
    value write headers (or a request) of its own."""
    lines = [f"{method} {url.raw_path.decode('ascii')} HTTP/1.1"]
    host = f"host: {url.netloc.decode('ascii')}"
    for name, value in headers:
        if _UNSAFE.search(name) or _UNSAFE.search(value):
            raise httpx.LocalProtocolError(f"the {name!r} header holds a line break or NUL")
        lowered = name.lower()
        if lowered == "host":
            host = f"host: {value}"
        elif lowered not in _FRAMING:
            lines.append(f"{name}: {value}")
    lines.insert(1, host)
    lines.append("")
    return "\r\n".join(lines).encode("utf-8")


def _length(method: str, content: bytes | None) -> bytes:
    """The head's last line, the body's length (it is sent whole), and its end."""
    if content is not None or method in ("POST", "PUT", "PATCH"):
        return b"content-length: %d\r\n\r\n" % (len(content) if content else 0)
    return b"\r\n"
