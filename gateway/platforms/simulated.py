"""Webhooks as the platforms would send them, for `gateway simulate`: one text from one user."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from gateway.platforms import telegram, whatsapp
from gateway.platforms.telegram import TelegramAdapter
from gateway.platforms.whatsapp import WhatsAppAdapter

DEFAULT_USER = {"telegram": "1000001", "whatsapp": "15550000001"}
# The business number a simulated WhatsApp message is sent to (a made-up phone_number_id).
SIMULATED_PHONE_NUMBER_ID = "100000000000001"
SIMULATED_NAME = "Simulator"


@dataclass(frozen=True)
class SimulatedWebhook:
    body: bytes
    headers: dict[str, str]
    dedup_key: str  # how the gateway will know the message: the inbox row to wait for


def build(platform: str, text: str, user: str, secret: str, bot_id: str = "0") -> SimulatedWebhook:
    """A signed webhook carrying `text` from `user`; ValueError for a user id the platform cannot have."""
    if platform == "telegram":
        if not user.isascii() or not user.isdigit():
            raise ValueError("a Telegram user id is a number")
        body = _json(_telegram_update(text, int(user)))
        headers = {telegram.SECRET_HEADER: secret}
        adapter: TelegramAdapter | WhatsAppAdapter = TelegramAdapter(secret, bot_id)
    else:
        if not user.isascii() or not user.isdigit():
            raise ValueError("a WhatsApp user id is a phone number in digits, e.g. 15550000001")
        body = _json(_whatsapp_payload(text, user))
        headers = {whatsapp.SIGNATURE_HEADER: WhatsAppAdapter.sign(secret, body)}
        adapter = WhatsAppAdapter(secret)
    # Parsed by the gateway's own adapter, so the key is the one the webhook will store.
    (message,) = adapter.parse(json.loads(body)).messages
    return SimulatedWebhook(body, {"content-type": "application/json", **headers}, message.dedup_key)


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode()


def _telegram_update(text: str, user: int) -> dict[str, Any]:
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


def _whatsapp_payload(text: str, phone: str) -> dict[str, Any]:
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
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "0", "changes": [{"value": value, "field": "messages"}]}],
    }
