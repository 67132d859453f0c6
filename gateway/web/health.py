"""Liveness and readiness, for orchestrators and load balancers.

/readyz is 503 when the database does not answer, its schema is behind, a write does not commit, or
this process's inbox or delivery claims keep failing (its turns and replies would stall unseen); when
ready it also names the replies waiting on a platform that keeps failing (`outbox_waiting`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import weakref
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.domain.claims import ClaimHealth
from gateway.errors import DatabaseUnavailableError
from gateway.store import health, migrations, outbox
from gateway.store.database import FAILURE_ERRORS, Database

READY_TIMEOUT_SECONDS = 2.0
T = TypeVar("T")


async def healthz(request: Request) -> JSONResponse:
    """Alive as long as the event loop answers; deliberately checks nothing else."""
    return JSONResponse({"status": "ok"})


async def _check(database: Database, head: str) -> str | None:
    """The schema's revision; at head, this process's health row is written too."""
    revision = await migrations.current(database)
    if revision == head:
        await health.record(database, f"{socket.gethostname()}:{os.getpid()}")
    return revision


# Each database's probes in progress, by kind. A probe is not cancelled when /readyz stops waiting for
# it: on a frozen server the cancelled query's clean-up waited on the server as long again, and
# /readyz answered after 4 s instead of 2. Requests meanwhile wait on the same probe: none pile up.
_running: weakref.WeakKeyDictionary[Database, dict[str, asyncio.Task[Any]]] = weakref.WeakKeyDictionary()


def _one_at_a_time(
    database: Database, kind: str, start: Callable[[], Coroutine[Any, Any, T]]
) -> asyncio.Task[T]:
    tasks = _running.setdefault(database, {})
    task: asyncio.Task[T] | None = tasks.get(kind)
    if task is None or task.done():
        task = tasks[kind] = asyncio.create_task(start(), name=f"readyz-{kind}")
        # Its failure is read by whoever waits to the end; one that nobody did is not worth a log line.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return task


async def readyz(request: Request) -> JSONResponse:
    """Ready when, within the timeout, the database answers, its schema is at the code's head, and a
    write commits (this process's row of the health table): reads alone pass on a full disk or a
    read-only database, where every webhook fails. One small upsert per probe."""
    head: str = request.state.schema_head
    database: Database = request.state.database
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_SECONDS
    probe = _one_at_a_time(database, "write", lambda: _check(database, head))
    if not (await asyncio.wait({probe}, timeout=READY_TIMEOUT_SECONDS))[0]:
        return _unready(f"database did not answer within {READY_TIMEOUT_SECONDS:g}s")
    try:
        revision = probe.result()
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
    waiting = await _waiting(database, deadline)
    if waiting:
        # Replies held back by transient failures: a platform down or throttling (still ready: they
        # are retried for GATEWAY_DELIVERY_RETRY_HOURS and nothing else waits on them).
        ready["outbox_waiting"] = {
            w.platform: {"rows": w.rows, "gives_up_at": w.gives_up_at and w.gives_up_at.isoformat()}
            for w in waiting
        }
    return JSONResponse(ready)


async def _waiting(database: Database, deadline: float) -> list[outbox.Waiting] | None:
    """The replies waiting on a failing platform, if read within what is left of the timeout (a
    detail only: the checks before decided readiness)."""
    read = _one_at_a_time(database, "waiting", lambda: outbox.waiting(database))
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    if not (await asyncio.wait({read}, timeout=remaining))[0] or read.cancelled():
        return None
    return None if isinstance(read.exception(), FAILURE_ERRORS) else read.result()


def _unready(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unready", "reason": reason}, status_code=503)
