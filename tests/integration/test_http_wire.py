"""The outbound calls' own HTTP/1.1 connections (gateway/http_wire.py) against servers on loopback
that write exactly the bytes each case needs: how answers end, when a connection is used again, the
timeouts, TLS, and requests that must never be written."""

from __future__ import annotations

import asyncio
import os
import resource
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeAlias

import httpx
import pytest
import trustme

from gateway.http_client import http_client

Handler: TypeAlias = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class Served:
    url: str
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def server(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[Served]:
    """A server whose handler gets each connection and its number (0 for the first)."""
    served = Served("")

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = served.connections
        served.connections += 1
        try:
            await handler(reader, writer, number)
        finally:
            writer.close()
            await writer.wait_closed()
            served.closed.set()

    listening = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=tls)
    port = listening.sockets[0].getsockname()[1]
    served.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    async with listening:
        yield served


async def read_request(reader: asyncio.StreamReader, served: Served | None = None) -> bytes:
    """One request's head (kept in `served.heads`), its body read and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    if served is not None:
        served.heads.append(head)
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


def answer(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


async def test_a_chunked_answer_is_joined_and_its_connection_used_again() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _ in range(2):
            await read_request(reader)
            writer.write(answer(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"Transfer-Encoding: chunked"))

    async with server(chunked) as served, http_client(timeout=10) as client:
        first = await client.post(f"{served.url}/a", content=b"{}")
        second = await client.post(f"{served.url}/a", content=b"{}")
    assert first.text == second.text == "hello world"
    assert served.connections == 1


async def test_an_answer_delimited_by_the_close_is_whole_and_its_connection_not_used_again() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b'{"whole": true}', b"Content-Type: application/json"))
        # the handler returns: the server closes the connection, which ends the body

    async with server(until_close) as served, http_client(timeout=10) as client:
        for _ in range(2):
            assert (await client.post(f"{served.url}/a", content=b"{}")).json() == {"whole": True}
    assert served.connections == 2


async def test_connection_close_is_obeyed() -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"ok", b"Content-Length: 2", b"Connection: close"))
        await reader.read()  # the client hangs up: that ends this connection

    async with server(closing) as served, http_client(timeout=10) as client:
        for _ in range(2):
            assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"
    assert served.connections == 2


async def test_a_kept_alive_connection_the_server_closed_is_not_used_again() -> None:
    """Servers close idle connections on their own clock; a request written on one would be lost."""

    async def answers_then_closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"ok", b"Content-Length: 2"))  # keep-alive, as far as the client knows
        await writer.drain()

    async with server(answers_then_closes) as served, http_client(timeout=10) as client:
        assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"
        await served.closed.wait()  # the server closed the idle connection
        assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"
    assert served.connections == 2


async def test_the_request_head_names_the_host_and_the_body_length_once() -> None:
    """Also when the head is the one kept from an earlier call to the same endpoint (Pool._heads): each
    call's own body length, and a header changed since is sent as it is now."""

    async def records(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _ in range(4):
            await read_request(reader, served)
            writer.write(answer(b"ok", b"Content-Length: 2"))

    async with server(records) as served, http_client(timeout=10) as client:
        await client.post(f"{served.url}/plain", content=b"[1, 2]", headers={"X-Token": "t"})
        await client.post(f"{served.url}/whole", json=[1, 2], headers={"X-Token": "t"})  # httpx's path
        await client.post(f"{served.url}/plain", content=b"[1, 2, 3]", headers={"X-Token": "t"})
        await client.post(f"{served.url}/plain", content=b"[1, 2, 3]", headers={"X-Token": "u"})
    netloc = served.url.removeprefix("http://").encode()
    for head, length, token in zip(served.heads, (6, 5, 9, 9), "tttu", strict=True):
        lines = head.lower().split(b"\r\n")
        assert lines.count(b"host: " + netloc) == 1
        lengths = [line for line in lines if line.startswith(b"content-length:")]
        assert lengths == [b"content-length: %d" % length]
        assert f"x-token: {token}".encode() in lines
    assert served.heads[0].startswith(b"POST /plain HTTP/1.1\r\n")


async def test_a_header_with_a_line_break_is_refused_before_anything_is_written() -> None:
    async def records(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader, served)
        writer.write(answer(b"ok", b"Content-Length: 2"))

    async with server(records) as served, http_client(timeout=10) as client:
        for _ in range(2):  # refused each time: a refused head is never kept
            with pytest.raises(httpx.LocalProtocolError):
                await client.post(f"{served.url}/a", content=b"{}", headers={"X-A": "1\r\nX-Injected: 2"})
    assert served.heads == []


async def test_a_body_cut_short_is_a_protocol_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"only ten b", b"Content-Length: 100"))

    async with server(cut) as served, http_client(timeout=10) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(f"{served.url}/a", content=b"{}")


async def test_the_read_timeout_is_the_longest_wait_between_bytes() -> None:
    """An answer trickling in over longer than the read timeout is read whole; a pause longer than it
    fails the call."""
    pieces = 6

    async def trickles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (pieces + 1))
        for _ in range(pieces):
            await asyncio.sleep(0.1)  # the server's pace is what is tested
            writer.write(b"x")
        if number == 0:
            writer.write(b"!")
        else:
            await reader.read()  # stalls one byte short

    async with server(trickles) as served, http_client(timeout=0.4) as client:
        assert (await client.post(f"{served.url}/a", content=b"{}")).text == "xxxxxx!"
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{served.url}/a", content=b"{}")


async def test_a_call_waits_for_a_free_connection_up_to_the_pool_timeout() -> None:
    release, held = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        held.set()
        await release.wait()
        writer.write(answer(b"ok", b"Content-Length: 2"))

    async with server(slow) as served, http_client(timeout=10, max_connections=1) as client:
        first = asyncio.create_task(client.post(f"{served.url}/a", content=b"{}"))
        await held.wait()  # the first call holds the only connection
        with pytest.raises(httpx.PoolTimeout):
            await client.post(f"{served.url}/a", content=b"{}", timeout=httpx.Timeout(10, pool=0.2))
        release.set()
        assert (await first).text == "ok"


async def test_a_cancelled_call_leaves_no_half_read_connection_behind() -> None:
    answered = asyncio.Event()

    async def first_never_answers(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        await read_request(reader)
        if number == 0:
            answered.set()
            await reader.read()
            return
        writer.write(answer(b"ok", b"Content-Length: 2"))

    async with server(first_never_answers) as served, http_client(timeout=10) as client:
        waiting = asyncio.create_task(client.post(f"{served.url}/a", content=b"{}"))
        await answered.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"
    assert served.connections == 2


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


async def test_tls_is_verified_against_the_configured_authorities(
    authority: trustme.CA, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SSL_CERT_FILE names the authorities, as httpx reads it: a certificate they signed is taken, and
    with the default authorities the same server is refused."""
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1", "localhost").configure_cert(tls)

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer(b"secure", b"Content-Length: 6"))
        await writer.drain()

    bundle = tmp_path_factory.mktemp("ca") / "ca.pem"
    authority.cert_pem.write_to_path(str(bundle))
    async with server(answers, tls) as served:
        async with http_client(timeout=10) as untrusting:
            with pytest.raises(httpx.ConnectError):
                await untrusting.post(f"{served.url}/a", content=b"{}")
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
        async with http_client(timeout=10) as client:
            assert (await client.post(f"{served.url}/a", content=b"{}")).text == "secure"
            host_named = served.url.replace("127.0.0.1", "localhost")  # resolved, and checked by name
            assert (await client.post(f"{host_named}/a", content=b"{}")).text == "secure"


async def test_connections_are_used_again_whatever_their_descriptor_number() -> None:
    """A process with thousands of connections open has descriptors above 1023, which select() cannot
    watch: the check of an idle connection must still work there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(reason=f"the open-files limit ({hard}) is below the 1,200 descriptors this needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _ in range(3):
            await read_request(reader)
            writer.write(answer(b"ok", b"Content-Length: 2"))

    try:
        async with server(answers) as served, http_client(timeout=10) as client:
            for _ in range(3):
                assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"
        assert served.connections == 1
    finally:
        for descriptor in fillers:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_an_interim_answer_is_passed_over() -> None:
    async def hints_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n")
        writer.write(answer(b"final", b"Content-Length: 5"))
        await writer.drain()

    async with server(hints_first) as served, http_client(timeout=10) as client:
        response = await client.post(f"{served.url}/a", content=b"{}")
    assert (response.status_code, response.text, "link" in response.headers) == (200, "final", False)


async def test_a_url_that_is_not_http_is_refused_as_httpx_refuses_it() -> None:
    async with http_client(timeout=10) as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.post("ftp://127.0.0.1/a", content=b"{}")


async def test_a_host_name_is_looked_up_once_for_the_connections_opened_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2,000 model calls opening their connections at once must not make 2,000 DNS lookups."""
    loop = asyncio.get_running_loop()
    lookups: list[str] = []
    real = loop.getaddrinfo

    async def counted(host: str, *args: object, **kwargs: object) -> object:
        lookups.append(host)
        return await real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "getaddrinfo", counted)
    release = asyncio.Event()

    async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> None:
        await read_request(reader)
        if number == 19:
            release.set()
        await release.wait()  # every call holds its connection until all 20 are open
        writer.write(answer(b"ok", b"Content-Length: 2"))
        await writer.drain()

    async with server(answers) as served, http_client(timeout=10) as client:
        named = served.url.replace("127.0.0.1", "localhost")
        calls = [client.post(f"{named}/a", content=b"{}") for _ in range(20)]
        assert [r.text for r in await asyncio.gather(*calls)] == ["ok"] * 20
        assert (await client.post(f"{served.url}/a", content=b"{}")).text == "ok"  # an address: no lookup
    assert lookups == ["localhost"]
    assert served.connections == 21
