"""What every platform adapter does on the inbound side.

Adding a platform is one module here, one settings group, one registry line and payload fixtures;
the webhook routes and the contract tests are generic over the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gateway.domain.inbound import ParsedUpdate


class PlatformAdapter(Protocol):
    name: str

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """True only when the request carries this platform's proof of origin (constant-time compare).

        `headers` are looked up by lower-case name.
        """
        ...

    def parse(self, payload: dict[str, Any]) -> ParsedUpdate:
        """Normalize one webhook body. Unknown or irrelevant shapes give an empty ParsedUpdate; never raises
        for any JSON object (a platform must never be told to retry a payload we cannot use)."""
        ...
