"""The HTTP client of every outbound call: platforms, model providers and the CLI.

It is httpx's API on aiohttp's transport (the httpx-aiohttp package): with 16 calls in flight,
httpcore's own transport cost about 0.75 ms of CPU per call here and aiohttp's about 0.19 ms, and
delivery makes one call per reply. Proxies from the environment still go through httpcore.

The client keeps no cookies: the Bot API, the Graph API and the model providers are stateless, so a
Set-Cookie from one of them is not carried into later calls (nor from one host to another), and
skipping httpx's cookie extraction saves about 0.1 ms of CPU per call (measured 97 us of the ~0.5
ms a call costs here, in a profile of turns at model latency).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport


class _Transport(AiohttpTransport):
    """httpx-aiohttp reports every aiohttp connection error as `ConnectTimeout` (its broad
    ClientConnectionError entry wins over the specific ones); a refused or dropped connection is
    a `ConnectError` here, as httpcore reports it, and only real timeouts stay timeouts."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.ConnectTimeout as exc:
            cause = exc.__cause__
            timed_out = isinstance(cause, asyncio.TimeoutError)
            if isinstance(cause, aiohttp.ClientConnectionError) and not timed_out:
                raise httpx.ConnectError(str(exc), request=request) from cause
            raise


class _NoCookies(httpx.Cookies):
    """A cookie jar that never takes a cookie from a response."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _Client(httpx.AsyncClient):
    """httpx's client, without its cookie jar (see the module's docstring)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._kept_no_cookies = _NoCookies()

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
