"""The one mapping from errors to HTTP answers: every error body is JSON and carries the request id."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

REQUEST_ID_HEADER = "X-Request-ID"


def error_response(
    status: int, error: str, request_id: str | None, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"error": error, "request_id": request_id, **extra}
    all_headers = {**(headers or {}), **({REQUEST_ID_HEADER: request_id} if request_id else {})}
    return JSONResponse(body, status_code=status, headers=all_headers)


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """404 for unknown routes, 405 for wrong methods, and any HTTPException a route raises."""
    assert isinstance(exc, HTTPException)
    error = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    response = error_response(exc.status_code, error, request_id_of(request), detail=exc.detail)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def internal_error_response(request_id: str | None) -> JSONResponse:
    return error_response(500, "internal_error", request_id, detail="unexpected error; see the logs")


EXCEPTION_HANDLERS = {HTTPException: http_exception_handler}
