"""`gateway telegram set-webhook|webhook-info`: the bot's webhook registration."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from gateway.bootstrap import HTTP_TIMEOUT_SECONDS
from gateway.cli.common import EXIT_OK, CommandFailed
from gateway.errors import SettingsError
from gateway.http_client import http_client
from gateway.platforms.spec import PlatformSpec
from gateway.platforms.telegram.api import WEBHOOK_PORTS, TelegramAPI, TelegramAPIError
from gateway.platforms.telegram.spec import TELEGRAM, TelegramSettings
from gateway.settings import Settings

WEBHOOK_INFO_FIELDS = (
    "url",
    "pending_update_count",
    "last_error_date",
    "last_error_message",
    "max_connections",
)


def register(commands: Any) -> None:
    group = commands.add_parser("telegram", help="the bot's webhook registration")
    group.set_defaults(run=run)
    telegram = group.add_subparsers(dest="telegram_command", required=True, metavar="ACTION")
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


def run(settings: Settings, args: argparse.Namespace, platforms: Sequence[PlatformSpec[Any]]) -> int:
    return asyncio.run(_telegram(settings, args))


async def _telegram(settings: Settings, args: argparse.Namespace) -> int:
    telegram = settings.group(TELEGRAM.name, TelegramSettings)
    if telegram.bot_token is None or telegram.secret_token is None:
        both = f"{TELEGRAM.sending_variable} / {TELEGRAM.enabling_variable}"
        raise SettingsError(f"invalid setting {both}: both are needed")
    async with http_client(HTTP_TIMEOUT_SECONDS) as client:
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
    """A bare base URL gets the gateway's route appended; a full URL is kept as given. What Telegram
    would refuse (it posts over HTTPS only, to WEBHOOK_PORTS) is refused here, in words."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise CommandFailed(f"not a URL: {url!r}") from None
    if parts.scheme != "https" or not parts.hostname:
        raise CommandFailed(f"not an https:// URL: {url!r} (Telegram posts webhooks over HTTPS only)")
    if port is not None and port not in WEBHOOK_PORTS:
        allowed = ", ".join(str(p) for p in WEBHOOK_PORTS[:-1]) + f" and {WEBHOOK_PORTS[-1]}"
        raise CommandFailed(f"port {port}: Telegram sends webhooks to ports {allowed} only")
    return url if url.rstrip("/").endswith("/webhooks/telegram") else url.rstrip("/") + "/webhooks/telegram"
