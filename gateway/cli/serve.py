"""`gateway serve`: migrate the database to head, then serve HTTP (one process, or uvicorn's workers)."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Sequence
from typing import Any

import structlog
import uvicorn

from gateway.app import create_app
from gateway.bootstrap import load_agent, tune_interpreter, turn_kinds
from gateway.cli.common import EXIT_FAILURE, EXIT_OK, CommandFailed, positive_int, with_database
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import migrations
from gateway.store.engine import is_memory_sqlite, ping

# Seconds `gateway serve` lets in-flight requests finish after SIGTERM (under Kubernetes' default 30 s).
SHUTDOWN_GRACE_SECONDS = 25

log = structlog.get_logger("gateway.cli")


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="migrate the database to head, then serve HTTP")
    serve.add_argument("--host", help="bind address (default: GATEWAY_HOST)")
    serve.add_argument("--port", type=int, help="bind port (default: GATEWAY_PORT)")
    serve.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    serve.add_argument(
        "--no-migrate", action="store_true", help="skip the migration; only check the database"
    )
    serve.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    host = args.host or settings.host
    port = args.port or settings.port
    load_agent(settings.agent)  # a bad GATEWAY_AGENT stops start-up now, not at the first message
    turn_kinds(settings)
    if is_memory_sqlite(settings.database_url):
        if args.workers > 1:
            raise CommandFailed("an in-memory SQLite database cannot be shared by several --workers")
    elif args.no_migrate:
        with_database(settings, lambda database: ping(database.engine))
    else:
        with_database(settings, migrations.upgrade)
        log.info("database_migrated", revision=migrations.head_revision())

    if args.workers > 1:
        # Each worker process builds its own app (and reads the same settings) through the factory.
        uvicorn.run(
            "gateway.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=args.workers,
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        )
        return EXIT_OK

    config = uvicorn.Config(
        create_app(settings, platforms=platforms),
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )
    server = uvicorn.Server(config)
    tune_interpreter()
    # uvicorn re-raises the signal that stopped it once it has drained; with a handler in place
    # that re-raise is a no-op, so a graceful stop ends with exit code 0 instead of -15.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: None)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILURE
