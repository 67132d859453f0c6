"""Per-request context: request id, access log, metrics, and the last line of defence for errors.

A pure ASGI middleware (no BaseHTTPMiddleware), so streaming and background work are untouched. It
runs on every request, webhooks at thousands per second among them, so it keeps its own cost down:
the request id is bound with one context variable (no context manager), the response header is
added to the raw header list, and the access log event is not even built below its level.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.logs import will_log
from gateway.web.errors import REQUEST_ID_HEADER, internal_error_response
from gateway.web.metrics import HttpMetrics

ACCESS_LOGGER = "gateway.http"
log = structlog.get_logger(ACCESS_LOGGER)
_access = logging.getLogger(ACCESS_LOGGER)
# A caller's id is reused only when it is short and plain, so it cannot forge log content.
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
UNMATCHED_ROUTE = "<unmatched>"
_REQUEST_ID_NAME = REQUEST_ID_HEADER.lower().encode("latin-1")


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            candidate: str = value.decode("latin-1")
            if _SAFE_REQUEST_ID.match(candidate):
                return candidate
    return uuid.uuid4().hex


def _set_request_id(message: Message, value: bytes) -> None:
    """Put X-Request-ID on a response start message, replacing any the app set."""
    headers = [(name, v) for name, v in message.get("headers", ()) if name.lower() != _REQUEST_ID_NAME]
    headers.append((_REQUEST_ID_NAME, value))
    message["headers"] = headers


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        header_value = request_id.encode("latin-1")
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                _set_request_id(message, header_value)
            await send(message)

        tokens = structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request_failed", method=scope["method"], path=scope["path"])
            if response_started:
                raise
            await internal_error_response(request_id)(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", UNMATCHED_ROUTE)
            self.metrics.observe(scope["method"], route, status, seconds)
            if will_log(_access, logging.INFO):
                log.info(
                    "request_finished",
                    method=scope["method"],
                    path=scope["path"],
                    route=route,
                    status=status,
                    duration_ms=round(seconds * 1000, 2),
                )
            structlog.contextvars.reset_contextvars(**tokens)
