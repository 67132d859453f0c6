"""`gateway db upgrade|downgrade|current|history|check`: the schema's migrations."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gateway.cli.common import EXIT_OK, CommandFailed, with_database
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import migrations


def register(commands: Any) -> None:
    group = commands.add_parser("db", help="database migrations")
    group.set_defaults(run=run)
    db = group.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    db.add_parser("upgrade", help="migrate up (default: to head)").add_argument(
        "revision", nargs="?", default="head"
    )
    db.add_parser("downgrade", help="migrate down to REVISION ('base' drops everything)").add_argument(
        "revision"
    )
    db.add_parser("current", help="print the database's revision")
    db.add_parser("history", help="list the migrations")
    db.add_parser("check", help="exit 1 when the models differ from the migrated database")


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    action = args.db_command
    if action == "history":
        print(migrations.history(), end="")
    elif action == "upgrade":
        print(with_database(settings, lambda e: migrations.upgrade(e, args.revision)), end="")
        print(f"database at {with_database(settings, migrations.current)}")
    elif action == "downgrade":
        print(with_database(settings, lambda e: migrations.downgrade(e, args.revision)), end="")
        print(f"database at {with_database(settings, migrations.current) or 'base'}")
    elif action == "current":
        print(with_database(settings, migrations.current) or "base (no migration applied)")
    elif action == "check":
        differences = with_database(settings, migrations.check)
        if differences:
            raise CommandFailed(f"models and migrations differ: {differences}")
        print("models and migrations agree")
    return EXIT_OK
