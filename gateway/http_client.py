"""The HTTP client of every outbound call: platforms, model providers and the CLI.

It is httpx's API on two senders. A call that needs no proxy (all of them, unless HTTPS_PROXY or
HTTP_PROXY names one for its host) goes on the gateway's own HTTP/1.1 connections (gateway/http_wire.py:
51 us of CPU a call here, against 93 for aiohttp alone and 159 for this client on aiohttp, 64 calls in
flight on loopback, benchmarks/http_client_cost.py); a proxied call, or a HEAD, goes through aiohttp's
session from httpx-aiohttp's transport. Either way the answer is read whole (nothing here streams)
and comes back as an httpx.Response, an encoded body decoded by httpx.

A plain call (bytes or no body, headers, a timeout; no auth, redirect following, query, files or
event hooks) skips httpx's request building and its auth and redirect flows: a turn at model latency
makes two calls (the model, the reply). Any other call takes httpx's whole path to the same senders.
The platform and model clients POST through `post`, whose answer off the gateway's own connections
is a `PlainAnswer` (read as httpx reads it, with no httpx.Request or Response built for it).

The client keeps no cookies: the Bot API, the Graph API and the model providers are stateless, so a
Set-Cookie from one of them is not carried into later calls (nor from one host to another), and
skipping httpx's cookie extraction saves about 0.1 ms of CPU per call.

Proxies come from the environment as httpx and curl take them (HTTPS_PROXY, HTTP_PROXY,
NO_PROXY), read when the client makes its first call; httpx itself ignores them once given a transport.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import aiohttp
import httpx
from aiohttp.helpers import ProxyInfo, proxies_from_env
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AIOHTTP_EXC_MAP
from multidict import CIMultiDict

from gateway.http_wire import Answer, Pool

_UNREAD = httpx.ByteStream(b"")  # a plain call's httpx.Request stands for it; its body is sent apart


class HttpAnswer(Protocol):
    """What the platform and model clients read of an answer: an httpx.Response, or a `PlainAnswer`."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> httpx.Headers: ...

    @property
    def text(self) -> str: ...

    @property
    def is_success(self) -> bool: ...

    @property
    def reason_phrase(self) -> str: ...

    def json(self, **kwargs: Any) -> Any: ...


class PlainAnswer:
    """An answer off the gateway's own connections, read as httpx.Response reads it, without building
    one: `post` cost 44 and 54 us of CPU a call here against 62 and 73 for httpx's API on the same
    connections (benchmarks/http_client_cost.py). Its headers and text are built only when asked for
    (error paths)."""

    __slots__ = ("_headers", "_raw", "content", "status_code")

    def __init__(self, answer: Answer) -> None:
        self.status_code = answer.status
        self.content = answer.body
        self._raw = answer.headers
        self._headers: httpx.Headers | None = None

    @property
    def headers(self) -> httpx.Headers:
        if self._headers is None:
            self._headers = httpx.Headers(self._raw)
        return self._headers

    @property
    def text(self) -> str:
        return httpx.Response(self.status_code, headers=self._raw, content=self.content).text

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def reason_phrase(self) -> str:
        return httpx.codes.get_reason_phrase(self.status_code)

    def json(self, **kwargs: Any) -> Any:
        """As httpx.Response.json: the standard library's parser (orjson reads an integer beyond 64
        bits as a float)."""
        return json.loads(self.content, **kwargs)


async def post(
    client: httpx.AsyncClient,
    url: httpx.URL,
    content: bytes,
    headers: Mapping[str, str],
    timeout: Any = httpx.USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (seconds, None, or the client's)
) -> HttpAnswer:
    """POST `content` to `url`, redirects not followed. On the gateway's own client, a call that needs
    no proxy comes back as a `PlainAnswer`; any other as an httpx.Response (a client passed in by a
    caller, a proxied call, an encoded answer)."""
    if isinstance(client, _Client):
        return await client.post_plain(url, content, headers, timeout)
    return await client.post(url, content=content, headers=headers, timeout=timeout, follow_redirects=False)


class _Transport(AiohttpTransport):
    """Sends each request on the gateway's own connections or through aiohttp (the module's docstring)."""

    _proxies: dict[str, ProxyInfo] | None = None

    def __init__(self, *, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self._wire = Pool(limits.max_connections or 100, limits.keepalive_expiry or 0.0, self.ssl_context)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The end of httpx's whole path."""
        waits = request.extensions.get("timeout", {})
        try:
            content: bytes = request.content
        except httpx.RequestNotRead:
            content = await request.aread()
        return await self.send(
            request,
            CIMultiDict(request.headers.multi_items()),
            content or None,
            httpx.Timeout(
                connect=waits.get("connect"), read=waits.get("read"), write=None, pool=waits.get("pool")
            ),
        )

    async def send(
        self, request: httpx.Request, headers: CIMultiDict[str], content: bytes | None, waits: httpx.Timeout
    ) -> httpx.Response:
        """`request` with these headers and body, its answer read whole."""
        if self._proxies is None:
            self._proxies = proxies_from_env()
        proxy = self._proxies.get(request.url.scheme) if self._proxies else None
        if proxy is not None and urllib.request.proxy_bypass(request.url.host):
            proxy = None
        started = time.perf_counter()
        if proxy is None and request.method != "HEAD":  # HEAD: an answer whose length is no body's
            answer = await self._wire.send(request, list(headers.items()), content, waits)
            response = _response(answer.status, answer.headers, answer.body, request, {})
        else:
            response = await self._send_by_aiohttp(request, headers, content, waits, proxy)
        response.elapsed = timedelta(seconds=time.perf_counter() - started)
        return response

    async def send_plain(
        self, request: httpx.Request, headers: CIMultiDict[str], content: bytes, waits: httpx.Timeout
    ) -> HttpAnswer:
        """As `send`, but an answer off the gateway's own connections that needs no decoding comes back
        as a PlainAnswer."""
        if self._proxies is None:
            self._proxies = proxies_from_env()
        if self._proxies and self._proxies.get(request.url.scheme) is not None:
            return await self.send(request, headers, content, waits)  # `send` decides on the bypass
        answer = await self._wire.send(request, list(headers.items()), content, waits)
        if any(name.lower() == b"content-encoding" for name, _ in answer.headers):
            return _response(answer.status, answer.headers, answer.body, request, {})
        return PlainAnswer(answer)

    async def _send_by_aiohttp(
        self,
        request: httpx.Request,
        headers: CIMultiDict[str],
        content: bytes | None,
        waits: httpx.Timeout,
        proxy: ProxyInfo | None,
    ) -> httpx.Response:
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        try:
            async with self.client.request(
                request.method,
                str(request.url),
                headers=headers,
                data=content,
                allow_redirects=False,
                auto_decompress=False,  # httpx.Response decodes by Content-Encoding
                compress=False,
                timeout=_aiohttp_timeout(waits.connect, waits.read, waits.pool),
                proxy=proxy.proxy if proxy else None,
                proxy_auth=proxy.proxy_auth if proxy else None,
            ) as answer:
                body = await answer.read()
        except Exception as exc:
            error = _httpx_error(exc, request)
            if error is None:
                raise
            raise error from exc
        extensions = {"http_version": b"HTTP/1.1", "reason_phrase": (answer.reason or "").encode()}
        return _response(answer.status, answer.raw_headers, body, request, extensions)

    async def aclose(self) -> None:
        await self._wire.aclose()
        if isinstance(self.client, aiohttp.ClientSession):
            await super().aclose()


def _response(
    status: int,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
    request: httpx.Request,
    extensions: dict[str, Any],
) -> httpx.Response:
    """The answer as an httpx.Response, already read. An encoded body goes through httpx's decoders;
    any other is taken as it is, which skips httpx's stream machinery (about 20 us a call here)."""
    response = httpx.Response(
        status, headers=headers, stream=httpx.ByteStream(body), request=request, extensions=extensions
    )
    if "content-encoding" in response.headers:
        response.read()
    else:
        response._content = body  # what read() would leave, as read() leaves it
        response.is_stream_consumed = response.is_closed = True
    return response


def _httpx_error(exc: Exception, request: httpx.Request) -> httpx.RequestError | None:
    """The httpx error for an aiohttp one, naming its request; None for any other exception. As
    httpx-aiohttp maps them, except that its map reports every connection error as `ConnectTimeout`
    (its broad ClientConnectionError entry wins over the specific ones): a refused or dropped
    connection is a `ConnectError` here, as httpcore reports it, and only real timeouts are timeouts."""
    mapped: type[httpx.RequestError] | None = None
    for source, target in AIOHTTP_EXC_MAP.items():
        if isinstance(exc, source) and (mapped is None or issubclass(target, mapped)):
            mapped = target
    if mapped is httpx.ConnectTimeout and not isinstance(exc, asyncio.TimeoutError):
        mapped = httpx.ConnectError
    return None if mapped is None else mapped(str(exc), request=request)


@functools.lru_cache(maxsize=64)
def _aiohttp_timeout(connect: float | None, read: float | None, pool: float | None) -> aiohttp.ClientTimeout:
    """httpx's timeouts as httpx-aiohttp maps them (waiting for a pooled connection is aiohttp's
    `connect`)."""
    return aiohttp.ClientTimeout(sock_connect=connect, sock_read=read, connect=pool)


class _NoCookies(httpx.Cookies):
    """A cookie jar that never takes a cookie from a response."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _Client(httpx.AsyncClient):
    """httpx's client, without its cookie jar, with a plain call's short cut (the module's docstring)."""

    def __init__(self, *, transport: _Transport, **options: Any) -> None:
        super().__init__(transport=transport, **options)
        self._kept_no_cookies = _NoCookies()
        self._sender = transport

    async def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: Any = None,
        headers: Any = None,
        timeout: Any = httpx.USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (httpx's own signature)
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
        **others: Any,
    ) -> httpx.Response:
        target = url if isinstance(url, httpx.URL) else httpx.URL(url)
        if not self._plain(target, content, follow_redirects, others):
            return await super().request(
                method,
                url,
                content=content,
                headers=headers,
                timeout=timeout,
                follow_redirects=follow_redirects,
                **others,
            )
        waits = self.timeout if timeout is httpx.USE_CLIENT_DEFAULT else httpx.Timeout(timeout)
        request = httpx.Request(method, target, stream=_UNREAD)
        return await self._sender.send(request, self._sent_headers(headers), content, waits)

    async def post_plain(
        self,
        url: httpx.URL,
        content: bytes,
        headers: Mapping[str, str],
        timeout: Any = httpx.USE_CLIENT_DEFAULT,  # noqa: ASYNC109 (seconds, None, or the client's)
    ) -> HttpAnswer:
        """`post` (the module's function) on this client."""
        if not self._plain(url, content, False, {}):
            return await self.post(
                url, content=content, headers=headers, timeout=timeout, follow_redirects=False
            )
        waits = self.timeout if timeout is httpx.USE_CLIENT_DEFAULT else httpx.Timeout(timeout)
        request = httpx.Request("POST", url, stream=_UNREAD)
        return await self._sender.send_plain(request, self._sent_headers(headers), content, waits)

    def _sent_headers(self, headers: Any) -> CIMultiDict[str]:
        """The client's headers, as they are now, with the call's over them."""
        sent = CIMultiDict(self.headers.multi_items())
        if headers:
            sent.update(headers)
        return sent

    def _plain(self, url: httpx.URL, content: Any, follow_redirects: Any, others: Mapping[str, Any]) -> bool:
        """Whether httpx's path would add nothing to this call but its cost. A base URL only joins
        relative URLs; the client's cookies are none."""
        auth = others.get("auth", httpx.USE_CLIENT_DEFAULT)
        return (
            url.is_absolute_url
            and not url.query
            and (content is None or isinstance(content, bytes))
            and all(value is None for name, value in others.items() if name != "auth")
            and auth is httpx.USE_CLIENT_DEFAULT
            and self.auth is None
            and follow_redirects in (httpx.USE_CLIENT_DEFAULT, False)
            and not self.follow_redirects
            and not any(self.event_hooks.values())
        )

    @property
    def cookies(self) -> httpx.Cookies:
        return self._kept_no_cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        """Nothing to set: the client sends no cookies (a call may still pass its own)."""


@functools.lru_cache(maxsize=1024)
def endpoint(url: str) -> httpx.URL:
    """`url` parsed once: httpx parses a str URL again on every call (about 40 us here). For the fixed
    endpoints of the platform and provider clients (a URL may hold a token: kept in memory only)."""
    return httpx.URL(url)


def http_client(timeout: float, max_connections: int = 100) -> httpx.AsyncClient:
    """`max_connections`: open at once, across hosts (a call beyond waits for one to free up)."""
    limits = httpx.Limits(max_connections=max_connections)
    return _Client(transport=_Transport(limits=limits), timeout=timeout)
