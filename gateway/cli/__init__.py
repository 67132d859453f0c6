"""The `gateway` command. Exit codes: 0 ok, 1 runtime failure (database, drift), 2 bad usage or setting.

One module per command group; each registers its parser and the function that runs it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from gateway.cli import chat, db, inbox, outbox, serve, sessions, simulate, telegram, worker
from gateway.cli.common import EXIT_FAILURE, EXIT_USAGE, CommandFailed
from gateway.errors import DatabaseUnavailableError, SettingsError
from gateway.logs import configure_logging
from gateway.platforms.registry import PLATFORMS, settings_groups
from gateway.platforms.spec import PlatformSpec
from gateway.settings import load_settings, unknown_env_settings

log = structlog.get_logger("gateway.cli")


def _parser(platforms: Sequence[PlatformSpec[Any]]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(commands)
    worker.register(commands)
    telegram.register(commands)
    simulate.register(commands, platforms)
    chat.register(commands)
    inbox.register(commands)
    outbox.register(commands)
    sessions.register(commands)
    db.register(commands)
    return parser


def main(argv: Sequence[str] | None = None, *, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS) -> int:
    """The command; `platforms` are those it knows (the registry's)."""
    args = _parser(platforms).parse_args(argv)
    groups = settings_groups(platforms)
    try:
        settings = load_settings(groups)
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(
        settings.log_level,
        settings.resolved_log_format,
        settings.secret_values(),
        redact_users=settings.log_redact_users,
    )
    for name in unknown_env_settings(groups):
        log.warning("unknown_setting_ignored", variable=name)
    try:
        result: int = args.run(settings, args, platforms)
        return result
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CommandFailed, DatabaseUnavailableError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE
