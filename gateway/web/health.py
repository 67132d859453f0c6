"""Liveness and readiness, for orchestrators and load balancers."""

from __future__ import annotations

import asyncio
import os
import socket

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.errors import DatabaseUnavailableError
from gateway.store import health, migrations

READY_TIMEOUT_SECONDS = 2.0


async def healthz(request: Request) -> JSONResponse:
    """Alive as long as the event loop answers; deliberately checks nothing else."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> JSONResponse:
    """Ready when, within the timeout, the database answers, its schema is at the code's head, and a
    write commits (this process's row of the health table): reads alone pass on a full disk or a
    read-only database, where every webhook fails. One small upsert per probe."""
    head: str = request.state.schema_head
    database = request.state.database
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            revision = await migrations.current(database)
            if revision == head:
                await health.record(database, f"{socket.gethostname()}:{os.getpid()}")
    except TimeoutError:
        return _unready(f"database did not answer within {READY_TIMEOUT_SECONDS:g}s")
    except DatabaseUnavailableError as exc:
        return _unready(str(exc))
    if revision != head:
        return _unready(f"schema at {revision or 'no revision'}, expected {head}; run `gateway db upgrade`")
    return JSONResponse({"status": "ready", "database": "ok", "schema": revision})


def _unready(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unready", "reason": reason}, status_code=503)
