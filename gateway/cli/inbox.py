"""`gateway inbox list|retry` and `gateway dedup purge`: the operators' tools on what the webhooks stored."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gateway.cli.common import EXIT_OK, CommandFailed, positive_int, with_database, with_migrated
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import dedup, inbox


def register(commands: Any) -> None:
    dedup_group = commands.add_parser("dedup", help="platform message keys")
    dedup_group.set_defaults(run=purge)
    dedup_commands = dedup_group.add_subparsers(dest="dedup_command", required=True, metavar="ACTION")
    dedup_commands.add_parser("purge", help="delete keys older than GATEWAY_DEDUP_TTL_HOURS")

    inbox_group = commands.add_parser("inbox", help="messages accepted by the webhooks")
    inbox_group.set_defaults(run=run)
    inbox_commands = inbox_group.add_subparsers(dest="inbox_command", required=True, metavar="ACTION")
    listing = inbox_commands.add_parser("list", help="newest first")
    listing.add_argument("--status", choices=inbox.STATUSES, help="only rows with this status")
    listing.add_argument("--limit", type=positive_int, default=50)
    inbox_commands.add_parser("retry", help="requeue a dead message").add_argument("id", type=int)


def purge(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    purged = with_migrated(settings, dedup.purge_expired)
    print(f"purged {purged} expired message keys")
    return EXIT_OK


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    if args.inbox_command == "retry":
        if not with_database(settings, lambda database: inbox.retry(database, args.id)):
            raise CommandFailed(f"no dead inbox row with id {args.id}")
        print(f"inbox row {args.id} requeued")
        return EXIT_OK
    items = with_migrated(settings, lambda database: inbox.list_items(database, args.status, args.limit))
    for item in items:
        text = (item.text or "").replace("\n", " ")
        text = text if len(text) <= 60 else text[:57] + "..."
        error = f"  error: {item.last_error}" if item.last_error else ""
        print(
            f"{item.id:>8}  {item.received_at:%Y-%m-%d %H:%M:%S}  {item.status:<8}  {item.attempts}  "
            f"{item.session_id}  [{item.kind}] {text}{error}"
        )
    if not items:
        print("no inbox rows" + (f" with status {args.status}" if args.status else ""))
    return EXIT_OK
