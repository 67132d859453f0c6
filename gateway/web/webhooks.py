"""`/webhooks/{platform}`: verify, parse, store durably, acknowledge. Never waits for a model.

Answers, in order of checks: unknown or disabled platform 404 (a disabled one is reached only in
the local mode: a loopback client signing with the local key, see `gateway.platforms.local_key`);
body over the limit 413 (not read whole); bad signature or secret 401 (nothing stored); invalid
JSON or not an object 400; an update we do not act on 200; otherwise 200 once its dedup keys and
inbox rows are committed, or 503 if the database could not take them (the platform retries).
Nothing a client sends gives a 500.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.domain.inbound import DEFAULT_TURN_KINDS, MessageKind, starts_turn
from gateway.domain.text import without_lone_surrogates
from gateway.logs import will_log
from gateway.platforms.base import PlatformAdapter
from gateway.platforms.local_key import is_loopback
from gateway.platforms.registry import ENABLING_SETTING, PLATFORMS
from gateway.store.ingest import Ingest
from gateway.web.bodies import read_limited
from gateway.web.errors import error_response, request_id_of

log = structlog.get_logger(__name__)
_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Webhooks:
    """What the webhook routes need, built by the app's lifespan."""

    adapters: dict[str, PlatformAdapter]
    ingest: Ingest
    max_body_bytes: int
    whatsapp_verify_token: str | None
    local_adapters: dict[str, PlatformAdapter] = field(default_factory=dict)
    on_pending: Callable[[], None] = lambda: None  # wakes the worker when a turn is due
    turn_kinds: frozenset[MessageKind] = DEFAULT_TURN_KINDS


class WebhookReceiver:
    """POST /webhooks/{platform} as a plain ASGI app.

    It is the route platforms hit thousands of times a second, so it reads the raw ASGI messages and
    writes its 200 directly, with no Request or Response objects; `gateway.app` also routes to it
    ahead of Starlette's router. Errors are ordinary JSON error responses.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope["state"]
        outcome = await _receive(state["webhooks"], scope, receive, state.get("request_id"))
        if isinstance(outcome, bytes):
            await send({"type": "http.response.start", "status": 200, "headers": _json_headers(outcome)})
            await send({"type": "http.response.body", "body": outcome})
        else:
            await outcome(scope, receive, send)


def _json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]


async def _receive(webhooks: Webhooks, scope: Scope, receive: Receive, rid: str | None) -> bytes | Response:
    """The 200 body, or the error response."""
    platform = scope["path_params"]["platform"]
    adapter = webhooks.adapters.get(platform)
    local = adapter is None
    if adapter is None:
        client = scope.get("client")
        host = client[0] if client else None
        adapter = webhooks.local_adapters.get(platform) if is_loopback(host) else None
        if adapter is None:
            return _not_enabled(platform, rid)

    body = await read_limited(scope, receive, webhooks.max_body_bytes)
    if body is None:
        return error_response(
            413, "payload_too_large", rid, detail=f"body over {webhooks.max_body_bytes} bytes"
        )
    if not adapter.verify(Headers(scope=scope), body):
        if local:
            return _not_enabled(platform, rid)  # without the local key it stays disabled, also on loopback
        log.warning("webhook_rejected", platform=platform, reason="signature")
        return error_response(401, "unauthorized", rid, detail="missing or wrong signature")
    try:
        payload = _parse_json(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: too deep
        return error_response(400, "invalid_json", rid, detail="the body is not valid JSON")
    if not isinstance(payload, dict):
        return error_response(400, "invalid_json", rid, detail="the body is not a JSON object")

    parsed = adapter.parse(payload)
    if parsed.empty:
        log.info("webhook_ignored", platform=platform)
        return _IGNORED
    turns = [starts_turn(message, webhooks.turn_kinds) for message in parsed.messages]
    try:
        new = await webhooks.ingest.write(parsed, turns)
    except Exception as exc:  # its text may hold the values of the update: the type only
        items = len(parsed.messages) + len(parsed.statuses) + len(parsed.memberships)
        log.error("webhook_store_failed", platform=platform, items=items, error=type(exc).__name__)
        return error_response(503, "unavailable", rid, detail="could not store the update; retry later")
    accepted = sum(new)
    if any(is_new and turn for is_new, turn in zip(new, turns, strict=False)):
        webhooks.on_pending()
    if will_log(_logger, logging.INFO):  # skips building an event nobody sees, thousands of times a second
        log.info(
            "webhook_accepted",
            platform=platform,
            messages=len(parsed.messages),
            statuses=len(parsed.statuses),
            new=accepted,
            duplicates=len(new) - accepted,
        )
    return b'{"status":"accepted","new":%d,"duplicates":%d}' % (accepted, len(new) - accepted)


_IGNORED = b'{"status":"ignored"}'


def _parse_json(body: bytes) -> Any:
    """orjson, a third of json.loads' time; json.loads for what orjson refuses and the standard library
    reads (integers over 64 bits, NaN, a lone surrogate escape, UTF-16 bodies), so both accept the same.

    Only json.loads lets half of a UTF-16 pair ("\\ud83d") through, as a string no UTF-8 database or
    platform API takes: its result has them replaced by U+FFFD.
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return without_lone_surrogates(json.loads(body))


async def handshake(request: Request) -> Response:
    """Meta's GET handshake: echo `hub.challenge` as plain text when mode and verify token are right."""
    webhooks: Webhooks = request.state.webhooks
    platform = request.path_params["platform"]
    rid = request_id_of(request)
    if platform in PLATFORMS and platform != "whatsapp":
        return error_response(405, "method_not_allowed", rid, detail="use POST", headers={"Allow": "POST"})
    if platform not in webhooks.adapters:
        return _not_enabled(platform, rid)
    params = request.query_params
    expected = webhooks.whatsapp_verify_token
    token = params.get("hub.verify_token") or ""
    valid = (
        expected is not None
        and params.get("hub.mode") == "subscribe"
        and hmac.compare_digest(token.encode(), expected.encode())
    )
    if not valid:
        log.warning("webhook_handshake_refused", platform="whatsapp")
        return PlainTextResponse("Forbidden", status_code=403)
    return PlainTextResponse(params.get("hub.challenge") or "")


def _not_enabled(platform: str, rid: str | None) -> Response:
    """404 for a platform the gateway does not know, or one whose secret is not configured."""
    if platform not in PLATFORMS:
        return error_response(404, "not_found", rid, detail=f"no platform named {platform!r}")
    detail = f"{platform} is disabled: set {ENABLING_SETTING[platform]} to enable it"
    return error_response(404, "platform_disabled", rid, detail=detail)
