"""The admin API's usage routes: what the turns' model calls cost, per UTC day and per session.

`GET /api/usage?days=N` adds up the turns of the last N UTC days (today included; 1 to 366, default
30) per day and model; `GET /api/usage/sessions/{id}` a session's turns per model. With
GATEWAY_MODEL_PRICES each total carries an estimated cost in US dollars. The routes sit on admin.py's
guard (token, errors, 503) and follow its rules; an unknown query parameter is 422.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.domain.messages import utcnow
from gateway.domain.usage import estimated_cost
from gateway.store import usage
from gateway.store.database import Database
from gateway.web.admin import _DIGITS, Admin, _admin, _invalid, _only_params, _param
from gateway.web.openapi_usage import DEFAULT_DAYS, MAX_DAYS


def _totals(admin: Admin, totals: usage.Totals) -> dict[str, Any]:
    item: dict[str, Any] = {} if totals.day is None else {"day": totals.day}
    item.update(
        model=totals.model,
        turns=totals.turns,
        calls=totals.calls,
        input_tokens=totals.input_tokens,
        output_tokens=totals.output_tokens,
        latency_ms=totals.latency_ms,
        tool_calls=totals.tool_calls,
        estimated_cost_usd=estimated_cost(
            admin.prices, totals.model, totals.input_tokens, totals.output_tokens
        ),
    )
    return item


@_admin
async def daily_usage(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, {"days"})
    raw = _param(request, "days")
    if raw is not None and (not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_DAYS):
        raise _invalid(f"days must be an integer from 1 to {MAX_DAYS}")
    days = DEFAULT_DAYS if raw is None else int(raw)
    since = (utcnow() - timedelta(days=days - 1)).date().isoformat()
    return JSONResponse({"items": [_totals(admin, t) for t in await usage.daily_totals(database, since)]})


@_admin
async def session_usage(request: Request, admin: Admin, database: Database) -> Response:
    _only_params(request, set())
    session_id: str = request.path_params["session_id"]
    totals = await usage.session_totals(database, session_id)
    return JSONResponse({"session_id": session_id, "models": [_totals(admin, t) for t in totals]})


def routes() -> list[Route]:
    """The usage routes, for the app's route list beside admin.routes()."""
    return [
        Route("/api/usage", daily_usage, methods=["GET"]),
        Route("/api/usage/sessions/{session_id:path}", session_usage, methods=["GET"]),
    ]
