"""`/webhooks/{platform}`: verify, parse, store durably, acknowledge. Never waits for a model.

Answers, in order of checks: unknown or disabled platform 404 (a disabled one is reached only in
the local mode: a loopback client signing with the local key, see `gateway.platforms.local_key`);
a secret or signature header missing or wrong 401 before any body byte is read (the adapter's
`verify_headers`); body over the limit 413 (not read whole); body not in full by its deadline 408
(the server's protocol keeps the clock, gateway.web.server); bad signature 401 (nothing stored);
invalid JSON or not an object 400; a platform's POST handshake (its spec's hook) its own answer,
nothing stored; an update we do not act on 200; more messages and statuses than the cap 413,
nothing stored; otherwise 200 once its dedup keys and inbox rows are committed, or 503 if the
database could not take them (the platform retries). Nothing a client sends gives a 500.
`GET /webhooks/{platform}` is the platform's GET handshake, 405 where it has none.

Every platform is known only through its spec (gateway.platforms.spec): nothing here names one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import orjson
import structlog
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.domain.inbound import DEFAULT_TURN_KINDS, MessageKind, starts_turn
from gateway.domain.text import without_lone_surrogates
from gateway.logs import will_log
from gateway.platforms.local_key import is_loopback
from gateway.platforms.spec import ConfiguredPlatform, HandshakeReply, HandshakeRequest, PlatformSpec
from gateway.store.database import refused_value
from gateway.store.ingest import Ingest, OverloadedError
from gateway.web.bodies import BodyRefused, read_limited
from gateway.web.errors import error_response, request_id_of

log = structlog.get_logger(__name__)
_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Webhooks:
    """What the webhook routes need, built by the app's lifespan."""

    platforms: Mapping[str, ConfiguredPlatform]
    ingest: Ingest
    max_body_bytes: int
    max_items: int = 1000  # messages, statuses and membership changes in one request
    # Wakes the worker with the conversations that have a turn due.
    on_pending: Callable[[Iterable[str]], None] = lambda sessions: None
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
    known = webhooks.platforms.get(platform)
    if known is None:
        return _unknown(platform, rid)
    adapter = known.adapter
    local = adapter is None
    if adapter is None:
        client = scope.get("client")
        host = client[0] if client else None
        adapter = known.local_adapter if is_loopback(host) else None
        if adapter is None:
            return _disabled(known.spec, rid)

    headers = Headers(scope=scope)
    if not adapter.verify_headers(headers):  # before any body byte is read
        return _unauthorized(known.spec, local, rid)
    body = await read_limited(scope, receive, webhooks.max_body_bytes)
    if isinstance(body, BodyRefused):
        return error_response(body.status, body.error, rid, headers=body.headers, detail=body.detail)
    if not adapter.verify(headers, body):
        return _unauthorized(known.spec, local, rid)
    try:
        payload = _parse_json(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: too deep
        return error_response(400, "invalid_json", rid, detail="the body is not valid JSON")
    if not isinstance(payload, dict):
        return error_response(400, "invalid_json", rid, detail="the body is not a JSON object")

    hook = known.spec.handshake
    if hook is not None and hook.method == "POST":
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        reply = hook.answer(known.settings, HandshakeRequest(query, payload))
        if reply is not None:
            log.info("webhook_handshake_answered", platform=platform, status=reply.status)
            return _handshake_response(reply)

    parsed = adapter.parse(payload)
    if parsed.empty:
        log.info("webhook_ignored", platform=platform)
        return _IGNORED
    items = len(parsed.messages) + len(parsed.statuses) + len(parsed.memberships)
    if items > webhooks.max_items:
        # Signed, so from the platform or whoever holds its secret: worth an operator's look.
        log.warning("webhook_too_many_messages", platform=platform, items=items, limit=webhooks.max_items)
        detail = f"more than {webhooks.max_items} messages and statuses in one request"
        return error_response(413, "too_many_messages", rid, detail=detail)
    turns = [starts_turn(message, webhooks.turn_kinds) for message in parsed.messages]
    try:
        new = await webhooks.ingest.write(parsed, turns)
    except Exception as exc:  # its text may hold the values of the update: the type only
        if refused_value(exc):
            # The database refuses a value even after the storable rule: a retry would fail the same
            # way for days (and Telegram holds back the bot's later updates meanwhile). Acknowledged,
            # not stored, and said loudly; the batch it came with was committed without it.
            log.error("webhook_unstorable", platform=platform, items=items, error=type(exc).__name__)
            return _UNSTORABLE
        log.error("webhook_store_failed", platform=platform, items=items, error=type(exc).__name__)
        return error_response(
            503,
            "unavailable",
            rid,
            detail=_UNAVAILABLE_DETAIL.get(type(exc), "could not store the update; retry later"),
            headers={"Retry-After": "5"},
        )
    accepted = sum(new)
    if due := {
        message.session_id
        for message, is_new, turn in zip(parsed.messages, new, turns, strict=False)
        if is_new and turn
    }:
        webhooks.on_pending(due)
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
_UNSTORABLE = b'{"status":"ignored","reason":"unstorable"}'
_UNAVAILABLE_DETAIL = {
    TimeoutError: "the database did not commit the update in time; retry later",
    OverloadedError: "too many webhooks are waiting for the database; retry later",
}


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
    """GET /webhooks/{platform}: the platform's GET handshake (e.g. Meta's hub.challenge), 405 without one."""
    webhooks: Webhooks = request.state.webhooks
    platform = request.path_params["platform"]
    rid = request_id_of(request)
    known = webhooks.platforms.get(platform)
    if known is None:
        return _unknown(platform, rid)
    hook = known.spec.handshake
    if hook is None or hook.method != "GET":
        return _post_only(rid)
    if not known.enabled:
        return _disabled(known.spec, rid)
    reply = hook.answer(known.settings, HandshakeRequest(dict(request.query_params)))
    return _post_only(rid) if reply is None else _handshake_response(reply)


def _handshake_response(reply: HandshakeReply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.content_type)


def _post_only(rid: str | None) -> Response:
    return error_response(405, "method_not_allowed", rid, detail="use POST", headers={"Allow": "POST"})


def _unknown(platform: str, rid: str | None) -> Response:
    return error_response(404, "not_found", rid, detail=f"no platform named {platform!r}")


def _unauthorized(spec: PlatformSpec[Any], local: bool, rid: str | None) -> Response:
    if local:
        return _disabled(spec, rid)  # without the local key it stays disabled, also on loopback
    log.warning("webhook_rejected", platform=spec.name, reason="signature")
    return error_response(401, "unauthorized", rid, detail="missing or wrong signature")


def _disabled(spec: PlatformSpec[Any], rid: str | None) -> Response:
    """404 for a platform whose webhook secret is not configured, naming the setting that enables it."""
    detail = f"{spec.name} is disabled: set {spec.enabling_variable} to enable it"
    return error_response(404, "platform_disabled", rid, detail=detail)
