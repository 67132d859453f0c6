"""CPU per outbound call: the gateway's client against aiohttp alone and a bare HTTP/1.1 protocol.

One command: `python benchmarks/http_client_cost.py [--calls N] [--rounds R]`. A server on loopback (a
child process, so its CPU is not counted) answers every POST at once with a chat-completion body;
each client makes N calls, 64 in flight, on kept-alive connections, after a warm-up; the table gives
the client process's CPU per call (median of the rounds, the kinds alternating within each round).

The third kind, a bare asyncio protocol on httptools' parser (no TLS, no proxies, no timeouts, no
errors handled), is not a client the gateway could use: it is the floor, what the call's own work
costs here, so the gap to it is what a leaner client could win at model latency (two calls a turn).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import orjson
import uvloop

ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }
)
REQUEST = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 20}]})
HEADERS = {"authorization": "Bearer sk-test", "content-type": "application/json"}
IN_FLIGHT = 64
KINDS = ("gateway", "aiohttp", "bare protocol")


class _Server(asyncio.Protocol):
    """Answers each whole request (headers and a Content-Length body) with ANSWER."""

    reply = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER)
        + ANSWER
    )

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15 :].split(b"\r\n")[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(self.reply)


async def _serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Server, "127.0.0.1", port)
    await server.serve_forever()


class _BareConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: a request written whole, its answer parsed by httptools."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.answer: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.answer is not None
        self.answer.set_result((self.parser.get_status_code(), b"".join(self.body)))
        self.body = []


async def _caller(kind: str, url: str) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """A call of this kind, and how to close what it opened."""
    if kind == "gateway":  # as the platform and model clients call it
        from gateway.http_client import endpoint, http_client, post

        client = http_client(30.0, 200)
        target = endpoint(url)

        async def call() -> None:
            assert (await post(client, target, REQUEST, HEADERS)).json()

        return call, client.aclose
    if kind == "aiohttp":
        import aiohttp
        from yarl import URL

        session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        parsed = URL(url)

        async def call() -> None:
            async with session.post(parsed, data=REQUEST, headers=HEADERS) as answer:
                assert orjson.loads(await answer.read())

        return call, session.close
    idle: list[_BareConnection] = []
    loop = asyncio.get_running_loop()
    port = int(url.split(":")[2].split("/")[0])
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: {len(REQUEST)}\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in HEADERS.items())
        + "\r\n"
    ).encode()

    async def call() -> None:
        if idle:
            connection = idle.pop()
        else:
            connection = (await loop.create_connection(_BareConnection, "127.0.0.1", port))[1]
        connection.answer = loop.create_future()
        connection.transport.write(head + REQUEST)
        status, body = await connection.answer
        assert status == 200
        assert orjson.loads(body)
        idle.append(connection)

    async def close() -> None:
        for connection in idle:
            connection.transport.close()

    return call, close


async def _measure(kind: str, url: str, calls: int) -> float:
    """The process's CPU per call, in microseconds."""
    call, close = await _caller(kind, url)

    async def lane(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*(lane(100) for _ in range(IN_FLIGHT)))
    started = time.process_time()
    await asyncio.gather(*(lane(calls // IN_FLIGHT) for _ in range(IN_FLIGHT)))
    spent = time.process_time() - started
    await close()
    return spent / (calls // IN_FLIGHT * IN_FLIGHT) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.serve:
        uvloop.run(_serve(options.serve))
        return
    if options.kind:
        print(uvloop.run(_measure(options.kind, options.url, options.calls)))
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)  # waiting for the child server to listen: nothing to wait on but the port
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        figures: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for round_ in range(options.rounds):
            order = KINDS if round_ % 2 == 0 else KINDS[::-1]
            for kind in order:
                run = [sys.executable, __file__, "--kind", kind, "--url", url, "--calls", str(options.calls)]
                cost = float(subprocess.run(run, check=True, capture_output=True, text=True).stdout)
                figures[kind].append(cost)
                print(f"round {round_ + 1}: {kind} {cost:.0f} us", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    floor = statistics.median(figures["bare protocol"])
    workload = f"{options.calls:,} POSTs, {IN_FLIGHT} in flight, loopback"
    print(f"| Client ({workload}) | CPU per call | vs bare protocol |")
    print("| --- | ---: | ---: |")
    for kind in KINDS:
        cost = statistics.median(figures[kind])
        rounds = ", ".join(f"{value:.0f}" for value in figures[kind])
        print(f"| {kind} | {cost:.0f} us ({rounds}) | {cost / floor:.1f}x |")


if __name__ == "__main__":
    main()
