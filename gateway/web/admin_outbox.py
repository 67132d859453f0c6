"""The admin API's outbox routes: replies that were not delivered, and sending them again.

`GET /api/outbox` lists rows newest first (`status=dead` is the view of replies given up on after an
outage, `failed` those the platform refused); `POST /api/outbox/{id}/retry` requeues a dead or failed
one and wakes delivery, so it goes out now rather than at the next poll. A row never carries the
reply's text: that is in the session's transcript. The routes sit on admin.py's guard (token, errors,
503) and request helpers, and follow its rules (see its docstring: an unknown query parameter is 422,
so a typo cannot widen the list); a retry of any other row is `409 not_retryable` with `outbox_status`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.store import outbox
from gateway.store.database import Database
from gateway.store.outbox import OutboxItem
from gateway.web.admin import _DIGITS, Admin, _admin, _invalid, _limit, _only_params, _param, _Rejected

log = structlog.get_logger(__name__)

# The lifespan state's key for delivery's wake (Admin.on_pending wakes the inbox worker).
WAKE_DELIVERY = "wake_delivery"


def outbox_item(item: OutboxItem) -> dict[str, Any]:
    return {
        "id": item.id,
        "inbox_id": item.inbox_id,
        "platform": item.platform,
        "session_id": item.session_id,
        "kind": item.kind,
        "status": item.status,
        "attempts": item.attempts,
        "error_code": item.error_code,
        "error_message": item.error_message,
        "created_at": item.created_at.isoformat(),
        "updated_at": item.updated_at.isoformat(),
        "next_attempt_at": item.next_attempt_at.isoformat(),
        "retry_until": None if item.retry_until is None else item.retry_until.isoformat(),
    }


def _no_row() -> _Rejected:
    return _Rejected(404, "not_found", "no outbox row with that id")


@_admin
async def outbox_collection(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, {"status", "limit"})
    status = _param(request, "status")
    if status is not None and status not in outbox.STATUSES:
        raise _invalid(f"status must be one of {', '.join(outbox.STATUSES)}")
    items = await outbox.list_items(database, status, _limit(request))
    return JSONResponse({"items": [outbox_item(item) for item in items]})


@_admin
async def outbox_retry(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, set())
    raw: str = request.path_params["outbox_id"]
    outbox_id = int(raw) if _DIGITS.fullmatch(raw) else 0
    requeued = await outbox.requeue(database, outbox_id)
    if requeued is None:
        current = await outbox.get_item(database, outbox_id)
        if current is None:
            raise _no_row()
        detail = f"only a dead or failed row can be retried; this one is {current.status}"
        raise _Rejected(409, "not_retryable", detail, outbox_status=current.status)
    log.info("outbox_retried", outbox_id=outbox_id, platform=requeued.platform)
    wake: Callable[[], None] = getattr(request.state, WAKE_DELIVERY)
    wake()
    return JSONResponse(outbox_item(requeued))


def routes() -> list[Route]:
    """The outbox routes, for the app's route list beside admin.routes()."""
    return [
        Route("/api/outbox", outbox_collection, methods=["GET"]),
        Route("/api/outbox/{outbox_id}/retry", outbox_retry, methods=["POST"]),
    ]
