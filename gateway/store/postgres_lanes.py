"""PostgreSQL's per-message statements, on connections held for the process's life.

A statement through SQLAlchemy cost the gateway about 380 us of CPU on the 2-core benchmark machine:
checking a connection out of the pool and back in, setting AUTOCOMMIT, binding the parameters through
the compiled statement, wrapping the result. The same statement on a held asyncpg connection cost
about 90 us, 110 us handed to it through a queue. So the statements every message runs (a webhook
batch's ingest, claims, a turn's commit, delivery records: one or two each) are compiled once for
asyncpg (`Statement`) and run here: on `lanes` connections checked out of the engine's pool for good
(so `GATEWAY_DATABASE_POOL_SIZE` still bounds the process), each a task taking work from one queue,
webhooks' ingest first (`urgent`). asyncpg's statement cache prepares each statement once per
connection. Everything else (reads of the operators' API, transactions, migrations) keeps the pool.

Errors reach callers as SQLAlchemy's would have (`gateway.store.database` sorts them): a refused value
(SQLSTATE 22, 23) as DataError or IntegrityError, a lost connection as OperationalError. A lost
connection makes every lane reconnect before its next statement, not only the one that saw it, so one
server restart fails one statement rather than one per lane. A statement waits at most the pool's
timeout for a lane (TimeoutError, as a pool checkout would); once started it runs to its end, its
result dropped if its caller has gone.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import ClauseElement

MAX_LANES = 8  # commits in flight at once: enough to share PostgreSQL's WAL flushes on a small server
Record = Sequence[Any]


class Statement:
    """A SQLAlchemy statement (text or Core) compiled once for asyncpg: its SQL and its parameters' order.

    Values go to asyncpg as given, not through the types' bind processors: aware datetimes, lists for
    arrays, str for JSON text (the callers pass what those processors would have produced)."""

    def __init__(self, clause: ClauseElement) -> None:
        self.clause = clause
        self._compiled: tuple[str, tuple[str, ...], dict[str, Any]] | None = None

    def bind(self, engine: AsyncEngine, params: Mapping[str, Any]) -> tuple[str, list[Any]]:
        if self._compiled is None:
            compiled: Any = self.clause.compile(dialect=engine.dialect)  # a SQLCompiler
            names = tuple(compiled.positiontup or ())
            defaults = {name: bind.value for bind, name in compiled.bind_names.items() if not bind.required}
            self._compiled = (compiled.string, names, defaults)
        sql, names, defaults = self._compiled
        return sql, [params[name] if name in params else defaults[name] for name in names]


@dataclass(eq=False)
class _Job:
    sql: str
    args: list[Any]
    future: asyncio.Future[list[Record]]
    started: bool = False


@dataclass
class _Lane:
    connection: AsyncConnection | None = None
    raw: Any = None  # its asyncpg connection
    generation: int = 0


class PostgresLanes:
    """`lanes` held connections of `engine`'s pool and the queue feeding them (opened on first use).
    With no lanes (a pool of one), each statement checks a connection out for itself."""

    def __init__(self, engine: AsyncEngine, lanes: int, wait_timeout: float) -> None:
        self._engine = engine
        self._count = lanes
        self._wait_timeout = wait_timeout
        self._queue: asyncio.PriorityQueue[tuple[int, int, _Job | None]] = asyncio.PriorityQueue()
        self._order = itertools.count()
        self._generation = 0  # bumped when a lane finds its connection lost: older lanes reconnect
        self._tasks: list[asyncio.Task[None]] = []

    async def fetch(
        self, statement: Statement, params: Mapping[str, Any], *, urgent: bool = False
    ) -> list[Record]:
        """The rows of `statement` run alone (atomic by itself, outside any transaction)."""
        sql, args = statement.bind(self._engine, params)
        if self._count == 0:
            return await self._checked_out(sql, args)
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._lane(_Lane())) for _ in range(self._count)]
        loop = asyncio.get_running_loop()
        job = _Job(sql, args, loop.create_future())
        self._queue.put_nowait((0 if urgent else 1, next(self._order), job))
        timer = loop.call_later(self._wait_timeout, self._expire, job)
        try:
            return await job.future
        finally:
            timer.cancel()

    def _expire(self, job: _Job) -> None:
        if not job.started and not job.future.done():
            job.future.set_exception(
                TimeoutError(f"no PostgreSQL connection free within {self._wait_timeout:g} s")
            )

    async def _lane(self, lane: _Lane) -> None:
        try:
            while True:
                _, _, job = await self._queue.get()
                if job is None:  # closing: the jobs queued before it were taken
                    return
                if job.future.done():  # its caller gave up (timed out, cancelled) before it started
                    continue
                job.started = True
                try:
                    rows = await self._run_on(lane, job.sql, job.args)
                except Exception as exc:
                    if not job.future.done():
                        job.future.set_exception(exc)
                else:
                    if not job.future.done():
                        job.future.set_result(rows)
        finally:
            if lane.connection is not None:
                await asyncio.shield(lane.connection.close())

    async def _run_on(self, lane: _Lane, sql: str, args: list[Any]) -> list[Record]:
        if lane.connection is not None and lane.generation < self._generation:
            await _discard(lane.connection)
            lane.connection = None
        if lane.connection is None:
            lane.generation = self._generation
            lane.connection = await self._engine.connect()
            lane.raw = (await lane.connection.get_raw_connection()).driver_connection
        try:
            return await _execute(lane.raw, sql, args)
        except OperationalError:
            self._generation += 1
            await _discard(lane.connection)
            lane.connection = None
            raise

    async def _checked_out(self, sql: str, args: list[Any]) -> list[Record]:
        async with self._engine.connect() as connection:
            raw = (await connection.get_raw_connection()).driver_connection
            try:
                return await _execute(raw, sql, args)
            except OperationalError:
                await connection.invalidate()
                raise

    async def aclose(self) -> None:
        """Run what was queued, then close the connections; a lane still busy after the wait timeout
        (a frozen server) is cancelled."""
        tasks, self._tasks = self._tasks, []
        for _ in tasks:
            self._queue.put_nowait((2, next(self._order), None))
        _, busy = await asyncio.wait(tasks, timeout=self._wait_timeout) if tasks else (set(), set())
        for task in busy:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _discard(connection: AsyncConnection) -> None:
    """Give a broken connection back to the pool as invalid (it opens a fresh one in its place)."""
    try:
        await connection.invalidate()
        await connection.close()
    except Exception:  # it is broken already; the pool replaces it either way
        pass


async def _execute(raw: Any, sql: str, args: list[Any]) -> list[Record]:
    """asyncpg's fetch, its errors as SQLAlchemy's (see the module's docstring)."""
    import asyncpg  # type: ignore[import-untyped]  # the postgres extra: only PostgreSQL gets here

    try:
        rows: list[Record] = await raw.fetch(sql, *args)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(sql, None, exc) from exc
    except asyncpg.DataError as exc:  # the server's SQLSTATE 22, or a value asyncpg could not encode
        raise DataError(sql, None, _ValueRefused(exc)) from None
    except asyncpg.PostgresError as exc:
        if isinstance(exc, asyncpg.PostgresConnectionError) or raw.is_closed():
            raise OperationalError(sql, None, exc) from exc
        raise DBAPIError(sql, None, exc) from exc
    except (asyncpg.InterfaceError, asyncpg.InternalClientError, OSError) as exc:
        # InternalClientError: the driver's protocol left mid-operation (a backend terminated at the
        # wrong moment); that connection serves nothing again, like a lost one.
        raise OperationalError(sql, None, exc) from exc
    return rows


class _ValueRefused(ValueError):
    """A refused value's error without the value: asyncpg's message quotes it after a colon ("invalid
    input for query argument $1: 'the text' (...)", 'invalid input syntax for type integer: "12a"'),
    and it may be a user's text, which no log line may carry; so only the part before the colon is
    kept, and not the original error as a cause either (a traceback would print it)."""

    def __init__(self, exc: Exception) -> None:
        head = str(exc).split(":", 1)[0]
        self.sqlstate = getattr(exc, "sqlstate", None)
        super().__init__(f"{type(exc).__name__} ({self.sqlstate or 'client'}): {head}")
