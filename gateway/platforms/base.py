"""What every platform adapter does on the inbound side, and what its sender does on the outbound side.

A platform's spec (spec.py) says how to build both; the webhook routes, the worker and the contract
tests are generic over the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gateway.domain.inbound import ParsedUpdate
from gateway.domain.outbound import OutboundMessage, ReplyTarget
from gateway.errors import GatewayError


class PlatformAdapter(Protocol):
    name: str

    def verify_headers(self, headers: Mapping[str, str]) -> bool:
        """False when the headers alone show the request is not the platform's: its secret header missing
        or wrong, its signature header missing or malformed. The webhook then answers 401 before reading
        a byte of the body, so nobody without the secret makes the gateway hold one.

        True lets the body be read and `verify` decide. A platform whose proof is in the headers alone
        (Telegram's secret token) checks it fully here, in constant time.
        """
        ...

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """True only when the request carries this platform's proof of origin (constant-time compare).

        `headers` are looked up by lower-case name.
        """
        ...

    def parse(self, payload: dict[str, Any]) -> ParsedUpdate:
        """Normalize one webhook body. Unknown or irrelevant shapes give an empty ParsedUpdate; never raises
        for any JSON object (a platform must never be told to retry a payload we cannot use)."""
        ...


class DeliveryError(GatewayError):
    """A send the platform refused or that did not go through.

    `permanent` errors (blocked bot, outside the 24-hour window, bad request) are not retried;
    others are, after `retry_after` seconds when the platform said so.
    """

    def __init__(
        self, message: str, *, permanent: bool, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.code = code
        self.retry_after = retry_after


class Sender(Protocol):
    async def send(self, message: OutboundMessage) -> str | None:
        """Deliver one outbound message; the platform's message id when it gives one.

        DeliveryError otherwise: `permanent` when retrying cannot help (a 4xx other than 429),
        transient for throttling, server errors and network failures.
        """
        ...

    async def indicate_typing(self, target: ReplyTarget) -> None:
        """Show "typing…" where a reply to `target` will go.

        Best effort: never raises; failures are logged (without secrets) and otherwise ignored.
        Telegram's indicator lasts about 5 s (repeat every ~4 s during a long turn); WhatsApp's also
        marks the inbound message `target.reply_to` read and lasts until the reply or 25 s.
        """
        ...
