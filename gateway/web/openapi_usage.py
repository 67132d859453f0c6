"""The usage routes' part of the admin API's OpenAPI document (merged by gateway.web.openapi)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_DAYS = 366
DEFAULT_DAYS = 30

_COUNT = {"type": "integer", "minimum": 0}
_TOTALS = {
    "model": {"type": "string", "example": "openai:gpt-4o-mini"},
    "turns": _COUNT,
    "calls": _COUNT,
    "input_tokens": _COUNT,
    "output_tokens": _COUNT,
    "latency_ms": {**_COUNT, "description": "The model calls' time, added up."},
    "tool_calls": _COUNT,
    "estimated_cost_usd": {
        "type": "number",
        "nullable": True,
        "description": "By GATEWAY_MODEL_PRICES; null for a model it does not price.",
    },
}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


SCHEMAS: dict[str, Any] = {
    "UsageTotals": _object(_TOTALS),
    "DailyUsage": _object({"day": {"type": "string", "format": "date"}, **_TOTALS}),
    "SessionUsage": _object(
        {
            "session_id": {"type": "string"},
            "models": {"type": "array", "items": {"$ref": "#/components/schemas/UsageTotals"}},
        }
    ),
    "UsagePage": _object({"items": {"type": "array", "items": {"$ref": "#/components/schemas/DailyUsage"}}}),
}


def paths(
    responses: Callable[..., dict[str, Any]],
    json: Callable[[dict[str, Any], str], dict[str, Any]],
    session_id: dict[str, Any],
) -> dict[str, Any]:
    """The usage paths, built with openapi.py's helpers (its error answers, its session id parameter)."""
    days = {
        "name": "days",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_DAYS, "default": DEFAULT_DAYS},
        "description": "How many UTC days back, today included.",
    }
    return {
        "/api/usage": {
            "get": {
                "operationId": "dailyUsage",
                "summary": "Model usage per UTC day and model, newest day first",
                "parameters": [days],
                "responses": responses(
                    {"200": json({"$ref": "#/components/schemas/UsagePage"}, "The totals.")}, 422
                ),
            }
        },
        "/api/usage/sessions/{session_id}": {
            "get": {
                "operationId": "sessionUsage",
                "summary": "A session's model usage per model (empty for a session without turns)",
                "parameters": [session_id],
                "responses": responses(
                    {"200": json({"$ref": "#/components/schemas/SessionUsage"}, "The totals.")}
                ),
            }
        },
    }
