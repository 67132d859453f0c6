"""What a platform adapter makes of a webhook: messages, delivery statuses and membership changes.

Standard library only. Adapters (gateway/platforms/) build these; the webhook stores them and the
worker turns messages into agent turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar


class MessageKind(StrEnum):
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"
    DOCUMENT = "document"
    STICKER = "sticker"
    LOCATION = "location"
    CONTACTS = "contacts"
    INTERACTIVE_REPLY = "interactive_reply"  # button, list or flow reply
    TEMPLATE_BUTTON = "template_button"
    ORDER = "order"
    REACTION = "reaction"
    CALLBACK_QUERY = "callback_query"
    EDITED_MESSAGE = "edited_message"
    CHANNEL_POST = "channel_post"
    MEMBERSHIP_CHANGE = "membership_change"
    SYSTEM = "system"
    UNSUPPORTED = "unsupported"


# The documented default: these kinds start an agent turn; every other kind is recorded only.
DEFAULT_TURN_KINDS = frozenset(
    {
        MessageKind.TEXT,
        MessageKind.IMAGE,
        MessageKind.AUDIO,
        MessageKind.VIDEO,
        MessageKind.DOCUMENT,
        MessageKind.LOCATION,
        MessageKind.CONTACTS,
        MessageKind.INTERACTIVE_REPLY,
        MessageKind.TEMPLATE_BUTTON,
        MessageKind.ORDER,
        MessageKind.CALLBACK_QUERY,
    }
)


@dataclass(frozen=True)
class ConversationKey:
    """Which conversation a message belongs to; hashable, and the session id is derived from it.

    WhatsApp: scope = phone_number_id (the business number), chat = the user id.
    Telegram: scope = None (a business chat: its business_connection_id), chat = the chat id, thread =
    the forum topic id when there is one.
    """

    platform: str
    chat_id: str
    scope: str | None = None
    thread_id: str | None = None

    @property
    def session_id(self) -> str:
        parts = [self.platform, *([self.scope] if self.scope else []), self.chat_id]
        if self.thread_id:
            parts.append(self.thread_id)
        return ":".join(parts)


@dataclass(frozen=True)
class MediaRef:
    id: str
    mime_type: str | None = None
    caption: str | None = None
    file_name: str | None = None


@dataclass(frozen=True)
class Location:
    latitude: float
    longitude: float
    name: str | None = None
    address: str | None = None
    url: str | None = None  # a named place's web page (WhatsApp)


@dataclass(frozen=True)
class InboundMessage:
    """One user message of any kind, normalized across platforms."""

    platform: str
    message_id: str
    dedup_key: str
    conversation: ConversationKey
    kind: MessageKind
    timestamp: datetime
    user_id: str | None = None
    user_name: str | None = None
    phone: str | None = None
    text: str | None = None
    media: MediaRef | None = None
    location: Location | None = None
    reply_to_id: str | None = None
    # False for a group message not meant for the bot (no mention, command or reply to it).
    addressed_to_bot: bool = True
    callback_query_id: str | None = None
    # "group" when replies should quote the message they answer (Telegram groups), else None.
    chat_type: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def session_id(self) -> str:
        return self.conversation.session_id

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the inbox row the worker reads back (the raw update is shared, not copied)."""
        return {
            "platform": self.platform,
            "message_id": self.message_id,
            "dedup_key": self.dedup_key,
            "conversation": {
                "platform": self.conversation.platform,
                "chat_id": self.conversation.chat_id,
                "scope": self.conversation.scope,
                "thread_id": self.conversation.thread_id,
            },
            "session_id": self.session_id,
            "kind": self.kind.value,
            "timestamp": self.timestamp.isoformat(),
            "user_id": self.user_id,
            "user_name": self.user_name,
            "phone": self.phone,
            "text": self.text,
            "media": None if self.media is None else vars(self.media).copy(),
            "location": None if self.location is None else vars(self.location).copy(),
            "reply_to_id": self.reply_to_id,
            "addressed_to_bot": self.addressed_to_bot,
            "callback_query_id": self.callback_query_id,
            "chat_type": self.chat_type,
            "raw": self.raw,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, platform: str = "", session_id: str = ""
    ) -> InboundMessage:
        """The message back from `to_dict()`'s JSON, as an inbox row stores it.

        Tolerant, since rows outlive versions: unknown keys are ignored, missing ones take their
        defaults, an unknown kind reads as UNSUPPORTED, and the row's own `platform` and `session_id`
        columns fill what an older row lacks (the chat is then the session id's last part).
        """
        platform = _text(data.get("platform")) or platform
        conversation = data.get("conversation")
        conversation = conversation if isinstance(conversation, Mapping) else {}
        chat_id = _text(conversation.get("chat_id")) or session_id.rpartition(":")[2]
        media, location = data.get("media"), data.get("location")
        return cls(
            platform=platform,
            message_id=_text(data.get("message_id")) or "",
            dedup_key=_text(data.get("dedup_key")) or "",
            conversation=ConversationKey(
                platform=_text(conversation.get("platform")) or platform,
                chat_id=chat_id,
                scope=_text(conversation.get("scope")),
                thread_id=_text(conversation.get("thread_id")),
            ),
            kind=_kind(data.get("kind")),
            timestamp=_timestamp(data.get("timestamp")),
            user_id=_text(data.get("user_id")),
            user_name=_text(data.get("user_name")),
            phone=_text(data.get("phone")),
            text=_text(data.get("text")),
            media=_known_fields(MediaRef, media) if isinstance(media, Mapping) else None,
            location=_known_fields(Location, location) if isinstance(location, Mapping) else None,
            reply_to_id=_text(data.get("reply_to_id")),
            addressed_to_bot=data.get("addressed_to_bot") is not False,
            callback_query_id=_text(data.get("callback_query_id")),
            chat_type=_text(data.get("chat_type")),
            raw=data["raw"] if isinstance(data.get("raw"), dict) else {},
        )

    @property
    def chat_id(self) -> str:
        return self.conversation.chat_id

    @property
    def thread_id(self) -> str | None:
        return self.conversation.thread_id


@dataclass(frozen=True)
class StatusUpdate:
    """A platform's word on a message we sent: sent, delivered, read, played or failed."""

    platform: str
    message_id: str
    status: str
    dedup_key: str
    timestamp: datetime
    recipient_id: str | None = None
    error_code: int | None = None
    error_title: str | None = None


@dataclass(frozen=True)
class MembershipChange:
    """The bot's membership of a chat changed; `reachable` is False once it may no longer send there."""

    platform: str
    chat_id: str
    status: str
    reachable: bool
    dedup_key: str
    timestamp: datetime


@dataclass(frozen=True)
class ParsedUpdate:
    """Everything one webhook request carried. Empty means: acknowledge and ignore."""

    messages: list[InboundMessage] = field(default_factory=list)
    statuses: list[StatusUpdate] = field(default_factory=list)
    memberships: list[MembershipChange] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.messages or self.statuses or self.memberships)


def starts_turn(message: InboundMessage, turn_kinds: frozenset[MessageKind] = DEFAULT_TURN_KINDS) -> bool:
    return message.addressed_to_bot and message.kind in turn_kinds


def agent_text(message: InboundMessage) -> str:
    """What the agent reads for a message: its text, or a short rendering of what it carries."""
    kind = message.kind
    if kind is MessageKind.TEXT or kind is MessageKind.CALLBACK_QUERY:
        return message.text or ""
    if message.media is not None:
        caption = message.media.caption or message.text
        name = f" {message.media.file_name}" if message.media.file_name else ""
        return f"[{kind.value}{name}] {caption}" if caption else f"[{kind.value}{name}]"
    if message.location is not None:
        where = message.location
        place = ", ".join(p for p in (where.name, where.address) if p)
        point = f"{where.latitude}, {where.longitude}"
        text = f"[location] {place} ({point})" if place else f"[location] {point}"
        return f"{text} {where.url}" if where.url else text
    label = kind.value.replace("_", " ")
    return f"[{label}] {message.text}" if message.text else f"[{label}]"


def _text(value: Any) -> str | None:
    """Ids arrive as numbers or strings; the domain holds strings."""
    if value is None or isinstance(value, bool | dict | list):
        return None
    return str(value)


def _kind(value: Any) -> MessageKind:
    try:
        return MessageKind(value)
    except ValueError:
        return MessageKind.UNSUPPORTED


def _timestamp(value: Any) -> datetime:
    """An ISO timestamp; the epoch when a row has none (it only orders, never decides)."""
    try:
        stamp = datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return datetime.fromtimestamp(0, UTC)
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


_D = TypeVar("_D", MediaRef, Location)


def _known_fields(cls: type[_D], data: Mapping[str, Any]) -> _D | None:
    """A MediaRef or Location from its stored fields; None when a required one is missing or wrong."""
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError:
        return None
