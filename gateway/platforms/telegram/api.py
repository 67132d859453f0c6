"""A small Bot API client: one method call per request, errors with Telegram's code and description.

Used by `gateway telegram set-webhook|webhook-info` and by delivery (sendMessage, answerCallbackQuery,
sendChatAction). The token is part of the URL, so URLs are never logged.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import structlog

from gateway.domain.outbound import OutboundKind, OutboundMessage, ReplyTarget, TelegramTarget
from gateway.errors import GatewayError
from gateway.http_client import endpoint, post
from gateway.platforms.base import DeliveryError

# The update kinds the Telegram adapter acts on or records; what setWebhook asks Telegram to send.
ALLOWED_UPDATES = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "business_message",
    "edited_business_message",
    "callback_query",
    "my_chat_member",
    "message_reaction",
)

log = structlog.get_logger(__name__)
JSON = {"Content-Type": "application/json"}
# The only ports setWebhook takes, over HTTPS only.
WEBHOOK_PORTS = (443, 80, 88, 8443)


class TelegramAPIError(GatewayError):
    """A refused or failed call; `retry_after` and `migrate_to_chat_id` are Telegram's ResponseParameters."""

    def __init__(
        self,
        method: str,
        code: int | None,
        description: str,
        retry_after: float | None = None,
        migrate_to_chat_id: int | None = None,
    ) -> None:
        super().__init__(f"Telegram {method} failed{'' if code is None else f' ({code})'}: {description}")
        self.code = code
        self.description = description
        self.retry_after = retry_after
        self.migrate_to_chat_id = migrate_to_chat_id


class TelegramAPI:
    def __init__(self, token: str, api_base: str, client: httpx.AsyncClient) -> None:
        self._url = f"{api_base.rstrip('/')}/bot{token}"
        self._client = client

    def __repr__(self) -> str:
        return "TelegramAPI(<token hidden>)"

    async def call(self, method: str, **params: Any) -> Any:
        """POST one method; its `result`, or TelegramAPIError with Telegram's code and description."""
        try:
            body = orjson.dumps(params)
            response = await post(self._client, endpoint(f"{self._url}/{method}"), body, JSON)
        except httpx.HTTPError as exc:  # the message of some httpx errors holds the URL, i.e. the token
            raise TelegramAPIError(method, None, f"cannot reach the Bot API ({type(exc).__name__})") from None
        try:
            body = response.json()
        except ValueError:
            raise TelegramAPIError(method, response.status_code, response.text[:200]) from None
        if not isinstance(body, dict) or not body.get("ok"):
            data = body if isinstance(body, dict) else {}
            parameters = data.get("parameters")
            parameters = parameters if isinstance(parameters, dict) else {}
            code = data.get("error_code", response.status_code)
            raise TelegramAPIError(
                method,
                code,
                str(data.get("description", "no description")),
                parameters.get("retry_after"),
                _chat_id(parameters.get("migrate_to_chat_id")),
            )
        return body.get("result")

    async def set_webhook(self, url: str, secret_token: str, *, drop_pending_updates: bool = False) -> Any:
        return await self.call(
            "setWebhook",
            url=url,
            secret_token=secret_token,
            allowed_updates=list(ALLOWED_UPDATES),
            drop_pending_updates=drop_pending_updates,
        )

    async def get_webhook_info(self) -> dict[str, Any]:
        info = await self.call("getWebhookInfo")
        return info if isinstance(info, dict) else {}


class TelegramSender:
    """Outbound messages to Bot API calls: sendMessage (in the topic it came from) and
    answerCallbackQuery; sendChatAction for the typing indicator.

    A group upgraded to a supergroup gets a new chat id: Telegram refuses a sendMessage to the old one
    with 400 and `migrate_to_chat_id`, and the message is then sent once more, to the new id.
    """

    def __init__(self, api: TelegramAPI) -> None:
        self.api = api

    async def send(self, message: OutboundMessage) -> str | None:
        target = _telegram_target(message.target)
        try:
            if message.kind is OutboundKind.ANSWER_CALLBACK:
                if not target.callback_query_id:
                    raise DeliveryError("no callback query to answer", permanent=True)
                await self.api.call("answerCallbackQuery", callback_query_id=target.callback_query_id)
                return None
            params: dict[str, Any] = {"chat_id": target.chat_id, "text": message.text or ""}
            if target.business_connection_id:
                params["business_connection_id"] = target.business_connection_id
            if target.thread_id:
                params["message_thread_id"] = int(target.thread_id)
            reply_to = target.reply_to or ""
            if target.chat_type == "group" and reply_to.rpartition(":")[2].isdigit():
                # In a group, quote the message being answered; message ids are "<chat>:<id>".
                params["reply_parameters"] = {
                    "message_id": int(reply_to.rpartition(":")[2]),
                    "allow_sending_without_reply": True,
                }
            try:
                result = await self.api.call("sendMessage", **params)
            except TelegramAPIError as exc:
                if exc.migrate_to_chat_id is None:
                    raise
                result = await self._resend_migrated(params, exc.migrate_to_chat_id)
        except TelegramAPIError as exc:
            raise _delivery_error(exc) from None
        return str(result["message_id"]) if isinstance(result, dict) and "message_id" in result else None

    async def _resend_migrated(self, params: dict[str, Any], new_chat_id: int) -> Any:
        """The same message, once, to the supergroup the group became.

        The message being quoted and the topic belong to the old chat (a basic group has no topics),
        so both are left out rather than pointing at a message or thread of the new chat by mistake.
        """
        log.info("telegram_chat_migrated", chat_id=str(params["chat_id"]), new_chat_id=str(new_chat_id))
        resend = {
            key: value
            for key, value in params.items()
            if key not in {"reply_parameters", "message_thread_id"}
        }
        resend["chat_id"] = new_chat_id
        return await self.api.call("sendMessage", **resend)

    async def indicate_typing(self, target: ReplyTarget) -> None:
        """sendChatAction "typing" in the chat (and topic) of `target`; best effort, never raises."""
        telegram = _telegram_target(target)
        if not telegram.chat_id:
            return
        params: dict[str, Any] = {"chat_id": telegram.chat_id, "action": "typing"}
        if telegram.business_connection_id:
            params["business_connection_id"] = telegram.business_connection_id
        try:
            if telegram.thread_id:
                params["message_thread_id"] = int(telegram.thread_id)
            await self.api.call("sendChatAction", **params)
        except TelegramAPIError as exc:
            transient = exc.code is None or exc.code == 429 or exc.code >= 500
            (log.debug if transient else log.warning)(
                "typing_indicator_failed", platform="telegram", code=exc.code, error=exc.description[:200]
            )
        except Exception as exc:  # best effort: a typing indicator must never fail a turn
            log.warning("typing_indicator_failed", platform="telegram", error=type(exc).__name__)


def _telegram_target(target: ReplyTarget) -> TelegramTarget:
    """The target as Telegram's; another kind (a row decoded without its platform) is read field by field."""
    return target if isinstance(target, TelegramTarget) else TelegramTarget.from_json(target.to_json())


def _delivery_error(exc: TelegramAPIError) -> DeliveryError:
    # 429 and server errors pass; 400/403 (bad request, bot blocked) will not get better.
    permanent = exc.code is not None and 400 <= exc.code < 500 and exc.code != 429
    code = None if exc.code is None else str(exc.code)  # None: no answer at all (network)
    return DeliveryError(str(exc), permanent=permanent, code=code, retry_after=_seconds(exc.retry_after))


def _chat_id(value: Any) -> int | None:
    """An integer chat id from a response parameter, else None (bools are not ids)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _seconds(value: Any) -> float | None:
    """Telegram's retry_after as a number of seconds; None for anything else a broken answer holds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
