"""`gateway outbox list|retry`: the operators' tools on replies that were not delivered.

A reply is `dead` when transient failures outlasted GATEWAY_DELIVERY_RETRY_HOURS (an outage), `failed`
when the platform refused it for good; retry sends either again with fresh attempts and budget. The
list never prints a reply's text: it is the agent's answer, already in the session's transcript
(`gateway sessions show`), and delivery keeps it out of its logs too; the row's id, session and error
are what an operator acts on.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gateway.cli.common import EXIT_OK, CommandFailed, positive_int, with_database, with_migrated
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import outbox
from gateway.store.database import Database
from gateway.store.outbox import OutboxItem, Waiting

MAX_ERROR_CHARS = 120
_TIME = "%Y-%m-%d %H:%M:%S"


def register(commands: Any) -> None:
    group = commands.add_parser("outbox", help="replies and their delivery")
    group.set_defaults(run=run)
    actions = group.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="newest first, and the platforms replies wait on")
    listing.add_argument("--status", choices=outbox.STATUSES, help="only rows with this status")
    listing.add_argument("--limit", type=positive_int, default=50)
    retry = actions.add_parser("retry", help="send a dead or failed reply again")
    retry.add_argument("id", type=int)


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    if args.outbox_command == "retry":
        return _retry(settings, args.id)

    async def read(database: Database) -> tuple[list[OutboxItem], list[Waiting]]:
        return await outbox.list_items(database, args.status, args.limit), await outbox.waiting(database)

    items, waiting = with_migrated(settings, read)
    for item in items:
        print(_line(item))
    if not items:
        print("no outbox rows" + (f" with status {args.status}" if args.status else ""))
    for platform in waiting:
        print(_waiting_line(platform))
    return EXIT_OK


def _retry(settings: Settings, outbox_id: int) -> int:
    async def requeue(database: Database) -> tuple[OutboxItem | None, OutboxItem | None]:
        requeued = await outbox.requeue(database, outbox_id)
        return requeued, None if requeued else await outbox.get_item(database, outbox_id)

    requeued, current = with_database(settings, requeue)
    if current is not None:
        detail = "only a dead or failed row is retried"
        raise CommandFailed(f"outbox row {outbox_id} is {current.status}: {detail}")
    if requeued is None:
        raise CommandFailed(f"no outbox row with id {outbox_id}")
    # A running gateway's delivery finds it at its next look (within a second).
    print(f"outbox row {outbox_id} requeued")
    return EXIT_OK


def _line(item: OutboxItem) -> str:
    error = ": ".join(part for part in (item.error_code, item.error_message) if part)
    if len(error) > MAX_ERROR_CHARS:
        error = error[: MAX_ERROR_CHARS - 3] + "..."
    return _printable(
        f"{item.id:>8}  {item.created_at:{_TIME}}  {item.status:<8}  {item.attempts}  {item.platform}  "
        f"{item.session_id}  [{item.kind}]" + (f"  error: {error}" if error else "")
    )


def _waiting_line(waiting: Waiting) -> str:
    gives_up = "" if waiting.gives_up_at is None else f"; the first is dead at {waiting.gives_up_at:{_TIME}}"
    return f"waiting: {waiting.rows} {waiting.platform} replies retried after failures{gives_up}"


def _printable(line: str) -> str:
    """Session ids and platforms' error texts come from outside: no control character reaches the
    terminal (an escape sequence could rewrite what the operator sees)."""
    return "".join(char if char.isprintable() else " " for char in line)
