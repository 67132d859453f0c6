"""Echo: a platform that exists only in the tests, to prove a platform is one module and its fixtures.

Nothing under gateway/ names it; a test runs the gateway with `[*PLATFORMS, ECHO]` (`create_app`,
`build_services`, the CLI's `main` all take the list). It is written the way a real platform module in
gateway/platforms/ would be, with what the contract tests exercise:

- webhooks: `{"id": ..., "from": ..., "text": ...}`, signed with a hex HMAC-SHA256 of the raw body
  in `X-Echo-Signature` (the secret is GATEWAY_ECHO_SECRET, so the TOML key is `echo_secret`);
- a POST handshake in Slack's shape: `{"type": "url_verification", "challenge": ...}` is answered with
  the challenge (after the signature check) and nothing is stored;
- sending: `POST {api_base}/messages` `{"to", "text", "reply_to"}` with a bearer token
  (GATEWAY_ECHO_TOKEN), answered `{"id": ...}`; 429 and 5xx are transient, other 4xx permanent;
  `POST {api_base}/typing` shows the typing indicator;
- pacing: one global rate (GATEWAY_ECHO_PER_SECOND, 0 = unlimited).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, ClassVar

import httpx
import structlog
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from gateway.domain.inbound import ConversationKey, InboundMessage, MessageKind, ParsedUpdate
from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget
from gateway.platforms.base import DeliveryError, PlatformAdapter, Sender
from gateway.platforms.spec import (
    Handshake,
    HandshakeReply,
    HandshakeRequest,
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

NAME = "echo"
SIGNATURE_HEADER = "x-echo-signature"

log = structlog.get_logger(__name__)


class EchoSettings(PlatformSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_ECHO_")

    secret: SecretStr | None = Field(default=None, description="Signs webhooks; echo is disabled without it.")
    token: SecretStr | None = Field(default=None, description="Bearer token for sending; dry-run without it.")
    api_base: str = Field(default="http://127.0.0.1:9", description="Where replies are posted.")
    per_second: float = Field(default=0, ge=0, description="Sends per second overall (0: unlimited).")

    @field_validator("api_base")
    @classmethod
    def _check_api_base(cls, value: str) -> str:
        return check_base_url(value)


@dataclass(frozen=True)
class EchoTarget(ReplyTarget):
    """An echo user; `chat_id` is the user's id, `reply_to` the message answered."""

    platform: ClassVar[str] = NAME


def sign(secret_key: str, body: bytes) -> str:
    return hmac.new(secret_key.encode(), body, hashlib.sha256).hexdigest()


class EchoAdapter:
    name = NAME

    def __init__(self, secret_key: str) -> None:
        self._secret = secret_key

    def verify_headers(self, headers: Mapping[str, str]) -> bool:
        return bool(self._secret) and isinstance(headers.get(SIGNATURE_HEADER), str)

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        given = headers.get(SIGNATURE_HEADER)
        if not self._secret or not isinstance(given, str) or not given.isascii():
            return False
        return hmac.compare_digest(given, sign(self._secret, body))

    def parse(self, payload: dict[str, Any]) -> ParsedUpdate:
        """One text message, or nothing for any other shape (never raises)."""
        ident, sender, text = (payload.get(key) for key in ("id", "from", "text"))
        if not (isinstance(ident, str) and ident and isinstance(sender, str) and sender):
            return ParsedUpdate()
        if not isinstance(text, str):
            return ParsedUpdate()
        message = InboundMessage(
            platform=NAME,
            message_id=ident,
            dedup_key=f"{NAME}:{ident}",
            conversation=ConversationKey(NAME, sender),
            kind=MessageKind.TEXT,
            timestamp=datetime.now(UTC),
            user_id=sender,
            text=text,
            raw=payload,
        )
        return ParsedUpdate(messages=[message])


class EchoSender:
    def __init__(self, api_base: str, token: str, http: httpx.AsyncClient) -> None:
        self._base = api_base
        self._headers = {"Authorization": f"Bearer {token}"}
        self._http = http

    async def send(self, message: OutboundMessage) -> str | None:
        if message.kind is not OutboundKind.TEXT:
            return None
        target = message.target
        body = {"to": target.chat_id, "text": message.text or "", "reply_to": target.reply_to}
        try:
            response = await self._http.post(f"{self._base}/messages", json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise DeliveryError(f"cannot reach echo ({type(exc).__name__})", permanent=False) from None
        if response.status_code == 200:
            return str(response.json()["id"])
        status = response.status_code
        retry_after = response.headers.get("retry-after")
        raise DeliveryError(
            f"echo send failed ({status})",
            permanent=400 <= status < 500 and status != 429,
            code=str(status),
            retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
        )

    async def indicate_typing(self, target: ReplyTarget) -> None:
        try:
            await self._http.post(f"{self._base}/typing", json={"to": target.chat_id}, headers=self._headers)
        except Exception as exc:  # best effort
            log.debug("typing_indicator_failed", platform=NAME, error=type(exc).__name__)


def adapter(settings: EchoSettings, secret_key: str) -> PlatformAdapter:
    return EchoAdapter(secret_key)


def sender(settings: EchoSettings, http: httpx.AsyncClient) -> Sender | None:
    token = secret(settings.token)
    return None if token is None else EchoSender(settings.api_base, token, http)


def pacing(settings: EchoSettings) -> PacingRule:
    overall = interval(settings.per_second, 1)

    def limits(target: ReplyTarget) -> list[Limit]:
        return [(f"{NAME}:global", overall)]

    return limits


def reply_target(message: InboundMessage) -> EchoTarget:
    return message_target(EchoTarget, message)


def answer_url_verification(settings: EchoSettings, request: HandshakeRequest) -> HandshakeReply | None:
    payload = request.payload or {}
    challenge = payload.get("challenge")
    if payload.get("type") != "url_verification" or not isinstance(challenge, str):
        return None
    return HandshakeReply(200, challenge)


def simulate(text: str, user: str, secret_key: str, settings: EchoSettings) -> SimulatedWebhook:
    if not user.strip():
        raise ValueError("an echo user id is not empty")
    payload = {"id": f"sim-{secrets.token_hex(8)}", "from": user, "text": text}
    return simulated_webhook(
        EchoAdapter(secret_key), payload, lambda body: {SIGNATURE_HEADER: sign(secret_key, body)}
    )


ECHO: PlatformSpec[EchoSettings] = PlatformSpec(
    name=NAME,
    settings=EchoSettings,
    secret_setting="secret",
    sending_setting="token",
    adapter=adapter,
    sender=sender,
    pacing=pacing,
    reply_target=reply_target,
    target_type=EchoTarget,
    simulate=simulate,
    simulate_user="echo-user-1",
    handshake=Handshake("POST", answer_url_verification),
)
