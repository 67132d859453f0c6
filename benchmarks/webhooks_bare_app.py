"""The baseline of benchmarks/webhooks.py: a bare Starlette endpoint that only reads the body.

No verification, no parsing, no storage, no middleware: the most a Python ASGI app can answer on
this server stack. benchmarks/webhooks.py serves it with uvicorn, with the same settings as
`gateway serve` (one worker, ``--loop auto --http auto``, no access log, no server header).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def receive(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse({"status": "accepted"})


app = Starlette(routes=[Route("/webhooks/{platform}", receive, methods=["POST"])])
