"""The session admin API under /api: sessions and the inbox, as JSON, for operators and the console.

Every route checks, in order: GATEWAY_ADMIN_TOKEN unset 404 (`admin_disabled`, the body names the
setting); the client's address locked out after 10 wrong tokens in a minute 429 with Retry-After
(gateway.web.throttle); `Authorization: Bearer <token>` missing or wrong 401 (compared in constant
time); body over 64 KiB 413, not in full by its deadline 408; body not JSON 400; a parameter or
body field of the wrong type or value, or a query parameter the route does not know, 422. Then:
unknown session or inbox row 404, a taken session id or a retry of a row that is not dead 409, the
database not answering 503. Every answer is JSON (a 204 has no body); nothing a client sends gives a
500. The OpenAPI document of all this is `gateway.web.openapi`.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.domain import sessions as session_rules
from gateway.domain.sessions import Cursor, SessionSummary
from gateway.domain.usage import Price
from gateway.store import inbox, sessions
from gateway.store.database import UNAVAILABLE_ERRORS, Database
from gateway.store.sessions import SessionExistsError
from gateway.web import openapi
from gateway.web.bodies import BodyRefused, read_limited
from gateway.web.errors import error_response, request_id_of
from gateway.web.throttle import FailureThrottle

log = structlog.get_logger(__name__)

ADMIN_TOKEN_SETTING = "GATEWAY_ADMIN_TOKEN"
MAX_ADMIN_BODY_BYTES = 64 * 1024
_DIGITS = re.compile(r"[0-9]{1,19}")


@dataclass(frozen=True)
class Admin:
    """What the admin routes need, built by the app's lifespan."""

    token: str | None  # None: the admin API (and the console) are disabled
    starting_agent: str | None = None  # the agent a session created here starts with
    max_body_bytes: int = MAX_ADMIN_BODY_BYTES
    on_pending: Callable[[], None] = lambda: None  # wakes the worker when a retried row is due
    throttle: FailureThrottle = field(default_factory=FailureThrottle)  # wrong tokens, per address
    prices: Mapping[str, Price] = field(default_factory=dict)  # GATEWAY_MODEL_PRICES, by model spec

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def refuse(self, request: Request) -> Response | None:
        """None when the request may go on; else the 404 (disabled), 429 (its address is locked out
        after too many wrong tokens, see gateway.web.throttle) or 401 (no or wrong token)."""
        rid = request_id_of(request)
        if self.token is None:
            detail = f"the admin API is disabled: set {ADMIN_TOKEN_SETTING} to enable it"
            return error_response(404, "admin_disabled", rid, detail=detail)
        client = request.client.host if request.client else "unknown"
        wait = self.throttle.retry_after(client)
        if wait is not None:
            seconds = math.ceil(wait)
            detail = f"too many wrong tokens from this address; retry in {seconds} s"
            headers = {"Retry-After": str(seconds)}
            return error_response(429, "too_many_failures", rid, headers=headers, detail=detail)
        given = _bearer_token(request)
        # Compared as bytes in constant time; a header is latin-1, so any value encodes.
        if given is None or not hmac.compare_digest(given.encode("latin-1"), self.token.encode()):
            reason = "missing" if given is None else "wrong_token"
            if self.throttle.failed(client):
                throttle = self.throttle
                log.warning(
                    "admin_throttled", client=client, failures=throttle.max_failures, seconds=throttle.window
                )
            else:
                log.warning("admin_unauthorized", reason=reason)
            return error_response(
                401,
                "unauthorized",
                rid,
                headers={"WWW-Authenticate": 'Bearer realm="gateway-admin"'},
                detail="missing or wrong bearer token",
            )
        self.throttle.succeeded(client)
        return None


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class _Rejected(Exception):
    """A 4xx answer decided while reading the request; never echoes client text unescaped."""

    def __init__(
        self,
        http_status: int,
        error: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.http_status, self.error, self.detail, self.extra = http_status, error, detail, extra
        self.headers = headers


def _invalid(detail: str) -> _Rejected:
    return _Rejected(422, "invalid_request", detail)


Handler = Callable[[Request, Admin, Database], Awaitable[Response]]


def _admin(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The checks every admin route starts with, and the mapping of its refusals to answers."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        admin: Admin = request.state.admin
        refused = admin.refuse(request)
        if refused is not None:
            return refused
        rid = request_id_of(request)
        try:
            return await handler(request, admin, request.state.database)
        except _Rejected as exc:
            return error_response(
                exc.http_status, exc.error, rid, headers=exc.headers, detail=exc.detail, **exc.extra
            )
        except UNAVAILABLE_ERRORS as exc:
            log.warning("admin_database_unavailable", error=type(exc).__name__)
            return error_response(
                503, "database_unavailable", rid, detail="the database did not answer; try again"
            )

    return endpoint


# --- reading requests ------------------------------------------------------------------------------
def _param(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise _invalid(f"{name} is given more than once")
    return values[0] if values else None


def _only_params(request: Request, known: set[str]) -> None:
    """Refuse a query parameter the route does not know (an empty name too): `?stauts=dead` must not
    list every row."""
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        raise _invalid(f"unknown parameter {unknown[0][:40]!r}; known: {', '.join(sorted(known)) or 'none'}")


def _limit(request: Request) -> int:
    raw = _param(request, "limit")
    if raw is None:
        return session_rules.DEFAULT_PAGE_SIZE
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= session_rules.MAX_PAGE_SIZE:
        raise _invalid(f"limit must be an integer from 1 to {session_rules.MAX_PAGE_SIZE}")
    return int(raw)


async def _json_object(request: Request, admin: Admin, fields: set[str]) -> dict[str, Any]:
    """The body as a JSON object with only `fields`; an empty body is `{}`."""
    body = await read_limited(request.scope, request.receive, admin.max_body_bytes)
    if isinstance(body, BodyRefused):
        raise _Rejected(body.status, body.error, body.detail, headers=body.headers)
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _Rejected(400, "invalid_json", "the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise _invalid("the body must be a JSON object")
    unknown = sorted(set(data) - fields)
    if unknown:
        raise _invalid(f"unknown field {unknown[0][:40]!r}; known: {', '.join(sorted(fields))}")
    return data


def _title(data: dict[str, Any]) -> str:
    title = data["title"]
    if not isinstance(title, str):
        raise _invalid("title must be a string")
    try:
        return session_rules.clean_title(title)
    except ValueError as exc:
        raise _invalid(str(exc)) from None


# --- answers ---------------------------------------------------------------------------------------
def _session_item(session: SessionSummary) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "title": session.title,
        "platform": session.platform,
        "active_agent": session.active_agent,
        "created_at": session.created_at.isoformat(),
        "updated_at": session.updated_at.isoformat(),
        "message_count": session.message_count,
    }


def _inbox_item(item: inbox.InboxItem) -> dict[str, Any]:
    return {
        "id": item.id,
        "platform": item.platform,
        "session_id": item.session_id,
        "kind": item.kind,
        "status": item.status,
        "attempts": item.attempts,
        "text": item.text,
        "last_error": item.last_error,
        "received_at": item.received_at.isoformat(),
    }


def _no_session() -> _Rejected:
    return _Rejected(404, "not_found", "no session with that id")


# --- routes ----------------------------------------------------------------------------------------
@_admin
async def sessions_collection(request: Request, admin: Admin, database: Database) -> Response:
    if request.method == "POST":
        _only_params(request, set())
        return await _create(request, admin, database)
    _only_params(request, {"limit", "cursor", "platform", "q"})
    limit = _limit(request)
    cursor = _param(request, "cursor")
    after = None
    if cursor is not None:
        try:
            after = Cursor.decode(cursor)
        except ValueError:
            raise _Rejected(422, "invalid_cursor", "cursor is not a next_cursor of this API") from None
    platform = _param(request, "platform")
    if platform is not None and not session_rules.is_valid_platform(platform):
        raise _invalid("platform must be 1-32 characters of A-Z a-z 0-9 _ -")
    query = _param(request, "q")
    if query is not None and not session_rules.is_valid_query(query):
        raise _invalid(f"q must be at most {session_rules.MAX_QUERY_LENGTH} characters, none of them control")
    page = await sessions.list_sessions(database, limit=limit, after=after, platform=platform, query=query)
    return JSONResponse(
        {
            "sessions": [_session_item(s) for s in page.sessions],
            "next_cursor": None if page.next_cursor is None else page.next_cursor.encode(),
        }
    )


async def _create(request: Request, admin: Admin, database: Database) -> Response:
    data = await _json_object(request, admin, {"session_id", "title"})
    session_id = data.get("session_id")
    if "session_id" in data and not (
        isinstance(session_id, str) and session_rules.is_valid_session_id(session_id)
    ):
        raise _invalid(
            f"session_id must be a string of 1-{session_rules.MAX_SESSION_ID_LENGTH} characters,"
            " none of them control"
        )
    title = _title(data) if "title" in data else None
    try:
        created = await sessions.create_session(database, session_id, title, admin.starting_agent)
    except SessionExistsError:
        raise _Rejected(409, "session_exists", "a session with that id already exists") from None
    log.info("session_created", session_id=created.session_id)
    location = f"/api/sessions/{quote(created.session_id, safe='')}"
    return JSONResponse(_session_item(created), status_code=201, headers={"Location": location})


@_admin
async def session_resource(request: Request, admin: Admin, database: Database) -> Response:
    session_id: str = request.path_params["session_id"]
    _only_params(request, set())
    if request.method == "PUT":
        data = await _json_object(request, admin, {"title"})
        if "title" not in data:
            raise _invalid("title is required")
        renamed = await sessions.rename_session(database, session_id, _title(data))
        if renamed is None:
            raise _no_session()
        log.info("session_renamed", session_id=session_id)
        return JSONResponse(_session_item(renamed))
    if request.method == "DELETE":
        if await sessions.delete_session(database, session_id):
            log.info("session_deleted", session_id=session_id)
        return Response(status_code=204)
    detail = await sessions.get_session(database, session_id)
    if detail is None:
        raise _no_session()
    item = _session_item(detail.session)
    item["metadata"] = detail.metadata
    item["messages"] = [
        {
            "role": m.role,
            "content": m.content,
            "tool_calls": m.tool_calls,
            "tool_call_id": m.tool_call_id,
            "agent_name": m.agent_name,
            "created_at": m.created_at.isoformat(),
        }
        for m in detail.messages
    ]
    return JSONResponse(item)


@_admin
async def inbox_collection(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, {"status", "limit"})
    status = _param(request, "status")
    if status is not None and status not in inbox.STATUSES:
        raise _invalid(f"status must be one of {', '.join(inbox.STATUSES)}")
    items = await inbox.list_items(database, status, _limit(request))
    return JSONResponse({"items": [_inbox_item(item) for item in items]})


@_admin
async def inbox_retry(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, set())
    raw: str = request.path_params["inbox_id"]
    inbox_id = int(raw) if _DIGITS.fullmatch(raw) else 0
    requeued = await inbox.requeue(database, inbox_id)
    if requeued is None:
        current = await inbox.get_item(database, inbox_id)
        if current is None:
            raise _Rejected(404, "not_found", "no inbox row with that id")
        detail = f"only a dead row can be retried; this one is {current.status}"
        raise _Rejected(409, "not_dead", detail, inbox_status=current.status)
    log.info("inbox_retried", inbox_id=inbox_id)
    admin.on_pending()
    return JSONResponse(_inbox_item(requeued))


@_admin
async def openapi_document(request: Request, admin: Admin, database: Database) -> Response:
    return JSONResponse(openapi.document())


def routes() -> list[Route]:
    """The admin routes, for the app's route list."""
    return [
        Route("/api/openapi.json", openapi_document, methods=["GET"]),
        Route("/api/sessions", sessions_collection, methods=["GET", "POST"]),
        Route("/api/sessions/{session_id:path}", session_resource, methods=["GET", "PUT", "DELETE"]),
        Route("/api/inbox", inbox_collection, methods=["GET"]),
        Route("/api/inbox/{inbox_id}/retry", inbox_retry, methods=["POST"]),
    ]
