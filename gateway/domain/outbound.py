"""What the gateway sends: a reply (or a callback answer) and where it goes, typed per platform.

The worker builds these from a turn, the store keeps them as outbox rows (a target as JSON, see
`ReplyTarget.to_json`) and the platform's sender reads them back. Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A target type's fields (all strings or None), read once: `dataclasses.asdict` and `fields` cost
    ~6 us per reply written or read."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(field.name for field in dataclasses.fields(cls))
    return names


class OutboundKind(StrEnum):
    TEXT = "text"
    ANSWER_CALLBACK = "answer_callback"  # stops the spinner of a pressed inline button (Telegram)


@dataclass(frozen=True)
class ReplyTarget:
    """Where a reply goes: the chat, and the message it answers. Each platform adds what it needs.

    Stored as JSON in the outbox; `from_json` takes the fields it knows and ignores the rest, so rows
    written by another version of the gateway still read.
    """

    platform: ClassVar[str] = ""
    chat_id: str
    reply_to: str | None = None  # the platform's id of the message being answered

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _field_names(type(self))}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        values: dict[str, Any] = {name: _text(data[name]) for name in _field_names(cls) if name in data}
        values["chat_id"] = values.get("chat_id") or ""
        return cls(**values)


@dataclass(frozen=True)
class TelegramTarget(ReplyTarget):
    platform: ClassVar[str] = "telegram"
    thread_id: str | None = None  # the forum topic
    chat_type: str | None = None  # "group": quote the message answered
    callback_query_id: str | None = None  # for an ANSWER_CALLBACK
    business_connection_id: str | None = None  # a business chat: the bot answers for the business

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        if "id" in data and "callback_query_id" not in data:  # rows written before this field had a name
            data = {**data, "callback_query_id": data["id"]}
        return super().from_json(data)


@dataclass(frozen=True)
class WhatsAppTarget(ReplyTarget):
    """`chat_id` is the user's id (wa_id or business-scoped id); `scope` the business number's id."""

    platform: ClassVar[str] = "whatsapp"
    scope: str | None = None
    phone: str | None = None
    user_id: str | None = None


@dataclass(frozen=True)
class OutboundMessage:
    """One platform call to make for a conversation, in order."""

    platform: str
    session_id: str
    kind: OutboundKind
    target: ReplyTarget
    text: str | None = None


def _text(value: Any) -> str | None:
    """Ids arrive as numbers or strings (JSON of older rows too); targets hold strings."""
    if value is None or isinstance(value, bool):
        return None
    return str(value)
