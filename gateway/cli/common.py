"""What every command shares: exit codes, the one-line failure, and a Database for the command's run."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from alembic.util.exc import CommandError

from gateway.settings import MAX_PORT, MIN_PORT, Settings
from gateway.store import migrations
from gateway.store.database import FAILURE_ERRORS, Database
from gateway.store.engine import describe_failure

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
T = TypeVar("T")


class CommandFailed(Exception):
    """A command failed in a way the user can act on; its message is the one line printed."""


# The most lines a listing prints, or worker processes: a larger --limit reached SQLite, past its
# integers, as an OverflowError.
MAX_COUNT = 1_000_000
MAX_WAIT_SECONDS = 3600.0


def positive_int(value: str) -> int:
    """A limit or a count: 1 to MAX_COUNT."""
    number = _whole(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    if number > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT:,}")
    return number


def port_number(value: str) -> int:
    """A TCP port to bind, in GATEWAY_PORT's range."""
    number = _whole(value)
    if not MIN_PORT <= number <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be from {MIN_PORT} to {MAX_PORT}")
    return number


def seconds(value: str) -> float:
    """A wait: more than 0 and at most MAX_WAIT_SECONDS (nan, inf and negatives were once taken as given)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 < number <= MAX_WAIT_SECONDS:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_WAIT_SECONDS:g}")
    return number


def _whole(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None


@contextmanager
def database_failures(settings: Settings) -> Iterator[None]:
    """A migration's or the database's failure as the command's one line (no traceback, no password)."""
    try:
        yield
    except CommandError as exc:
        raise CommandFailed(str(exc)) from None
    except FAILURE_ERRORS as exc:
        raise CommandFailed(describe_failure(settings.database_url, exc)) from None


def with_database(settings: Settings, work: Callable[[Database], Awaitable[T]]) -> T:
    """Run `work` on the configured database (opened and closed around it) in its own event loop."""

    async def run() -> T:
        database = Database.open(settings.database_url)
        try:
            with database_failures(settings):
                return await work(database)
        finally:
            await database.aclose()

    return asyncio.run(run())


def with_migrated(settings: Settings, work: Callable[[Database], Awaitable[T]]) -> T:
    """`with_database`, with the schema brought to head first (a new database works at once)."""

    async def migrated(database: Database) -> T:
        await migrations.ensure_head(database)
        return await work(database)

    return with_database(settings, migrated)
