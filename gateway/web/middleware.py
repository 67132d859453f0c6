"""Per-request context: request id, access log, metrics, and the last line of defence for errors.

A pure ASGI middleware (no BaseHTTPMiddleware), so streaming and background work are untouched.
"""

from __future__ import annotations

import re
import time
import uuid

import structlog
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.web.errors import REQUEST_ID_HEADER, internal_error_response
from gateway.web.metrics import HttpMetrics

log = structlog.get_logger("gateway.http")
# A caller's id is reused only when it is short and plain, so it cannot forge log content.
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
UNMATCHED_ROUTE = "<unmatched>"


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            candidate: str = value.decode("latin-1")
            if _SAFE_REQUEST_ID.match(candidate):
                return candidate
    return uuid.uuid4().hex


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
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
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
                log.info(
                    "request_finished",
                    method=scope["method"],
                    path=scope["path"],
                    route=route,
                    status=status,
                    duration_ms=round(seconds * 1000, 2),
                )
