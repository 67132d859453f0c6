"""The `gateway` command. Exit codes: 0 ok, 1 runtime failure (database, drift), 2 bad usage or setting."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import structlog
import uvicorn
from alembic.util.exc import CommandError

from gateway.agents import ModelError
from gateway.app import create_app
from gateway.bootstrap import (
    build_runner,
    build_services,
    load_agent,
    platform_settings,
    tune_interpreter,
    turn_kinds,
)
from gateway.errors import DatabaseUnavailableError, SettingsError
from gateway.http_client import http_client
from gateway.logs import configure_logging
from gateway.platforms import local_key
from gateway.platforms.registry import PLATFORMS, by_name, settings_groups
from gateway.platforms.spec import PlatformSpec
from gateway.platforms.telegram.api import TelegramAPI, TelegramAPIError
from gateway.platforms.telegram.spec import TELEGRAM, TelegramSettings
from gateway.settings import Settings, load_settings, unknown_env_settings
from gateway.store import dedup, inbox, migrations, sessions
from gateway.store.database import FAILURE_ERRORS, Database
from gateway.store.engine import describe_failure, is_memory_sqlite, ping, safe_url

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# Seconds `gateway serve` lets in-flight requests finish after SIGTERM (under Kubernetes' default 30 s).
SHUTDOWN_GRACE_SECONDS = 25
SIMULATE_POLL_SECONDS = 0.05  # how often `gateway simulate` looks for the reply
T = TypeVar("T")
WEBHOOK_INFO_FIELDS = (
    "url",
    "pending_update_count",
    "last_error_date",
    "last_error_message",
    "max_connections",
)

log = structlog.get_logger("gateway.cli")


class CommandFailed(Exception):
    """A command failed in a way the user can act on; its message is the one line printed."""


def _parser(platforms: Sequence[PlatformSpec[Any]]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="migrate the database to head, then serve HTTP")
    serve.add_argument("--host", help="bind address (default: GATEWAY_HOST)")
    serve.add_argument("--port", type=int, help="bind port (default: GATEWAY_PORT)")
    serve.add_argument("--workers", type=_positive_int, default=1, help="worker processes (default 1)")
    serve.add_argument(
        "--no-migrate", action="store_true", help="skip the migration; only check the database"
    )

    commands.add_parser("worker", help="run only the inbox worker (no HTTP), e.g. as a separate deployment")

    telegram = commands.add_parser("telegram", help="the bot's webhook registration").add_subparsers(
        dest="telegram_command", required=True, metavar="ACTION"
    )
    set_webhook = telegram.add_parser(
        "set-webhook", help="point the bot at URL (…/webhooks/telegram is added)"
    )
    set_webhook.add_argument("url", help="the gateway's public HTTPS URL")
    set_webhook.add_argument(
        "--drop-pending", action="store_true", help="discard updates Telegram still holds"
    )
    telegram.add_parser(
        "webhook-info", help="what Telegram knows of the webhook (pending updates, last error)"
    )

    simulate = commands.add_parser(
        "simulate", help="send a signed webhook to a running gateway and print the reply"
    )
    simulate.add_argument("platform", choices=[spec.name for spec in platforms])
    simulate.add_argument("text", help="the message")
    defaults = ", ".join(f"{spec.name} {spec.simulate_user}" for spec in platforms)
    simulate.add_argument("--user", help=f"sender: the user's id on the platform (default: {defaults})")
    simulate.add_argument("--url", help="the gateway (default: http://GATEWAY_HOST:GATEWAY_PORT)")
    simulate.add_argument(
        "--timeout", type=float, default=30, help="seconds to wait for the reply (default 30)"
    )

    chat = commands.add_parser("chat", help="talk to the configured agent in the terminal")
    chat.add_argument("--session", help="session id to resume or create (default: a new cli:<random> id)")

    dedup_commands = commands.add_parser("dedup", help="platform message keys").add_subparsers(
        dest="dedup_command", required=True, metavar="ACTION"
    )
    dedup_commands.add_parser("purge", help="delete keys older than GATEWAY_DEDUP_TTL_HOURS")

    inbox_commands = commands.add_parser("inbox", help="messages accepted by the webhooks").add_subparsers(
        dest="inbox_command", required=True, metavar="ACTION"
    )
    listing = inbox_commands.add_parser("list", help="newest first")
    listing.add_argument("--status", choices=inbox.STATUSES, help="only rows with this status")
    listing.add_argument("--limit", type=_positive_int, default=50)
    inbox_commands.add_parser("retry", help="requeue a dead message").add_argument("id", type=int)

    session_commands = commands.add_parser(
        "sessions", help="conversations (as the admin API shows them)"
    ).add_subparsers(dest="sessions_command", required=True, metavar="ACTION")
    session_list = session_commands.add_parser("list", help="newest updated first, one page")
    session_list.add_argument("--platform", help="only ids starting with PLATFORM: (telegram, whatsapp, cli)")
    session_list.add_argument("--query", "-q", help="only titles containing this text (ignoring case)")
    session_list.add_argument("--limit", type=_positive_int, default=sessions.DEFAULT_PAGE_SIZE)
    session_list.add_argument("--cursor", help="the next page, as printed at the end of the previous one")
    session_commands.add_parser("show", help="a session with its messages").add_argument("id")
    rename = session_commands.add_parser("rename", help="set a session's title")
    rename.add_argument("id")
    rename.add_argument("title")
    session_commands.add_parser("delete", help="delete a session and its messages").add_argument("id")

    db = commands.add_parser("db", help="database migrations").add_subparsers(
        dest="db_command", required=True, metavar="ACTION"
    )
    db.add_parser("upgrade", help="migrate up (default: to head)").add_argument(
        "revision", nargs="?", default="head"
    )
    db.add_parser("downgrade", help="migrate down to REVISION ('base' drops everything)").add_argument(
        "revision"
    )
    db.add_parser("current", help="print the database's revision")
    db.add_parser("history", help="list the migrations")
    db.add_parser("check", help="exit 1 when the models differ from the migrated database")
    return parser


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def main(argv: Sequence[str] | None = None, *, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS) -> int:
    """The command; `platforms` are those it knows (the registry's)."""
    args = _parser(platforms).parse_args(argv)
    groups = settings_groups(platforms)
    try:
        settings = load_settings(groups)
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings.log_level, settings.resolved_log_format, settings.secret_values())
    for name in unknown_env_settings(groups):
        log.warning("unknown_setting_ignored", variable=name)
    try:
        if args.command == "serve":
            return _serve(settings, args)
        if args.command == "telegram":
            return asyncio.run(_telegram(settings, args))
        if args.command == "worker":
            load_agent(settings.agent)
            return asyncio.run(_worker(settings, platforms))
        if args.command == "simulate":
            spec = by_name(platforms)[args.platform]
            return _with_database(settings, lambda database: _simulate(settings, database, args, spec))
        if args.command == "chat":
            return _with_database(settings, lambda database: _chat(settings, database, args.session))
        if args.command == "dedup":
            purged = _with_database(settings, _purge)
            print(f"purged {purged} expired message keys")
            return EXIT_OK
        if args.command == "inbox":
            return _inbox(settings, args)
        if args.command == "sessions":
            return _sessions(settings, args)
        return _db(settings, args)
    except SettingsError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CommandFailed, DatabaseUnavailableError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _with_database(settings: Settings, work: Callable[[Database], Awaitable[T]]) -> T:
    async def run() -> T:
        database = Database.open(settings.database_url)
        try:
            return await work(database)
        except CommandError as exc:
            raise CommandFailed(str(exc)) from None
        except FAILURE_ERRORS as exc:
            raise CommandFailed(describe_failure(settings.database_url, exc)) from None
        finally:
            await database.aclose()

    return asyncio.run(run())


async def _chat(settings: Settings, database: Database, session_id: str | None) -> int:
    """A terminal conversation, persisted like any other: a way to try agents before a platform."""
    await migrations.ensure_head(database)
    runner = build_runner(settings, database)
    session_id = session_id or f"cli:{uuid.uuid4().hex[:8]}"
    existing = await runner.session_store.get(session_id)
    if existing is None:
        print(f"New session {session_id} with {runner.starting_agent.name}. Ctrl-D or 'exit' ends it.")
    else:
        count = len(existing.history)
        print(f"Resuming session {session_id} ({count} messages) with {existing.active_agent.name}.")
    while True:
        try:
            text = await asyncio.to_thread(input, "you> ")
        except EOFError:
            print()
            return EXIT_OK
        if text.strip().lower() in {"exit", "quit"}:
            return EXIT_OK
        if not text.strip():
            continue
        try:
            result = await runner.run_async(session_id, text, metadata={"platform": "cli"})
        except ModelError as exc:  # the turn left no trace; the conversation can go on
            print(f"(the model failed: {exc}; try again)")
            continue
        print(f"{result.agent_name}> {result.content}")


async def _simulate(
    settings: Settings, database: Database, args: argparse.Namespace, spec: PlatformSpec[Any]
) -> int:
    """Post what the platform would (its spec's builder), then wait in the database for the turn's replies.

    Signs with the platform's configured secret, or else with the local mode's key (which the
    gateway accepts only from loopback clients).
    """
    group = platform_settings(settings, spec)
    secret = spec.webhook_secret(group)
    if secret is None:
        secret = _local_key(settings, spec)
    try:
        webhook = spec.simulate(args.text, args.user or spec.simulate_user, secret, group)
    except ValueError as exc:
        raise SettingsError(f"invalid --user {args.user!r}: {exc}") from None
    url = f"{(args.url or _local_url(settings)).rstrip('/')}/webhooks/{spec.name}"
    async with http_client(timeout=10) as client:
        try:
            response = await client.post(url, content=webhook.body, headers=webhook.headers)
        except httpx.HTTPError as exc:
            raise CommandFailed(
                f"cannot reach the gateway at {url} ({type(exc).__name__}); is it running?"
            ) from None
    if response.status_code != 200:
        raise CommandFailed(f"the gateway answered {response.status_code}: {response.text[:300]}")
    deadline = asyncio.get_running_loop().time() + args.timeout
    while (found := await inbox.outcome(database, webhook.dedup_key)) is None or found.status == "pending":
        if asyncio.get_running_loop().time() > deadline:
            raise CommandFailed(
                f"no reply within {args.timeout:g} s in {safe_url(settings.database_url)}"
                " (is the gateway using this database, and its worker running?)"
            )
        await asyncio.sleep(SIMULATE_POLL_SECONDS)
    if found.status == "dead":
        raise CommandFailed(f"the turn failed: {found.last_error}")
    for reply in found.replies:
        print(reply)
    return EXIT_OK


def _local_key(settings: Settings, spec: PlatformSpec[Any]) -> str:
    enabling = spec.enabling_variable
    if not settings.local_key_file:
        raise SettingsError(f"invalid setting {enabling}: needed when the local mode is off")
    try:
        return local_key.read(Path(settings.local_key_file))
    except (OSError, ValueError):
        raise CommandFailed(
            f"{spec.name} has no secret ({enabling}) and there is no local key at {settings.local_key_file}:"
            " start `gateway serve` in this directory first (it creates the key)"
        ) from None


def _local_url(settings: Settings) -> str:
    """The address `gateway serve` listens on, as a client reaches it (a wildcard bind means loopback)."""
    host = "127.0.0.1" if settings.host in {"0.0.0.0", "::", ""} else settings.host
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


async def _worker(settings: Settings, platforms: Sequence[PlatformSpec[Any]]) -> int:
    """Answer inbox rows and deliver replies until SIGTERM or Ctrl-C; rows in flight are handed back.

    The same services as `gateway serve` builds (one Database, so one SQLite writer), without HTTP.
    """
    tune_interpreter()
    services = build_services(settings, platforms)
    try:
        await migrations.ensure_head(services.database)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await services.start()
        await stop.wait()
    except CommandError as exc:
        raise CommandFailed(str(exc)) from None
    except FAILURE_ERRORS as exc:
        raise CommandFailed(describe_failure(settings.database_url, exc)) from None
    finally:
        await services.aclose()
    log.info("worker_stopped", owner=services.worker.owner)
    return EXIT_OK


async def _telegram(settings: Settings, args: argparse.Namespace) -> int:
    telegram = settings.group(TELEGRAM.name, TelegramSettings)
    if telegram.bot_token is None or telegram.secret_token is None:
        both = f"{TELEGRAM.sending_variable} / {TELEGRAM.enabling_variable}"
        raise SettingsError(f"invalid setting {both}: both are needed")
    async with http_client(timeout=30) as client:
        api = TelegramAPI(telegram.bot_token.get_secret_value(), telegram.api_base, client)
        try:
            if args.telegram_command == "set-webhook":
                url = _telegram_webhook_url(args.url)
                secret = telegram.secret_token.get_secret_value()
                await api.set_webhook(url, secret, drop_pending_updates=args.drop_pending)
                print(f"webhook set to {url}")
            else:
                info = await api.get_webhook_info()
                for key in WEBHOOK_INFO_FIELDS:
                    if key in info:
                        print(f"{key}: {info[key]}")
        except TelegramAPIError as exc:
            raise CommandFailed(str(exc)) from None
    return EXIT_OK


def _telegram_webhook_url(url: str) -> str:
    """A bare base URL gets the gateway's route appended; a full URL is kept as given."""
    if not url.startswith(("https://", "http://")):
        raise CommandFailed(f"not a URL: {url!r} (Telegram needs https://…)")
    return url if url.rstrip("/").endswith("/webhooks/telegram") else url.rstrip("/") + "/webhooks/telegram"


async def _purge(database: Database) -> int:
    await migrations.ensure_head(database)
    return await dedup.purge_expired(database)


async def _list_inbox(database: Database, status: str | None, limit: int) -> list[inbox.InboxItem]:
    await migrations.ensure_head(database)
    return await inbox.list_items(database, status, limit)


def _inbox(settings: Settings, args: argparse.Namespace) -> int:
    if args.inbox_command == "retry":
        if not _with_database(settings, lambda database: inbox.retry(database, args.id)):
            raise CommandFailed(f"no dead inbox row with id {args.id}")
        print(f"inbox row {args.id} requeued")
        return EXIT_OK
    items = _with_database(settings, lambda database: _list_inbox(database, args.status, args.limit))
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


def _on_sessions(settings: Settings, work: Callable[[Database], Awaitable[T]]) -> T:
    async def migrated(database: Database) -> T:
        await migrations.ensure_head(database)
        return await work(database)

    return _with_database(settings, migrated)


def _sessions(settings: Settings, args: argparse.Namespace) -> int:
    """`gateway sessions …`: the admin API's session routes, on the configured database."""
    action = args.sessions_command
    if action == "list":
        return _list_sessions(settings, args)
    session_id: str = args.id
    if action == "show":
        detail = _on_sessions(settings, lambda database: sessions.get_session(database, session_id))
        if detail is None:
            raise CommandFailed(f"no session {session_id!r}")
        _print_session(detail)
    elif action == "rename":
        try:
            title = sessions.clean_title(args.title)
        except ValueError as exc:
            raise SettingsError(f"invalid TITLE: {exc}") from None
        renamed = _on_sessions(
            settings, lambda database: sessions.rename_session(database, session_id, title)
        )
        if renamed is None:
            raise CommandFailed(f"no session {session_id!r}")
        print(f"session {session_id} renamed to {title!r}")
    else:
        if not _on_sessions(settings, lambda database: sessions.delete_session(database, session_id)):
            raise CommandFailed(f"no session {session_id!r}")
        print(f"session {session_id} deleted, with its messages")
    return EXIT_OK


def _list_sessions(settings: Settings, args: argparse.Namespace) -> int:
    after = None
    if args.cursor is not None:
        try:
            after = sessions.Cursor.decode(args.cursor)
        except ValueError:
            raise SettingsError("invalid --cursor: use the one printed after the previous page") from None
    if args.platform is not None and not sessions.is_valid_platform(args.platform):
        raise SettingsError("invalid --platform: 1-32 characters of A-Z a-z 0-9 _ -")
    if args.query is not None and not sessions.is_valid_query(args.query):
        raise SettingsError(f"invalid --query: at most {sessions.MAX_QUERY_LENGTH} characters")
    limit = min(args.limit, sessions.MAX_PAGE_SIZE)
    page = _on_sessions(
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


def _print_session(detail: sessions.SessionDetail) -> None:
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


def _db(settings: Settings, args: argparse.Namespace) -> int:
    action = args.db_command
    if action == "history":
        print(migrations.history(), end="")
    elif action == "upgrade":
        print(_with_database(settings, lambda e: migrations.upgrade(e, args.revision)), end="")
        print(f"database at {_with_database(settings, migrations.current)}")
    elif action == "downgrade":
        print(_with_database(settings, lambda e: migrations.downgrade(e, args.revision)), end="")
        print(f"database at {_with_database(settings, migrations.current) or 'base'}")
    elif action == "current":
        print(_with_database(settings, migrations.current) or "base (no migration applied)")
    elif action == "check":
        differences = _with_database(settings, migrations.check)
        if differences:
            raise CommandFailed(f"models and migrations differ: {differences}")
        print("models and migrations agree")
    return EXIT_OK


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    host = args.host or settings.host
    port = args.port or settings.port
    load_agent(settings.agent)  # a bad GATEWAY_AGENT stops start-up now, not at the first message
    turn_kinds(settings)
    if is_memory_sqlite(settings.database_url):
        if args.workers > 1:
            raise CommandFailed("an in-memory SQLite database cannot be shared by several --workers")
    elif args.no_migrate:
        _with_database(settings, lambda database: ping(database.engine))
    else:
        _with_database(settings, migrations.upgrade)
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
        create_app(settings),
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
