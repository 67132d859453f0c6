"""What a worker's turn commits besides the session: its inbox row done, and the replies to deliver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError


class LeaseLostError(GatewayError):
    """The inbox row is no longer ours (its lease expired and another worker took it); nothing was written."""


@dataclass(frozen=True)
class OutboxEntry:
    platform: str
    session_id: str
    kind: str  # "text" or "answer_callback"
    text: str | None
    target: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InboxCompletion:
    """Marks inbox row `inbox_id` done, if `lease_owner` still holds it, and queues `outbox`."""

    inbox_id: int
    lease_owner: str
    outbox: list[OutboxEntry] = field(default_factory=list)
