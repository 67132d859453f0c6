"""WhatsApp as the gateway runs it: its settings group, sender, pacing, reply target, the GET handshake
and simulated webhooks."""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
import structlog
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from gateway.domain.inbound import InboundMessage
from gateway.domain.outbound import ReplyTarget, WhatsAppTarget
from gateway.platforms.base import PlatformAdapter, Sender
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
from gateway.platforms.whatsapp.adapter import OBJECT_TYPE, PLATFORM, SIGNATURE_HEADER, WhatsAppAdapter
from gateway.platforms.whatsapp.api import WhatsAppSender

log = structlog.get_logger(__name__)

# The business number a simulated message is sent to (a made-up phone_number_id).
SIMULATED_PHONE_NUMBER_ID = "100000000000001"
SIMULATED_NAME = "Simulator"


class WhatsAppSettings(PlatformSettings):
    """GATEWAY_WHATSAPP_* (TOML: whatsapp_*, or a [whatsapp] table)."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_WHATSAPP_")

    verify_token: SecretStr | None = Field(
        default=None, description="The Verify token entered in Meta's App Dashboard (GET handshake)."
    )
    app_secret: SecretStr | None = Field(
        default=None, description="App secret that signs webhooks; WhatsApp is disabled without it."
    )
    access_token: SecretStr | None = Field(
        default=None, description="Token for sending; without it replies are dry-run (logged, not sent)."
    )
    api_base: str = Field(default="https://graph.facebook.com/v26.0", description="Graph API base.")
    global_per_second: float = Field(default=80, ge=0, description="WhatsApp sends per second overall.")

    @field_validator("api_base")
    @classmethod
    def _check_api_base(cls, value: str) -> str:
        return check_base_url(value)


def adapter(settings: WhatsAppSettings, app_secret: str) -> PlatformAdapter:
    return WhatsAppAdapter(app_secret)


def sender(settings: WhatsAppSettings, http: httpx.AsyncClient) -> Sender | None:
    token = secret(settings.access_token)
    return None if token is None else WhatsAppSender(settings.api_base, token, http)


def pacing(settings: WhatsAppSettings) -> PacingRule:
    """One limit for the business number's throughput; Meta sets no per-user rate."""
    overall = [(f"{PLATFORM}:global", interval(settings.global_per_second, 1))]

    def limits(target: ReplyTarget) -> list[Limit]:
        return list(overall)

    return limits


def reply_target(message: InboundMessage) -> WhatsAppTarget:
    """The user (by phone when known, else by business-scoped id) on the business number it wrote to."""
    return message_target(
        WhatsAppTarget,
        message,
        scope=message.conversation.scope,
        phone=message.phone,
        user_id=message.user_id,
    )


def answer_handshake(settings: WhatsAppSettings, request: HandshakeRequest) -> HandshakeReply:
    """Meta's GET: echo `hub.challenge` as plain text when mode and verify token are right, else 403."""
    query = request.query
    expected = secret(settings.verify_token) or ""
    if not WhatsAppAdapter.verify_handshake(
        query.get("hub.mode"), query.get("hub.verify_token") or "", expected
    ):
        log.warning("webhook_handshake_refused", platform=PLATFORM)
        return HandshakeReply(403, "Forbidden")
    return HandshakeReply(200, query.get("hub.challenge") or "")


def simulate(text: str, user: str, app_secret: str, settings: WhatsAppSettings) -> SimulatedWebhook:
    """A text from `user` (a phone number in digits), signed over its raw bytes like Meta's."""
    if not user.isascii() or not user.isdigit():
        raise ValueError("a WhatsApp user id is a phone number in digits, e.g. 15550000001")
    return simulated_webhook(
        adapter(settings, app_secret),
        _payload(text, user),
        lambda body: {SIGNATURE_HEADER: WhatsAppAdapter.sign(app_secret, body)},
    )


def _payload(text: str, phone: str) -> dict[str, Any]:
    value = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550000000", "phone_number_id": SIMULATED_PHONE_NUMBER_ID},
        "contacts": [{"profile": {"name": SIMULATED_NAME}, "wa_id": phone}],
        "messages": [
            {
                "from": phone,
                "id": f"wamid.SIMULATED{secrets.token_hex(12).upper()}",
                "timestamp": str(int(time.time())),
                "type": "text",
                "text": {"body": text},
            }
        ],
    }
    return {"object": OBJECT_TYPE, "entry": [{"id": "0", "changes": [{"value": value, "field": "messages"}]}]}


WHATSAPP: PlatformSpec[WhatsAppSettings] = PlatformSpec(
    name=PLATFORM,
    settings=WhatsAppSettings,
    secret_setting="app_secret",
    sending_setting="access_token",
    adapter=adapter,
    sender=sender,
    pacing=pacing,
    reply_target=reply_target,
    target_type=WhatsAppTarget,
    simulate=simulate,
    simulate_user="15550000001",
    handshake=Handshake("GET", answer_handshake),
)
