"""`gateway serve`: migrate the database to head, then serve HTTP (one process, or uvicorn's workers)."""

from __future__ import annotations

import argparse
import signal
import socket
from collections.abc import Sequence
from typing import Any

import structlog
import uvicorn
from uvicorn.supervisors import Multiprocess

from gateway.app import create_app
from gateway.bootstrap import load_agent, tune_interpreter, turn_kinds
from gateway.cli.common import EXIT_FAILURE, EXIT_OK, CommandFailed, port_number, positive_int, with_database
from gateway.errors import SettingsError
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings, env_name
from gateway.store import migrations
from gateway.store.engine import is_memory_sqlite, ping
from gateway.web.server import RESERVED_FILES, ConnectionLimits, GatewayConfig, raise_open_files_limit

# Seconds `gateway serve` lets in-flight requests finish after SIGTERM (under Kubernetes' default 30 s).
SHUTDOWN_GRACE_SECONDS = 25
WORKER_HEALTHCHECK_SECONDS = 60  # how long a --workers process may take to start and answer

log = structlog.get_logger("gateway.cli")


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="migrate the database to head, then serve HTTP")
    serve.add_argument("--host", help="bind address (default: GATEWAY_HOST)")
    serve.add_argument("--port", type=port_number, help="bind port (default: GATEWAY_PORT)")
    serve.add_argument("--workers", type=positive_int, default=1, help="worker processes (default 1)")
    serve.add_argument(
        "--no-migrate", action="store_true", help="skip the migration; only check the database"
    )
    serve.set_defaults(run=run)


def _check_host(host: str, given_as: str) -> None:
    """A bind address that does not resolve stops start-up naming where it was given (uvicorn's own
    line, later, names neither the host nor the setting)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SettingsError(f"invalid setting {given_as}: cannot bind {host!r}: {exc.strerror}") from None


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    host = args.host or settings.host
    port = args.port or settings.port
    _check_host(host, "--host" if args.host else env_name("host"))
    load_agent(settings)  # a bad GATEWAY_AGENT stops start-up now, not at the first message
    turn_kinds(settings)
    limits = connection_limits(settings)
    if is_memory_sqlite(settings.database_url):
        if args.workers > 1:
            raise CommandFailed("an in-memory SQLite database cannot be shared by several --workers")
    elif args.no_migrate:
        with_database(settings, lambda database: ping(database.engine))
    else:
        with_database(settings, migrations.upgrade)
        log.info("database_migrated", revision=migrations.head_revision())

    config = GatewayConfig(
        # With several workers, each process builds its own app (from the same settings) by the factory.
        "gateway.app:create_app" if args.workers > 1 else create_app(settings, platforms=platforms),
        factory=args.workers > 1,
        workers=args.workers,
        limits=limits,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
        # uvicorn kills a worker that has not answered its supervisor within 5 s; loading the app takes
        # ~3 s of CPU, 6-9 s on a loaded 2-core host, so workers were killed and restarted in a loop.
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
    )
    if args.workers > 1:
        Multiprocess(config, sockets=[config.bind_socket()]).run()  # what uvicorn.run does for workers
        return EXIT_OK
    server = uvicorn.Server(config)
    tune_interpreter()
    # uvicorn re-raises the signal that stopped it once it has drained; with a handler in place
    # that re-raise is a no-op, so a graceful stop ends with exit code 0 instead of -15.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, frame: None)
    server.run()
    return EXIT_OK if server.started else EXIT_FAILURE


def connection_limits(settings: Settings) -> ConnectionLimits:
    """The server's limits, with the connection cap fitted to the files this process may open (its soft
    limit raised to the hard one first). A cap that does not fit is a bad setting when it was given,
    and lowered with a warning when it is the default."""
    open_files = raise_open_files_limit()
    room = open_files - RESERVED_FILES
    if room < 1:
        raise CommandFailed(
            f"this process may open {open_files} files (ulimit -n);"
            f" the gateway needs more than {RESERVED_FILES}"
        )
    cap = settings.max_connections
    if cap > room:
        if "max_connections" in settings.model_fields_set:
            raise SettingsError(
                f"invalid setting {env_name('max_connections')}: {cap} connections need"
                f" {cap + RESERVED_FILES} open files, but this process may open {open_files} (ulimit -n);"
                f" lower it to {room}"
                " or raise the limit"
            )
        log.warning("max_connections_lowered", max_connections=room, open_files=open_files)
        cap = room
    return ConnectionLimits(
        head_timeout=settings.header_timeout_seconds,
        body_timeout=settings.body_timeout_seconds,
        max_connections=cap,
    )
