"""Liveness and readiness, for orchestrators and load balancers.

/readyz is 503 when the database does not answer, its schema is behind, a write does not commit, or
this process's inbox or delivery claims keep failing (its turns and replies would stall unseen); when
ready it also names the replies waiting on a platform that keeps failing (`outbox_waiting`).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.domain.claims import ClaimHealth
from gateway.errors import DatabaseUnavailableError
from gateway.store import health, migrations, outbox
from gateway.store.database import FAILURE_ERRORS

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
    claims: Mapping[str, ClaimHealth] = getattr(request.state, "claims", {})
    for name, loop in claims.items():
        if loop.failing:
            # Webhooks still store, but this process answers nobody: take it out of rotation and say why.
            return _unready(
                f"{name} claims have failed {loop.consecutive_failures} times in a row for "
                f"{loop.failing_for():.0f}s ({loop.last_error})"
            )
    ready: dict[str, Any] = {"status": "ready", "database": "ok", "schema": revision}
    if claims:
        ready["claims"] = dict.fromkeys(claims, "ok")
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            waiting = await outbox.waiting(database)
    except FAILURE_ERRORS:  # TimeoutError is an OSError
        waiting = None  # a detail only: the checks above decided readiness
    if waiting:
        # Replies held back by transient failures: a platform down or throttling (still ready: they
        # are retried for GATEWAY_DELIVERY_RETRY_HOURS and nothing else waits on them).
        ready["outbox_waiting"] = {
            w.platform: {"rows": w.rows, "gives_up_at": w.gives_up_at and w.gives_up_at.isoformat()}
            for w in waiting
        }
    return JSONResponse(ready)


def _unready(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unready", "reason": reason}, status_code=503)
