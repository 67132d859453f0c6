"""The OpenAPI 3 document of the admin API, served at /api/openapi.json.

Built by hand as one dict (no docstring parsing, no YAML): the limits and patterns come from the
modules that enforce them, so the document and the checks cannot drift apart, and a schemathesis
test holds every answer to it.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from gateway.domain import sessions as session_rules
from gateway.store import inbox, outbox
from gateway.store.tables import MAX_ID
from gateway.web import openapi_usage

BEARER = "bearerAuth"
_JSON = "application/json"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


_STRING = {"type": "string"}
_DATETIME = {"type": "string", "format": "date-time"}

_ERRORS = {
    400: "The body is not valid JSON (`invalid_json`).",
    401: "Missing or wrong bearer token (`unauthorized`).",
    404: "Not found; also every route while GATEWAY_ADMIN_TOKEN is unset (`admin_disabled`).",
    409: "Conflict with the current state.",
    413: "The body is over 64 KiB (`payload_too_large`).",
    422: "A parameter or the body is invalid (`invalid_request`, `invalid_cursor`).",
    429: "Too many wrong tokens from this address (`too_many_failures`); retry after Retry-After seconds.",
    503: "The database did not answer (`database_unavailable`); try again.",
}

_SESSION_FIELDS: dict[str, Any] = {
    "session_id": {**_STRING, "example": "telegram:42"},
    "title": _nullable({**_STRING, "description": "From the first user message unless renamed."}),
    "platform": _nullable(
        {**_STRING, "description": "The session id's prefix before its first ':'; null without one."}
    ),
    "active_agent": _nullable({**_STRING, "description": "The agent answering the next message."}),
    "created_at": _DATETIME,
    "updated_at": _DATETIME,
    "message_count": {"type": "integer", "minimum": 0},
}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "properties": {
            "error": {**_STRING, "description": "A stable code, e.g. `not_found`, `invalid_request`."},
            "request_id": _nullable({**_STRING, "description": "Also in the X-Request-ID header."}),
            "detail": {"description": "What was wrong, for humans."},
            "inbox_status": {**_STRING, "description": "On 409 from an inbox retry: the row's status."},
            "outbox_status": {**_STRING, "description": "On 409 from an outbox retry: the row's status."},
        },
        "required": ["error", "request_id"],
    },
    "Session": _object(_SESSION_FIELDS),
    "ToolCall": _object(
        {"id": _STRING, "name": _STRING, "arguments": {"type": "object", "additionalProperties": True}}
    ),
    "Message": _object(
        {
            "role": {**_STRING, "description": "system, user, model or tool."},
            "content": _nullable(_STRING),
            "tool_calls": {"type": "array", "items": _ref("ToolCall")},
            "tool_call_id": _nullable({**_STRING, "description": "On a tool message: the call it answers."}),
            "agent_name": _nullable(
                {**_STRING, "description": "On a model message: the agent that wrote it."}
            ),
            "created_at": _DATETIME,
        }
    ),
    "SessionDetail": _object(
        {
            **_SESSION_FIELDS,
            "metadata": {"type": "object", "additionalProperties": True},
            "messages": {
                "type": "array",
                "items": _ref("Message"),
                "description": "The kept messages (older turns are pruned), oldest first.",
            },
        }
    ),
    "SessionPage": _object(
        {
            "sessions": {"type": "array", "items": _ref("Session")},
            "next_cursor": _nullable(
                {**_STRING, "description": "Pass as `cursor` for the next page; null on the last page."}
            ),
        }
    ),
    "SessionCreate": _object(
        {
            "session_id": {
                **_STRING,
                "minLength": 1,
                "maxLength": session_rules.MAX_SESSION_ID_LENGTH,
                "pattern": session_rules.SESSION_ID_PATTERN,
                "description": "Default: a new UUID. No control characters.",
            },
            "title": {
                **_STRING,
                "maxLength": session_rules.MAX_TITLE_LENGTH,
                "pattern": session_rules.TITLE_PATTERN,
                "description": "Stored stripped of surrounding spaces. Default: from the first message.",
            },
        },
        required=[],
    ),
    "SessionRename": _object(
        {
            "title": {
                **_STRING,
                "maxLength": session_rules.MAX_TITLE_LENGTH,
                "pattern": session_rules.TITLE_PATTERN,
                "description": "Not empty after stripping spaces; no control characters.",
            }
        }
    ),
    "InboxItem": _object(
        {
            "id": {"type": "integer", "minimum": 1},
            "platform": _STRING,
            "session_id": _STRING,
            "kind": _STRING,
            "status": {**_STRING, "enum": list(inbox.STATUSES)},
            "attempts": {"type": "integer", "minimum": 0},
            "text": _nullable(_STRING),
            "last_error": _nullable(_STRING),
            "received_at": _DATETIME,
        }
    ),
    "InboxPage": _object({"items": {"type": "array", "items": _ref("InboxItem")}}),
    "OutboxItem": _object(
        {
            "id": {"type": "integer", "minimum": 1},
            "inbox_id": _nullable({"type": "integer", "description": "The message whose turn wrote it."}),
            "platform": _STRING,
            "session_id": _STRING,
            "kind": {**_STRING, "description": "text, answer_callback."},
            "status": {**_STRING, "enum": list(outbox.STATUSES)},
            "attempts": {"type": "integer", "minimum": 0},
            "error_code": _nullable({**_STRING, "description": "The platform's code, or e.g. `network`."}),
            "error_message": _nullable(_STRING),
            "created_at": _DATETIME,
            "updated_at": _DATETIME,
            "next_attempt_at": _DATETIME,
            "retry_until": _nullable(
                {**_DATETIME, "description": "Transient failures are retried until then; dead after it."}
            ),
        }
    ),
    "OutboxPage": _object({"items": {"type": "array", "items": _ref("OutboxItem")}}),
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _responses(success: dict[str, Any], *errors: int) -> dict[str, Any]:
    answers = dict(success)
    for status in (401, 404, *errors, 429, 503):
        answers[str(status)] = _json(_ref("Error"), _ERRORS[status])
    return answers


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_LIMIT = _query(
    "limit",
    {
        "type": "integer",
        "minimum": 1,
        "maximum": session_rules.MAX_PAGE_SIZE,
        "default": session_rules.DEFAULT_PAGE_SIZE,
    },
    "Items per page.",
)
_SESSION_ID = {
    "name": "session_id",
    "in": "path",
    "required": True,
    "schema": _STRING,
    "example": "telegram:42",
    "description": "Percent-encoded; may hold ':', '/' and any Unicode.",
}
_BODY_LIMIT = "Bodies over 64 KiB are refused (413)."


def _body(schema: str, required: bool) -> dict[str, Any]:
    return {"required": required, "content": {_JSON: {"schema": _ref(schema)}}, "description": _BODY_LIMIT}


PATHS: dict[str, Any] = {
    "/api/sessions": {
        "get": {
            "operationId": "listSessions",
            "summary": "Sessions, newest updated_at first, in pages",
            "parameters": [
                _LIMIT,
                _query(
                    "cursor",
                    {"type": "string", "minLength": 1, "maxLength": session_rules.MAX_CURSOR_LENGTH},
                    "The `next_cursor` of the previous page (opaque).",
                ),
                _query(
                    "platform",
                    {"type": "string", "pattern": session_rules.PLATFORM_PATTERN},
                    "Only sessions whose id starts with `<platform>:`, e.g. telegram, whatsapp, cli.",
                ),
                _query(
                    "q",
                    {
                        "type": "string",
                        "maxLength": session_rules.MAX_QUERY_LENGTH,
                        "pattern": session_rules.QUERY_PATTERN,
                    },
                    "Only sessions whose title contains this text, ignoring case (% and _ are literal).",
                ),
            ],
            "responses": _responses(
                {"200": _json(_ref("SessionPage"), "One page of sessions (no messages).")}, 422
            ),
        },
        "post": {
            "operationId": "createSession",
            "summary": "Create an empty session",
            "requestBody": _body("SessionCreate", required=False),
            "responses": _responses(
                {
                    "201": {
                        **_json(_ref("Session"), "Created."),
                        "headers": {"Location": {"description": "The session's URL.", "schema": _STRING}},
                    }
                },
                400,
                409,
                413,
                422,
            ),
        },
    },
    "/api/sessions/{session_id}": {
        "parameters": [_SESSION_ID],
        "get": {
            "operationId": "getSession",
            "summary": "A session with its metadata and messages",
            "responses": _responses({"200": _json(_ref("SessionDetail"), "The session.")}),
        },
        "put": {
            "operationId": "renameSession",
            "summary": "Rename a session (moves updated_at forward)",
            "requestBody": _body("SessionRename", required=True),
            "responses": _responses({"200": _json(_ref("Session"), "Renamed.")}, 400, 413, 422),
        },
        "delete": {
            "operationId": "deleteSession",
            "summary": "Delete a session and its messages (204 also when it was already gone)",
            "description": "A turn running on the session fails and writes nothing.",
            "responses": _responses({"204": {"description": "Deleted, or there was no such session."}}),
        },
    },
    "/api/inbox": {
        "get": {
            "operationId": "listInbox",
            "summary": "Inbox rows (messages the webhooks accepted), newest first",
            "parameters": [
                _query(
                    "status", {"type": "string", "enum": list(inbox.STATUSES)}, "Only rows with this status."
                ),
                _LIMIT,
            ],
            "responses": _responses({"200": _json(_ref("InboxPage"), "The rows.")}, 422),
        }
    },
    "/api/inbox/{inbox_id}/retry": {
        "post": {
            "operationId": "retryInbox",
            "summary": "Requeue a dead inbox row (fresh attempts)",
            "parameters": [
                {
                    "name": "inbox_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                }
            ],
            "responses": _responses(
                {"200": _json(_ref("InboxItem"), "Requeued: the row, now pending.")},
                409,
            ),
        }
    },
    "/api/outbox": {
        "get": {
            "operationId": "listOutbox",
            "summary": "Outbox rows (replies and their delivery), newest first; no reply text",
            "parameters": [
                _query(
                    "status",
                    {"type": "string", "enum": list(outbox.STATUSES)},
                    "Only rows with this status: `dead` (out of retry budget), `failed` (refused for good).",
                ),
                _LIMIT,
            ],
            "responses": _responses({"200": _json(_ref("OutboxPage"), "The rows.")}, 422),
        }
    },
    "/api/outbox/{outbox_id}/retry": {
        "post": {
            "operationId": "retryOutbox",
            "summary": "Send a dead or failed reply again (fresh attempts and retry budget)",
            "parameters": [
                {
                    "name": "outbox_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                }
            ],
            "responses": _responses(
                {"200": _json(_ref("OutboxItem"), "Requeued: the row, now pending.")},
                409,
            ),
        }
    },
    "/api/openapi.json": {
        "get": {
            "operationId": "openapi",
            "summary": "This document",
            "responses": _responses(
                {"200": _json({"type": "object", "additionalProperties": True}, "OpenAPI 3.0 document.")}
            ),
        }
    },
}

PATHS.update(openapi_usage.paths(_responses, _json, _SESSION_ID))
SCHEMAS.update(openapi_usage.SCHEMAS)

_DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "chatflow-gateway admin API",
        "version": "1",
        "description": (
            "Sessions, the inbox, the outbox and model usage of a chatflow-gateway. Every route needs "
            "`Authorization: Bearer <GATEWAY_ADMIN_TOKEN>`; without that setting the API answers 404. "
            "Errors are JSON objects with `error` (a stable code), `request_id` and `detail`."
        ),
    },
    "security": [{BEARER: []}],
    "paths": PATHS,
    "components": {
        "schemas": SCHEMAS,
        "securitySchemes": {BEARER: {"type": "http", "scheme": "bearer"}},
    },
}


def document() -> dict[str, Any]:
    """A fresh copy, so no caller can change what the next one gets."""
    return deepcopy(_DOCUMENT)
