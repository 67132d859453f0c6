"""The outbound HTTP client (httpx on aiohttp's transport) over real loopback sockets: a round trip,
and the httpx errors callers tell apart (a refused connection is not a timeout)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.http_client import http_client
from tests.helpers import serve_in_thread


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"got": await request.json(), "auth": request.headers.get("authorization")})


async def test_a_json_round_trip_keeps_body_headers_and_status() -> None:
    with serve_in_thread(Starlette(routes=[Route("/echo", echo, methods=["POST"])])) as url:
        async with http_client(timeout=10) as client:
            for n in range(3):  # the same keep-alive connection, more than once
                response = await client.post(
                    f"{url}/echo", json={"n": n, "text": "héllo ✓"}, headers={"Authorization": "Bearer x"}
                )
                assert response.status_code == 200
                assert response.json() == {"got": {"n": n, "text": "héllo ✓"}, "auth": "Bearer x"}
            missing = await client.get(f"{url}/nowhere")
            assert missing.status_code == 404


async def test_a_refused_connection_is_a_connect_error_not_a_timeout() -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        async with http_client(timeout=10) as client:
            with pytest.raises(httpx.ConnectError) as caught:
                await client.post(f"http://127.0.0.1:{port}/x", json={})
    assert not isinstance(caught.value, httpx.TimeoutException)


async def test_a_server_that_never_answers_is_a_timeout() -> None:
    handled = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # holds the connection open without answering until the client leaves
        writer.close()
        await writer.wait_closed()
        handled.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with http_client(timeout=0.3) as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post(f"http://127.0.0.1:{port}/x", json={})
        await asyncio.wait_for(handled.wait(), timeout=10)  # the client hung up once it gave up


async def test_a_set_cookie_is_never_sent_back() -> None:
    """Platform and provider APIs are stateless: a cookie one answer sets must not ride along on later
    calls (to that host or any other)."""

    async def sets_cookie(request: Request) -> JSONResponse:
        response = JSONResponse({"cookie": request.headers.get("cookie")})
        response.set_cookie("session", "tracked", path="/")
        return response

    with serve_in_thread(Starlette(routes=[Route("/c", sets_cookie, methods=["POST"])])) as url:
        async with http_client(timeout=10) as client:
            first = await client.post(f"{url}/c", json={})
            assert first.cookies.get("session") == "tracked"  # the answer itself still shows it
            second = await client.post(f"{url}/c", json={})
            assert second.json() == {"cookie": None}
            assert len(client.cookies) == 0
