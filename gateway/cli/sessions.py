"""`gateway sessions list|show|rename|delete`: the admin API's session routes, on the configured database."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from gateway.cli.common import EXIT_OK, CommandFailed, positive_int, with_migrated
from gateway.domain import sessions as session_rules
from gateway.errors import SettingsError
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import sessions


def register(commands: Any) -> None:
    group = commands.add_parser("sessions", help="conversations (as the admin API shows them)")
    group.set_defaults(run=run)
    session_commands = group.add_subparsers(dest="sessions_command", required=True, metavar="ACTION")
    session_list = session_commands.add_parser("list", help="newest updated first, one page")
    session_list.add_argument("--platform", help="only ids starting with PLATFORM: (telegram, whatsapp, cli)")
    session_list.add_argument("--query", "-q", help="only titles containing this text (ignoring case)")
    session_list.add_argument("--limit", type=positive_int, default=session_rules.DEFAULT_PAGE_SIZE)
    session_list.add_argument("--cursor", help="the next page, as printed at the end of the previous one")
    session_commands.add_parser("show", help="a session with its messages").add_argument("id")
    rename = session_commands.add_parser("rename", help="set a session's title")
    rename.add_argument("id")
    rename.add_argument("title")
    session_commands.add_parser("delete", help="delete a session and its messages").add_argument("id")


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    """`gateway sessions …`: the admin API's session routes, on the configured database."""
    action = args.sessions_command
    if action == "list":
        return _list_sessions(settings, args)
    session_id: str = args.id
    if action == "show":
        detail = with_migrated(settings, lambda database: sessions.get_session(database, session_id))
        if detail is None:
            raise CommandFailed(f"no session {session_id!r}")
        _print_session(detail)
    elif action == "rename":
        try:
            title = session_rules.clean_title(args.title)
        except ValueError as exc:
            raise SettingsError(f"invalid TITLE: {exc}") from None
        renamed = with_migrated(
            settings, lambda database: sessions.rename_session(database, session_id, title)
        )
        if renamed is None:
            raise CommandFailed(f"no session {session_id!r}")
        print(f"session {session_id} renamed to {title!r}")
    else:
        if not with_migrated(settings, lambda database: sessions.delete_session(database, session_id)):
            raise CommandFailed(f"no session {session_id!r}")
        print(f"session {session_id} deleted, with its messages")
    return EXIT_OK


def _list_sessions(settings: Settings, args: argparse.Namespace) -> int:
    after = None
    if args.cursor is not None:
        try:
            after = session_rules.Cursor.decode(args.cursor)
        except ValueError:
            raise SettingsError("invalid --cursor: use the one printed after the previous page") from None
    if args.platform is not None and not session_rules.is_valid_platform(args.platform):
        raise SettingsError("invalid --platform: 1-32 characters of A-Z a-z 0-9 _ -")
    if args.query is not None and not session_rules.is_valid_query(args.query):
        raise SettingsError(f"invalid --query: at most {session_rules.MAX_QUERY_LENGTH} characters")
    limit = min(args.limit, session_rules.MAX_PAGE_SIZE)
    page = with_migrated(
        settings,
        lambda database: sessions.list_sessions(
            database, limit=limit, after=after, platform=args.platform, query=args.query
        ),
    )
    for session in page.sessions:
        print(
            f"{session.updated_at:%Y-%m-%d %H:%M:%S}  {session.message_count:>5}  {session.session_id}"
            f"  {session.title or '(untitled)'}"
        )
    if not page.sessions:
        print("no sessions")
    if page.next_cursor is not None:
        print(f"more: gateway sessions list --cursor {page.next_cursor.encode()}")
    return EXIT_OK


def _print_session(detail: session_rules.SessionDetail) -> None:
    session = detail.session
    print(f"session   {session.session_id}")
    print(f"title     {session.title or '(untitled)'}")
    print(f"platform  {session.platform or '-'}")
    print(f"agent     {session.active_agent or '-'}")
    print(f"created   {session.created_at:%Y-%m-%d %H:%M:%S} UTC")
    print(f"updated   {session.updated_at:%Y-%m-%d %H:%M:%S} UTC")
    print(f"messages  {session.message_count}")
    for key, value in sorted(detail.metadata.items()):
        print(f"  {key}: {value}")
    for message in detail.messages:
        who = message.role if message.agent_name is None else f"{message.role} ({message.agent_name})"
        print(f"[{message.created_at:%H:%M:%S}] {who}: {message.content or ''}".rstrip())
        for call in message.tool_calls:
            print(f"    -> {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})")
