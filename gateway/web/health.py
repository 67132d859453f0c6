"""Liveness and readiness, for orchestrators and load balancers."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.errors import DatabaseUnavailableError
from gateway.store import migrations

READY_TIMEOUT_SECONDS = 2.0


async def healthz(request: Request) -> JSONResponse:
    """Alive as long as the event loop answers; deliberately checks nothing else."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers within the timeout and its schema is at the code's head."""
    head: str = request.state.schema_head
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            revision = await migrations.current(request.state.database)
    except TimeoutError:
        return _unready(f"database did not answer within {READY_TIMEOUT_SECONDS:g}s")
    except DatabaseUnavailableError as exc:
        return _unready(str(exc))
    if revision != head:
        return _unready(f"schema at {revision or 'no revision'}, expected {head}; run `gateway db upgrade`")
    return JSONResponse({"status": "ready", "database": "ok", "schema": revision})


def _unready(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unready", "reason": reason}, status_code=503)
