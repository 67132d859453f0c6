"""Sending WhatsApp replies through the Cloud API: `POST {api_base}/{phone_number_id}/messages`.

The same endpoint marks an inbound message read and shows the typing indicator (`indicate_typing`).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import structlog

from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget, WhatsAppTarget
from gateway.http_client import endpoint, post
from gateway.platforms.base import DeliveryError

# Meta's throttling and transient codes: back off and retry. Anything else is final (see platform specs).
RETRYABLE_CODES = frozenset({4, 80007, 130429, 131000, 131056, 131057})

log = structlog.get_logger(__name__)


class WhatsAppSender:
    def __init__(self, api_base: str, access_token: str, client: httpx.AsyncClient) -> None:
        self._api_base = api_base.rstrip("/")
        self._headers = {"Authorization": f"Bearer {access_token}", "Content-Type": "application/json"}
        self._client = client

    def __repr__(self) -> str:
        return "WhatsAppSender(<token hidden>)"

    async def send(self, message: OutboundMessage) -> str | None:
        if message.kind is not OutboundKind.TEXT:
            return None  # WhatsApp has no callback queries to answer
        target = _whatsapp_target(message.target)
        if not target.scope:
            raise DeliveryError("no business number (scope) to send from", permanent=True)
        body: dict[str, Any] = {
            "messaging_product": "whatsapp",
            "recipient_type": "individual",
            "type": "text",
            "text": {"preview_url": False, "body": message.text or ""},
        }
        if target.phone:
            body["to"] = target.phone
        else:
            body["recipient"] = target.user_id or target.chat_id  # a business-scoped user id
        url = f"{self._api_base}/{target.scope}/messages"
        try:
            response = await post(self._client, endpoint(url), orjson.dumps(body), self._headers)
        except httpx.HTTPError as exc:
            raise DeliveryError(
                f"cannot reach the Graph API ({type(exc).__name__})", permanent=False
            ) from None
        try:
            data = response.json()
        except ValueError:
            data = {}
        if response.status_code == 200 and data.get("messages"):
            return str(data["messages"][0].get("id"))
        error = data.get("error") or {}
        code = error.get("code")
        retry = response.status_code >= 500 or response.status_code == 429 or code in RETRYABLE_CODES
        failure = (
            f"WhatsApp send failed ({response.status_code}, code {code}): {error.get('message', '')[:200]}"
        )
        raise DeliveryError(failure, permanent=not retry, code=None if code is None else str(code))

    async def indicate_typing(self, target: ReplyTarget) -> None:
        """Mark the inbound message `target.reply_to` (its wamid) read and show "typing…".

        WhatsApp shows the indicator until the reply arrives or for 25 s. Best effort: never raises.
        """
        whatsapp = _whatsapp_target(target)
        scope, wamid = whatsapp.scope, whatsapp.reply_to
        if not scope or not wamid:
            log.debug("typing_indicator_skipped", platform="whatsapp", reason="no_scope_or_message_id")
            return
        body = {
            "messaging_product": "whatsapp",
            "status": "read",
            "message_id": str(wamid),
            "typing_indicator": {"type": "text"},
        }
        try:
            url = endpoint(f"{self._api_base}/{scope}/messages")
            response = await post(self._client, url, orjson.dumps(body), self._headers)
        except Exception as exc:  # the message of some httpx errors holds the URL; log the type only
            log.debug("typing_indicator_failed", platform="whatsapp", error=type(exc).__name__)
            return
        if response.status_code == 200:
            return
        try:
            data = response.json()
        except ValueError:
            data = {}
        error = (data.get("error") if isinstance(data, dict) else None) or {}
        code = error.get("code") if isinstance(error, dict) else None
        code = code if isinstance(code, int) else None
        transient = response.status_code >= 500 or response.status_code == 429 or code in RETRYABLE_CODES
        (log.debug if transient else log.warning)(
            "typing_indicator_failed", platform="whatsapp", status=response.status_code, code=code
        )


def _whatsapp_target(target: ReplyTarget) -> WhatsAppTarget:
    """The target as WhatsApp's; another kind (a row decoded without its platform) is read field by field."""
    return target if isinstance(target, WhatsAppTarget) else WhatsAppTarget.from_json(target.to_json())
