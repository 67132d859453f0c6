"""`gateway simulate PLATFORM TEXT`: post a signed webhook to a running gateway and print the reply."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.bootstrap import platform_settings
from gateway.cli.common import EXIT_OK, CommandFailed, seconds, with_database
from gateway.errors import SettingsError
from gateway.http_client import http_client
from gateway.platforms import local_key
from gateway.platforms.registry import by_name
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings
from gateway.store import inbox
from gateway.store.database import Database
from gateway.store.engine import safe_url

SIMULATE_POLL_SECONDS = 0.05  # how often `gateway simulate` looks for the reply


def register(commands: Any, platforms: Sequence[PlatformSpec[Any]]) -> None:
    simulate = commands.add_parser(
        "simulate", help="send a signed webhook to a running gateway and print the reply"
    )
    simulate.add_argument("platform", choices=[spec.name for spec in platforms])
    simulate.add_argument("text", help="the message")
    defaults = ", ".join(f"{spec.name} {spec.simulate_user}" for spec in platforms)
    simulate.add_argument("--user", help=f"sender: the user's id on the platform (default: {defaults})")
    simulate.add_argument("--url", help="the gateway (default: http://GATEWAY_HOST:GATEWAY_PORT)")
    simulate.add_argument(
        "--timeout", type=seconds, default=30, help="seconds to wait for the reply (default 30, at most 3600)"
    )
    simulate.set_defaults(run=run)


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    spec = by_name(platforms)[args.platform]
    return with_database(settings, lambda database: _simulate(settings, database, args, spec))


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
    except ValueError as exc:  # empty, or readable by other users
        raise CommandFailed(f"the local key cannot be used: {exc}") from None
    except OSError:
        raise CommandFailed(
            f"{spec.name} has no secret ({enabling}) and there is no local key at {settings.local_key_file}:"
            " start `gateway serve` in this directory first (it creates the key)"
        ) from None


def _local_url(settings: Settings) -> str:
    """The address `gateway serve` listens on, as a client reaches it (a wildcard bind means loopback)."""
    host = "127.0.0.1" if settings.host in {"0.0.0.0", "::", ""} else settings.host
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"
