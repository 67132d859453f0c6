"""What the contract tests know of each platform beyond its spec: the values that enable it, how its
webhooks are signed, what its API answers, and its handshake requests.

One kit per platform of the registry and one for the test-only echo platform (tests/echo_platform.py).
Everything else the contract tests do comes from the spec. A platform added to the registry without a
kit here fails `test_every_platform_has_a_kit_and_fixtures`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.domain.outbound import ReplyTarget, TelegramTarget, WhatsAppTarget
from gateway.platforms.registry import PLATFORMS
from gateway.platforms.spec import PlatformSettings, PlatformSpec
from gateway.platforms.telegram.adapter import SECRET_HEADER
from gateway.platforms.telegram.spec import TELEGRAM
from gateway.platforms.whatsapp.adapter import SIGNATURE_HEADER, WhatsAppAdapter
from gateway.platforms.whatsapp.spec import WHATSAPP
from tests import echo_platform
from tests.echo_platform import ECHO, EchoTarget
from tests.fakes import ScriptedResponse

# Every platform of the registry, and echo: the list a test hands to create_app, build_services or main.
ALL_PLATFORMS: tuple[PlatformSpec[Any], ...] = (*PLATFORMS, ECHO)
SECRET = "contract-secret_1"  # a webhook secret every platform accepts (Telegram's rule is the strictest)
VERIFY_TOKEN = "contract-verify-token"
Outcome = Literal["ok", "throttled", "unavailable", "refused"]


@dataclass(frozen=True)
class HandshakeCase:
    """One handshake request and what the gateway must answer; a handshake never stores anything."""

    method: Literal["GET", "POST"]
    status: int
    body: str | None = None  # the answer's text, when it is fixed
    query: Mapping[str, str] | None = None
    payload: dict[str, Any] | None = None  # a POST's JSON body
    signed: bool = True  # a POST signed with SECRET


@dataclass(frozen=True)
class Kit:
    spec: PlatformSpec[Any]
    webhook_values: Mapping[str, Any]  # the settings group's values enabling it (with SECRET)
    sending_values: Callable[[str], Mapping[str, Any]]  # values sending for real to the API at a base URL
    sign: Callable[[bytes], dict[str, str]]  # the headers proving a body comes from the platform
    target: ReplyTarget  # where a test reply goes
    answers: Mapping[Outcome, ScriptedResponse]  # the API's answer to a send, by outcome
    handshakes: tuple[HandshakeCase, ...] = ()

    def webhook_settings(self) -> PlatformSettings:
        settings: PlatformSettings = self.spec.settings(**self.webhook_values)
        return settings

    def sending_settings(self, api_base: str) -> PlatformSettings:
        settings: PlatformSettings = self.spec.settings(**self.sending_values(api_base))
        return settings


def _telegram_error(status: int, description: str, **parameters: Any) -> ScriptedResponse:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return ScriptedResponse(status, body)


def _graph_error(status: int, code: int, message: str) -> ScriptedResponse:
    return ScriptedResponse(status, {"error": {"code": code, "message": message}})


KITS: dict[str, Kit] = {
    kit.spec.name: kit
    for kit in (
        Kit(
            spec=TELEGRAM,
            webhook_values={"secret_token": SECRET},
            sending_values=lambda base: {"bot_token": "123456:contract-bot-token", "api_base": base},
            sign=lambda body: {SECRET_HEADER: SECRET},
            target=TelegramTarget(chat_id="42", reply_to="42:7"),
            answers={
                "ok": ScriptedResponse(200, {"ok": True, "result": {"message_id": 5}}),
                "throttled": _telegram_error(429, "Too Many Requests", retry_after=3),
                "unavailable": _telegram_error(502, "Bad Gateway"),
                "refused": _telegram_error(403, "Forbidden: bot was blocked by the user"),
            },
        ),
        Kit(
            spec=WHATSAPP,
            webhook_values={"app_secret": SECRET, "verify_token": VERIFY_TOKEN},
            sending_values=lambda base: {"access_token": "wa-contract-token", "api_base": base},
            sign=lambda body: {SIGNATURE_HEADER: WhatsAppAdapter.sign(SECRET, body)},
            target=WhatsAppTarget(
                chat_id="15550001111", reply_to="wamid.IN1", scope="1065", phone="15550001111"
            ),
            answers={
                "ok": ScriptedResponse(
                    200, {"messaging_product": "whatsapp", "messages": [{"id": "wamid.OUT"}]}
                ),
                "throttled": _graph_error(429, 130429, "Rate limit hit"),
                "unavailable": _graph_error(500, 131000, "Something went wrong"),
                "refused": _graph_error(400, 131047, "Re-engagement message"),
            },
            handshakes=(
                HandshakeCase(
                    "GET",
                    200,
                    "1158201444",
                    {
                        "hub.mode": "subscribe",
                        "hub.verify_token": VERIFY_TOKEN,
                        "hub.challenge": "1158201444",
                    },
                ),
                HandshakeCase(
                    "GET",
                    403,
                    "Forbidden",
                    {"hub.mode": "subscribe", "hub.verify_token": "wrong", "hub.challenge": "1"},
                ),
                HandshakeCase(
                    "GET", 403, "Forbidden", {"hub.mode": "unsubscribe", "hub.verify_token": VERIFY_TOKEN}
                ),
            ),
        ),
        Kit(
            spec=ECHO,
            webhook_values={"secret": SECRET},
            sending_values=lambda base: {"token": "echo-contract-token", "api_base": base},
            sign=lambda body: {echo_platform.SIGNATURE_HEADER: echo_platform.sign(SECRET, body)},
            target=EchoTarget(chat_id="u-42", reply_to="m-1001"),
            answers={
                "ok": ScriptedResponse(200, {"id": "e-1"}),
                "throttled": ScriptedResponse(429, {"error": "slow down"}, headers={"Retry-After": "2"}),
                "unavailable": ScriptedResponse(503, {"error": "down"}),
                "refused": ScriptedResponse(400, {"error": "no such user"}),
            },
            handshakes=(
                HandshakeCase("POST", 200, "c-42", payload={"type": "url_verification", "challenge": "c-42"}),
                HandshakeCase(
                    "POST", 401, payload={"type": "url_verification", "challenge": "c-43"}, signed=False
                ),
            ),
        ),
    )
}
