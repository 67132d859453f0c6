"""Telegram as the gateway runs it: its settings group, sender, pacing, reply target and simulated updates."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import httpx
import structlog
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from gateway.domain.inbound import InboundMessage
from gateway.domain.outbound import ReplyTarget, TelegramTarget
from gateway.platforms.base import PlatformAdapter, Sender
from gateway.platforms.spec import (
    Limit,
    PacingRule,
    PlatformSettings,
    PlatformSpec,
    SimulatedWebhook,
    check_base_url,
    interval,
    message_target,
    secret,
    simulated_webhook,
)
from gateway.platforms.telegram.adapter import SECRET_HEADER, TelegramAdapter
from gateway.platforms.telegram.api import TelegramAPI, TelegramSender
from gateway.platforms.telegram.identity import keep_identity

log = structlog.get_logger(__name__)

NAME = "telegram"
SIMULATED_NAME = "Simulator"


class TelegramSettings(PlatformSettings):
    """GATEWAY_TELEGRAM_* (TOML: telegram_*, or a [telegram] table)."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_TELEGRAM_")

    secret_token: SecretStr | None = Field(
        default=None, description="secret_token given to setWebhook; Telegram is disabled without it."
    )
    bot_token: SecretStr | None = Field(
        default=None, description="Bot token from @BotFather; without it replies are dry-run."
    )
    bot_username: str | None = Field(
        default=None,
        description="The bot's @username, where getMe cannot reach the Bot API at start-up "
        "(unset: asked of getMe; group @mentions are answered once it is known).",
    )
    api_base: str = Field(default="https://api.telegram.org", description="Bot API base.")
    chat_per_second: float = Field(default=1, ge=0, description="Sends per private chat per second.")
    group_per_minute: float = Field(default=20, ge=0, description="Sends per group chat per minute.")
    global_per_second: float = Field(default=30, ge=0, description="Telegram sends per second overall.")

    @field_validator("secret_token")
    @classmethod
    def _check_secret_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,256}", value.get_secret_value()):
            raise ValueError("must be 1-256 characters of A-Z, a-z, 0-9, _ and - (Telegram's rule)")
        return value

    @field_validator("bot_token")
    @classmethod
    def _check_bot_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"\d+:[A-Za-z0-9_-]+", value.get_secret_value()):
            raise ValueError("is not a bot token of the form <digits>:<secret> (see @BotFather)")
        return value

    @field_validator("bot_username")
    @classmethod
    def _check_bot_username(cls, value: str | None) -> str | None:
        if not value:
            return None
        name = value.removeprefix("@")
        if not re.fullmatch(r"[A-Za-z0-9_]{5,32}", name) or not name.casefold().endswith("bot"):
            raise ValueError("is not a bot's username (5-32 of A-Z, a-z, 0-9 and _, ending in 'bot')")
        return name

    @field_validator("api_base")
    @classmethod
    def _check_api_base(cls, value: str) -> str:
        return check_base_url(value)

    @property
    def bot_id(self) -> str:
        """The bot's id, from its token; without a token it is unknown and dedup keys use "0" for it."""
        token = secret(self.bot_token)
        return TelegramAdapter.bot_id_from_token(token) if token else "0"


def adapter(settings: TelegramSettings, secret_token: str) -> PlatformAdapter:
    return TelegramAdapter(secret_token, settings.bot_id, settings.bot_username)


async def learn_identity(
    settings: TelegramSettings, adapter: PlatformAdapter, http: httpx.AsyncClient
) -> None:
    """The bot's username for the adapter: the setting when given, else getMe's (see identity.py)."""
    if not isinstance(adapter, TelegramAdapter):
        return
    if settings.bot_username:
        log.info("telegram_bot_identity", bot_username=settings.bot_username, source="settings")
        return
    token = secret(settings.bot_token)
    if token is None:
        log.warning(
            "telegram_bot_username_unknown",
            consequence="group messages that @mention the bot are recorded, not answered",
            fix_with=TELEGRAM.variable("bot_token") + " or " + TELEGRAM.variable("bot_username"),
        )
        return
    await keep_identity(TelegramAPI(token, settings.api_base, http), adapter.identity)


def sender(settings: TelegramSettings, http: httpx.AsyncClient) -> Sender | None:
    token = secret(settings.bot_token)
    return None if token is None else TelegramSender(TelegramAPI(token, settings.api_base, http))


def pacing(settings: TelegramSettings) -> PacingRule:
    """Per chat (a group, whose id is negative, has its own slower rate) and for the bot overall."""
    per_chat = interval(settings.chat_per_second, 1)
    per_group = interval(settings.group_per_minute, 60)
    overall = interval(settings.global_per_second, 1)

    def limits(target: ReplyTarget) -> list[Limit]:
        chat = target.chat_id
        return [
            (f"{NAME}:chat:{chat}", per_group if chat.startswith("-") else per_chat),
            (f"{NAME}:global", overall),
        ]

    return limits


def reply_target(message: InboundMessage) -> TelegramTarget:
    """The chat and forum topic of the message; in a group the reply quotes it (`chat_type`); a pressed
    button's query, to answer; a business chat's connection (the conversation's scope), to answer as
    the business."""
    return message_target(
        TelegramTarget,
        message,
        thread_id=message.thread_id,
        chat_type=message.chat_type,
        callback_query_id=message.callback_query_id,
        business_connection_id=message.conversation.scope,
    )


def simulate(text: str, user: str, secret_token: str, settings: TelegramSettings) -> SimulatedWebhook:
    """A private-chat text update from `user` (a numeric user id), with the secret-token header."""
    if not user.isascii() or not user.isdigit():
        raise ValueError("a Telegram user id is a number")
    return simulated_webhook(
        adapter(settings, secret_token), _update(text, int(user)), lambda body: {SECRET_HEADER: secret_token}
    )


def _update(text: str, user: int) -> dict[str, Any]:
    person = {"id": user, "is_bot": False, "first_name": SIMULATED_NAME}
    return {
        # Random ids: each run is a new update, never a duplicate of an earlier one.
        "update_id": secrets.randbelow(2**31),
        "message": {
            "message_id": secrets.randbelow(2**31),
            "date": int(time.time()),
            "chat": {"id": user, "type": "private", "first_name": SIMULATED_NAME},
            "from": person,
            "text": text,
        },
    }


TELEGRAM: PlatformSpec[TelegramSettings] = PlatformSpec(
    name=NAME,
    settings=TelegramSettings,
    secret_setting="secret_token",
    sending_setting="bot_token",
    adapter=adapter,
    sender=sender,
    pacing=pacing,
    reply_target=reply_target,
    target_type=TelegramTarget,
    simulate=simulate,
    simulate_user="1000001",
    background=learn_identity,
)
