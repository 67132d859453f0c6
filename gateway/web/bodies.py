"""Reading request bodies with a size limit and a deadline, shared by the webhooks and the admin API."""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.types import Receive, Scope

# Set in the request's state by the server's protocol (gateway.web.server) when the body's deadline
# has passed, before it wakes the reader: a flag costs nothing per request, a timer per read ~20 us.
BODY_DEADLINE_PASSED = "gateway.body_deadline_passed"


@dataclass(frozen=True)
class BodyRefused:
    """Why a body was not read, as the answer to give."""

    status: int
    error: str
    detail: str
    headers: dict[str, str] = field(default_factory=dict)


TIMED_OUT = BodyRefused(408, "request_timeout", "the body did not arrive in time", {"Connection": "close"})
INCOMPLETE = BodyRefused(400, "incomplete_body", "the connection closed before the whole body arrived")


def too_large(limit: int) -> BodyRefused:
    return BodyRefused(413, "payload_too_large", f"body over {limit} bytes")


async def read_limited(scope: Scope, receive: Receive, limit: int) -> bytes | BodyRefused:
    """The whole body, or why not: over `limit` (known as soon as it is, without reading the rest), past
    its deadline, or cut short by the client. Never a partial body.

    It works on the raw ASGI messages, so the webhooks need no Request object.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                return too_large(limit)
            break
    state = scope.get("state", {})
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if state.get(BODY_DEADLINE_PASSED):
            return TIMED_OUT
        if message["type"] != "http.request":
            return INCOMPLETE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
