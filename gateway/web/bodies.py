"""Reading request bodies with a size limit, shared by the webhooks and the admin API."""

from __future__ import annotations

from starlette.types import Receive, Scope


async def read_limited(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` (without reading the rest).

    It works on the raw ASGI messages, so the webhooks need no Request object; a client that
    disconnects leaves what it sent.
    """
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                return None
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
