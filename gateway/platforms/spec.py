"""What one platform is to the gateway: a `PlatformSpec`, and the plain values its parts exchange.

A spec names the platform and its settings group, and gives the factories the rest of the gateway
calls: the webhook's adapter, the sender, the pacing rule, an optional handshake, the builder of
`gateway simulate`'s webhooks and the typed reply target. web/webhooks.py, bootstrap, the worker and
`gateway simulate` only read specs; none of them names a platform. Adding a platform is one module
(or package) defining its spec, one line in registry.py and payload fixtures (docs/platforms-howto.md).

Nothing here is Starlette: a handshake answers with a `HandshakeReply` that web/ turns into a response.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.domain.inbound import InboundMessage
from gateway.domain.outbound import ReplyTarget
from gateway.platforms.base import PlatformAdapter, Sender
from gateway.urls import check_base_url as check_base_url  # for the platforms' settings (re-exported)

ENV_PREFIX = "GATEWAY_"

# (key, minimum seconds between two sends under that key): what a send must wait for.
Limit = tuple[str, float]
# A platform's rate limits: which limits a reply to this target falls under.
PacingRule = Callable[[ReplyTarget], list[Limit]]
T = TypeVar("T", bound=ReplyTarget)


class PlatformSettings(BaseSettings):
    """Base of a platform's settings group; a subclass sets `env_prefix="GATEWAY_<NAME>_"`.

    Each field `f` of platform `name` is the environment variable GATEWAY_<NAME>_<F> and the TOML key
    `<name>_<f>` (or `f` in a `[<name>]` table): the names the flat settings always had. The
    environment wins over the file, as for every setting; an empty secret means unset.
    """

    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, case_sensitive=False, validate_default=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _empty_secret_is_none(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if value == "" and field is not None and is_secret(field.annotation):
            return None
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs; the environment wins over them.
        return env_settings, init_settings

    def secret_values(self) -> list[str]:
        """The secrets this group holds, for the log redactor."""
        values = (getattr(self, name) for name in type(self).model_fields)
        return [v.get_secret_value() for v in values if isinstance(v, SecretStr) and v.get_secret_value()]


S = TypeVar("S", bound=PlatformSettings)


def is_secret(annotation: Any) -> bool:
    """True for `SecretStr` and `SecretStr | None`: values never echoed in an error or a log."""
    return annotation is SecretStr or SecretStr in getattr(annotation, "__args__", ())


def secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def interval(per_period: float, period_seconds: float) -> float:
    """`per_period` sends per `period_seconds` as the gap between two sends (0 means unlimited)."""
    return period_seconds / per_period if per_period > 0 else 0.0


def message_target(target_type: type[T], message: InboundMessage, **fields: Any) -> T:
    """A `target_type` for the reply to `message`: its conversation's chat, the message it answers,
    and the platform's `fields`."""
    return target_type.from_json({"chat_id": message.chat_id, "reply_to": message.message_id, **fields})


@dataclass(frozen=True)
class HandshakeRequest:
    """What a handshake hook sees of a request: its query, and a POST's verified JSON body."""

    query: Mapping[str, str]
    payload: dict[str, Any] | None = None


@dataclass(frozen=True)
class HandshakeReply:
    status: int
    body: str
    content_type: str = "text/plain"


@dataclass(frozen=True)
class Handshake(Generic[S]):
    """A platform's check that the webhook URL is its own, answered instead of a normal webhook.

    "GET" (WhatsApp's hub.challenge): answers GET /webhooks/{name} of an enabled platform; a None
    reply is 405. "POST" (e.g. Slack's url_verification): asked after the signature is verified and
    the body parsed, before the adapter parses it; a reply is sent as is and nothing is stored, None
    lets the webhook go on as usual.
    """

    method: Literal["GET", "POST"]
    answer: Callable[[S, HandshakeRequest], HandshakeReply | None]


@dataclass(frozen=True)
class SimulatedWebhook:
    """A webhook as the platform would send it, for `gateway simulate`."""

    body: bytes
    headers: dict[str, str]
    dedup_key: str  # how the gateway will know the message: the inbox row to wait for


def simulated_webhook(
    adapter: PlatformAdapter, payload: dict[str, Any], headers: Callable[[bytes], Mapping[str, str]]
) -> SimulatedWebhook:
    """`payload` as JSON with the `headers` that sign it; its key as the gateway's own adapter parses it.

    ValueError when the adapter makes no single message of it.
    """
    body = json.dumps(payload, ensure_ascii=False).encode()
    messages = adapter.parse(json.loads(body)).messages
    if len(messages) != 1:
        raise ValueError(f"the simulated webhook carries {len(messages)} messages, not one")
    signed = {"content-type": "application/json", **headers(body)}
    return SimulatedWebhook(body, signed, messages[0].dedup_key)


@dataclass(frozen=True)
class PlatformSpec(Generic[S]):
    """One platform: everything the webhook route, bootstrap, the worker and the CLI need of it."""

    name: str  # the route /webhooks/{name}, the prefix of its session ids, its settings group
    settings: type[S]  # its settings group (env prefix GATEWAY_<NAME>_)
    secret_setting: str  # the field holding the webhook secret; unset, the platform is disabled
    sending_setting: str  # the field holding the token to send with; unset, replies are dry-run
    adapter: Callable[[S, str], PlatformAdapter]  # (settings, webhook secret or local key)
    sender: Callable[[S, httpx.AsyncClient], Sender | None]  # None: dry-run
    pacing: Callable[[S], PacingRule]
    reply_target: Callable[[InboundMessage], ReplyTarget]  # where the reply to a message goes
    target_type: type[ReplyTarget]  # decodes stored targets (`from_json`)
    simulate: Callable[[str, str, str, S], SimulatedWebhook]  # (text, user, secret, settings)
    simulate_user: str  # the sender `gateway simulate` uses when given none
    handshake: Handshake[S] | None = None
    # Work beside its webhooks while the gateway serves them, given the adapter in use (Telegram
    # learns its bot's username); runs until cancelled at shutdown, never raises.
    background: Callable[[S, PlatformAdapter, httpx.AsyncClient], Coroutine[Any, Any, None]] | None = None

    def variable(self, field: str) -> str:
        """The environment variable of one of its settings."""
        return f"{ENV_PREFIX}{self.name.upper()}_{field.upper()}"

    @property
    def enabling_variable(self) -> str:
        return self.variable(self.secret_setting)

    @property
    def sending_variable(self) -> str:
        return self.variable(self.sending_setting)

    def webhook_secret(self, settings: S) -> str | None:
        """The secret its webhooks are signed with, when configured."""
        value = getattr(settings, self.secret_setting)
        if value is None:
            return None
        return value.get_secret_value() if isinstance(value, SecretStr) else str(value)

    def sends_for_real(self, settings: S) -> bool:
        return getattr(settings, self.sending_setting) is not None


@dataclass(frozen=True)
class ConfiguredPlatform:
    """A platform with its settings, as bootstrap builds it for the webhook route: the adapter checking
    its requests when it is enabled, the local mode's when that is on instead."""

    spec: PlatformSpec[Any]
    settings: PlatformSettings
    adapter: PlatformAdapter | None = None  # None: disabled, its webhook secret is not configured
    local_adapter: PlatformAdapter | None = None  # the local mode's, for a disabled platform

    @property
    def enabled(self) -> bool:
        return self.adapter is not None
