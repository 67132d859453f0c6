"""The outbound HTTP client (httpx on aiohttp's transport) over real loopback sockets: a round trip,
the httpx errors callers tell apart (a refused connection is not a timeout), and the plain path's
answers matching httpx's own, whole httpx.Responses or `post`'s PlainAnswers (gateway/http_client.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.http_client import PlainAnswer, endpoint, http_client, post
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


async def test_a_plain_call_answers_as_httpx_does() -> None:
    """A plain call (bytes, headers, a timeout) skips httpx's path: its answer is still a whole
    httpx.Response, gzip decoded, naming its request, with its elapsed time and reason."""

    async def gzipped(request: Request) -> Response:
        assert request.headers["content-type"] == "application/json"
        assert request.headers["user-agent"] == "chatflow-test"  # the client's headers, set after it was made
        body = gzip.compress(b'{"ok": true, "echo": %s}' % await request.body())
        return Response(body, 201, {"Content-Encoding": "gzip", "Content-Type": "application/json"})

    with serve_in_thread(Starlette(routes=[Route("/z", gzipped, methods=["POST"])])) as url:
        async with http_client(timeout=10) as client:
            client.headers["User-Agent"] = "chatflow-test"
            response = await client.post(
                httpx.URL(f"{url}/z"), content=b"[1]", headers={"Content-Type": "application/json"}, timeout=5
            )
    assert response.status_code == 201
    assert response.reason_phrase == "Created"
    assert response.json() == {"ok": True, "echo": [1]}
    assert response.request.url == httpx.URL(f"{url}/z")
    assert response.elapsed.total_seconds() > 0


async def test_a_redirect_is_answered_not_followed() -> None:
    async def moved(request: Request) -> Response:
        return Response(status_code=307, headers={"Location": "/elsewhere"})

    with serve_in_thread(Starlette(routes=[Route("/m", moved, methods=["POST"])])) as url:
        async with http_client(timeout=10) as client:
            response = await client.post(f"{url}/m", content=b"{}", headers={"Authorization": "Bearer k"})
    assert response.status_code == 307
    assert response.headers["location"] == "/elsewhere"


@pytest.mark.parametrize(
    "body",
    [
        b'{"n": 1, "text": "h\xc3\xa9llo"}',
        b'{"n": NaN}',  # not strict JSON: the standard library's reading, as httpx's
        b'{"id": 123456789012345678901234567890}',  # beyond 64 bits, as the standard library reads it
        '{"n": 2}'.encode("utf-16"),
        b"not json",
    ],
    ids=["utf-8", "nan", "big integer", "utf-16", "not json"],
)
async def test_post_answers_what_httpx_would(body: bytes) -> None:
    """`post` on the gateway's client reads the answer without an httpx.Response; whatever the body, it
    reads as httpx reads it: status, reason, success, headers, text and JSON (or the same ValueError)."""

    async def answer(request: Request) -> Response:
        assert request.headers["authorization"] == "Bearer k"
        assert request.headers["user-agent"] == "chatflow-test"  # the client's headers as they are now
        assert await request.body() == b"[1]"
        return Response(body, 429, {"Content-Type": "application/json", "Retry-After": "7"})

    with serve_in_thread(Starlette(routes=[Route("/a", answer, methods=["POST"])])) as url:
        async with http_client(timeout=10) as client:
            client.headers["User-Agent"] = "chatflow-test"
            plain = await post(client, endpoint(f"{url}/a"), b"[1]", {"Authorization": "Bearer k"}, 5)
            whole = await client.post(f"{url}/a", content=b"[1]", headers={"Authorization": "Bearer k"})
    assert isinstance(plain, PlainAnswer)
    assert (plain.status_code, plain.reason_phrase, plain.is_success) == (429, "Too Many Requests", False)
    assert plain.headers["retry-after"] == whole.headers["retry-after"] == "7"
    assert plain.text == whole.text
    try:
        expected = whole.json()
    except json.JSONDecodeError:
        with pytest.raises(json.JSONDecodeError):
            plain.json()
    else:
        assert plain.json() == expected


async def test_post_hands_an_encoded_answer_to_httpx_and_follows_no_redirect() -> None:
    async def gzipped(request: Request) -> Response:
        return Response(gzip.compress(b'{"ok": true}'), 200, {"Content-Encoding": "gzip"})

    async def moved(request: Request) -> Response:
        return Response(status_code=307, headers={"Location": "/z"})

    app = Starlette(routes=[Route("/z", gzipped, methods=["POST"]), Route("/m", moved, methods=["POST"])])
    with serve_in_thread(app) as url:
        async with http_client(timeout=10) as client:
            decoded = await post(client, endpoint(f"{url}/z"), b"{}", {})
            redirected = await post(client, endpoint(f"{url}/m"), b"{}", {})
        async with httpx.AsyncClient(follow_redirects=True) as theirs:  # any other client: its post()
            not_followed = await post(theirs, endpoint(f"{url}/m"), b"{}", {})
    assert isinstance(decoded, httpx.Response)
    assert decoded.json() == {"ok": True}
    assert (redirected.status_code, redirected.headers["location"]) == (307, "/z")
    assert isinstance(not_followed, httpx.Response)
    assert not_followed.status_code == 307


@pytest.mark.parametrize(
    "body", [{"content": b"{}"}, {"json": {}}, {"post": b"{}"}], ids=["plain call", "httpx's path", "post"]
)
async def test_a_proxy_from_the_environment_is_used(
    monkeypatch: pytest.MonkeyPatch, body: dict[str, Any]
) -> None:
    """HTTP_PROXY set: calls go through the proxy, whichever path they take; NO_PROXY names hosts
    reached directly."""
    first_lines: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        first_lines.append(head.split(b"\r\n", 1)[0])
        sizes = [
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ]
        await reader.readexactly(sizes[0] if sizes else 0)
        writer.write(
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"via": 1}\n'
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "direct.invalid")
    async with server, http_client(timeout=10) as client:

        async def call(url: str) -> Any:
            if "post" in body:
                return await post(client, endpoint(url), body["post"], {})
            return await client.post(url, **body)

        response = await call("http://chatflow.invalid/x")
        with pytest.raises(httpx.ConnectError):  # not through the proxy: the name does not resolve
            await call("http://direct.invalid/x")
    assert response.json() == {"via": 1}
    assert first_lines == [b"POST http://chatflow.invalid/x HTTP/1.1"]
