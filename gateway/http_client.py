"""The HTTP client of every outbound call: platforms, model providers and the CLI.

It is httpx's API on aiohttp: with 16 calls in flight, httpcore's own transport cost about 0.75 ms of
CPU per call here and aiohttp's about 0.19 ms, and delivery makes one call per reply. aiohttp's
session comes from httpx-aiohttp's transport; every request is sent and its answer read whole here.

A plain call (bytes or no body, headers, a timeout; no auth, redirect following, query, files or
event hooks) skips httpx's request building and its auth and redirect flows, and comes back as an
httpx.Response all the same: httpx's path cost about 140 us of CPU a call over aiohttp's own (290
against 150 us, 64 calls in flight on loopback), and a turn at model latency makes two calls (the
model, the reply). Any other call takes httpx's whole path to the same sender. Answers are read
whole (nothing here streams): a streamed httpx response would be read before it is handed back.

The client keeps no cookies: the Bot API, the Graph API and the model providers are stateless, so a
Set-Cookie from one of them is not carried into later calls (nor from one host to another), and
skipping httpx's cookie extraction saves about 0.1 ms of CPU per call.

Proxies come from the environment as httpx and curl take them (HTTPS_PROXY, HTTP_PROXY,
NO_PROXY), read when the client makes its first call; httpx itself ignores them once given a transport.
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.request
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import aiohttp
import httpx
from aiohttp.helpers import ProxyInfo, proxies_from_env
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AIOHTTP_EXC_MAP
from multidict import CIMultiDict


class _Transport(AiohttpTransport):
    """Sends every request through aiohttp (see the module's docstring)."""

    _proxies: dict[str, ProxyInfo] | None = None

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
        if not isinstance(self.client, aiohttp.ClientSession):
            self.client = self.get_client()
        if self._proxies is None:
            self._proxies = proxies_from_env()
        url = str(request.url)
        proxy = self._proxies.get(request.url.scheme) if self._proxies else None
        if proxy is not None and urllib.request.proxy_bypass(request.url.host):
            proxy = None
        started = time.perf_counter()
        try:
            async with self.client.request(
                request.method,
                url,
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
        response = httpx.Response(
            answer.status, headers=answer.raw_headers, content=body, request=request, extensions=extensions
        )
        response.elapsed = timedelta(seconds=time.perf_counter() - started)
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
        sent = CIMultiDict(self.headers.multi_items())  # the client's, as they are now
        if headers:
            sent.update(headers)
        waits = self.timeout if timeout is httpx.USE_CLIENT_DEFAULT else httpx.Timeout(timeout)
        return await self._sender.send(httpx.Request(method, target), sent, content, waits)

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
