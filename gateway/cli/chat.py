"""`gateway chat`: talk to the configured agent in the terminal."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from gateway.agents import ModelError
from gateway.bootstrap import build_runner
from gateway.cli.common import EXIT_OK, with_database
from gateway.domain import sessions as session_rules
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import migrations
from gateway.store.database import Database


def register(commands: Any) -> None:
    chat = commands.add_parser("chat", help="talk to the configured agent in the terminal")
    chat.add_argument(
        "--session", type=_session_id, help="session id to resume or create (default: a new cli:<random> id)"
    )
    chat.set_defaults(run=run)


def _session_id(value: str) -> str:
    # A longer one reached the database (PostgreSQL refused it as "cannot use the database").
    if not session_rules.is_valid_session_id(value):
        raise argparse.ArgumentTypeError(
            f"1 to {session_rules.MAX_SESSION_ID_LENGTH} characters, none of them a control character"
        )
    return value


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    return with_database(settings, lambda database: _chat(settings, database, args.session))


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
