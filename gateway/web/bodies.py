"""Reading request bodies with a size limit, shared by the webhooks and the admin API."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request


async def read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` (without reading the rest)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return None
    except ClientDisconnect:
        return bytes(body)
    return bytes(body)
