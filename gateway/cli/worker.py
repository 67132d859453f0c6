"""`gateway worker`: only the inbox worker and delivery (no HTTP), e.g. as a separate deployment."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import Any

import structlog

from gateway.bootstrap import build_services, load_agent, tune_interpreter
from gateway.cli.common import EXIT_OK, database_failures
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import migrations

log = structlog.get_logger("gateway.cli")


def register(commands: Any) -> None:
    worker = commands.add_parser(
        "worker", help="run only the inbox worker (no HTTP), e.g. as a separate deployment"
    )
    worker.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    load_agent(settings)
    return asyncio.run(_worker(settings, platforms))


async def _worker(settings: Settings, platforms: Sequence[PlatformSpec[Any]]) -> int:
    """Answer inbox rows and deliver replies until SIGTERM or Ctrl-C; rows in flight are handed back.

    The same services as `gateway serve` builds (one Database, so one SQLite writer), without HTTP.
    """
    tune_interpreter()
    services = build_services(settings, platforms)
    try:
        with database_failures(settings):
            await migrations.ensure_head(services.database)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await services.start(webhooks=False)
        await stop.wait()
    finally:
        await services.aclose()
    log.info("worker_stopped", owner=services.worker.owner)
    return EXIT_OK
