"""Telegram Bot API adapter, inbound side: check the webhook's secret header, normalize one Update.

Telegram signs nothing; the only proof of origin is the `secret_token` given to setWebhook, echoed in a
header. The adapter does no I/O: the bot's id is handed to it, and its username through a
`BotIdentity` that identity.py's `keep_identity` fills from getMe (or the setting gives).

Choices, so that callers need not read the code:
- `message_id` is `"<chat id>:<message id>"` because Telegram's ids are unique only within a chat;
  `reply_to_id` uses the same form, so it names a stored message. Edits keep the id of what they edit.
  Events that are not messages get `"callback:<query id>"` and `"reaction:<update id>"`.
- The session is the chat, or the chat's forum topic when `is_topic_message` is true. A bare
  `message_thread_id` also appears on replies in ordinary groups; it must not split the conversation.
- animation (a GIF, delivered as silent MPEG-4) and video_note are VIDEO; an animation also carries
  `document` for old clients, and the animation wins.
- new_chat_members / left_chat_member are MEMBERSHIP_CHANGE messages with a "joined:"/"left:" summary;
  other service messages (title, pin, migration, topics, ...) are SYSTEM with the field name as text.
  The bot's own membership comes separately as `my_chat_member` and becomes a MembershipChange.
- message_reaction (only sent when listed in allowed_updates) is REACTION: text = the new emoji,
  reply_to_id = the message reacted to. Every other update type gives an empty ParsedUpdate.
- The bot's mention, and the `@bot` suffix of a command meant for it, are removed from the text (and
  caption) in every chat, so the agent reads the same words in a group as in a private chat.
- Timestamps: `edit_date` for edits, else `date`; a callback query has none, so it is the time of receipt.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from gateway.domain.inbound import (
    ConversationKey,
    InboundMessage,
    Location,
    MediaRef,
    MembershipChange,
    MessageKind,
    ParsedUpdate,
)
from gateway.errors import SettingsError
from gateway.platforms.telegram.identity import BotIdentity
from gateway.platforms.wire import integer as _int
from gateway.platforms.wire import number as _float

log = structlog.get_logger(__name__)

SECRET_HEADER = "x-telegram-bot-api-secret-token"
_GROUP_TYPES = frozenset({"group", "supergroup"})
_GONE = frozenset({"kicked", "left"})
# update type -> (kind that overrides the content's, whether it is an edit)
_MESSAGE_UPDATES: dict[str, tuple[MessageKind | None, bool]] = {
    "message": (None, False),
    "edited_message": (MessageKind.EDITED_MESSAGE, True),
    "channel_post": (MessageKind.CHANNEL_POST, False),
    "edited_channel_post": (MessageKind.CHANNEL_POST, True),
    "business_message": (None, False),
    "edited_business_message": (MessageKind.EDITED_MESSAGE, True),
}
_BUSINESS_UPDATES = frozenset({"business_message", "edited_business_message"})
# Every Update field of the Bot API (10.x) and what the adapter makes of it: docs/platforms.md is
# checked against this table (tests/test_platform_docs.py). Fields not listed are ignored too.
UPDATE_TYPES: dict[str, str] = {
    "message": "message",
    "edited_message": "message",
    "channel_post": "message",
    "edited_channel_post": "message",
    "business_message": "message",
    "edited_business_message": "message",
    "callback_query": "message",
    "message_reaction": "message",
    "my_chat_member": "membership",
    **dict.fromkeys(
        (
            "business_connection",
            "deleted_business_messages",
            "message_reaction_count",
            "inline_query",
            "chosen_inline_result",
            "shipping_query",
            "pre_checkout_query",
            "purchased_paid_media",
            "poll",
            "poll_answer",
            "chat_member",
            "chat_join_request",
            "chat_boost",
            "removed_chat_boost",
            "guest_message",
            "managed_bot",
            "subscription",
            "stopped_message_generation",
        ),
        "ignored",
    ),
}
_HANDLED = frozenset(name for name, handling in UPDATE_TYPES.items() if handling != "ignored")
# Service messages: Telegram announces changes to the chat as messages carrying one of these fields.
SERVICE_FIELDS = (
    "new_chat_title",
    "new_chat_photo",
    "delete_chat_photo",
    "group_chat_created",
    "supergroup_chat_created",
    "channel_chat_created",
    "message_auto_delete_timer_changed",
    "migrate_to_chat_id",
    "migrate_from_chat_id",
    "pinned_message",
    "successful_payment",
    "refunded_payment",
    "users_shared",
    "chat_shared",
    "connected_website",
    "write_access_allowed",
    "proximity_alert_triggered",
    "boost_added",
    "chat_background_set",
    "forum_topic_created",
    "forum_topic_edited",
    "forum_topic_closed",
    "forum_topic_reopened",
    "general_forum_topic_hidden",
    "general_forum_topic_unhidden",
    "giveaway_created",
    "giveaway_completed",
    "video_chat_scheduled",
    "video_chat_started",
    "video_chat_ended",
    "video_chat_participants_invited",
    "web_app_data",
    "chat_owner_changed",
    "chat_owner_left",
    "checklist_tasks_added",
    "checklist_tasks_done",
    "community_chat_added",
    "community_chat_removed",
    "direct_message_price_changed",
    "managed_bot_created",
    "poll_option_added",
    "poll_option_deleted",
)
# Content the gateway does not model; named in the UNSUPPORTED message's text so it shows in the record.
UNSUPPORTED_CONTENT = (
    "poll",
    "dice",
    "game",
    "invoice",
    "story",
    "paid_media",
    "giveaway",
    "giveaway_winners",
    "checklist",
    "passport_data",
    "rich_message",
)
# Media fields, in the order they are looked for (an animation also carries `document`: it wins).
MEDIA_FIELDS: tuple[tuple[str, MessageKind], ...] = (
    ("animation", MessageKind.VIDEO),
    ("video", MessageKind.VIDEO),
    ("video_note", MessageKind.VIDEO),
    ("voice", MessageKind.AUDIO),
    ("audio", MessageKind.AUDIO),
    ("document", MessageKind.DOCUMENT),
)
# A message's content fields and the kind each gives, for docs/platforms.md (checked by a test).
CONTENT_FIELDS: dict[str, MessageKind] = {
    "text": MessageKind.TEXT,
    "photo": MessageKind.IMAGE,
    **dict(MEDIA_FIELDS),
    "sticker": MessageKind.STICKER,
    "venue": MessageKind.LOCATION,
    "location": MessageKind.LOCATION,
    "contact": MessageKind.CONTACTS,
    "new_chat_members": MessageKind.MEMBERSHIP_CHANGE,
    "left_chat_member": MessageKind.MEMBERSHIP_CHANGE,
}
# After a leading "@bot" these separate the mention from the request ("@bot, do x").
_LEADING_SEPARATORS = ",:;"
_CLOSING_PUNCTUATION = ".,!?;:)"


@dataclass(frozen=True)
class _Content:
    kind: MessageKind
    text: str | None = None
    media: MediaRef | None = None
    location: Location | None = None


class _Skip(Exception):
    """The update is malformed; `reason` is logged (never its content)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _utc_now() -> datetime:
    return datetime.now(tz=UTC)


class TelegramAdapter:
    """Verifies and parses Telegram webhook requests for one bot."""

    name = "telegram"

    def __init__(
        self,
        secret_token: str,
        bot_id: str,
        bot_username: str | BotIdentity | None = None,
        *,
        clock: Callable[[], datetime] = _utc_now,
    ) -> None:
        self._secret = secret_token.encode()
        self._bot_id = bot_id
        self.identity = bot_username if isinstance(bot_username, BotIdentity) else BotIdentity(bot_username)
        self._clock = clock

    @staticmethod
    def bot_id_from_token(token: str) -> str:
        """The bot's user id: the digits before ':' in its token (the rest is the secret)."""
        bot_id, sep, secret = token.partition(":")
        if not (sep and bot_id.isascii() and bot_id.isdigit() and secret):
            # Never echo the token: it is the bot's password.
            raise SettingsError("invalid Telegram bot token: expected '<bot id>:<secret>'")
        return bot_id

    def verify_headers(self, headers: Mapping[str, str]) -> bool:
        """True when the secret-token header matches; Telegram sends no other proof of origin, so this is
        the whole check, made before the body is read."""
        given = headers.get(SECRET_HEADER)
        if given is None or not self._secret:
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self._secret)

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """The secret header alone (the body carries no signature)."""
        return self.verify_headers(headers)

    def parse(self, payload: dict[str, Any]) -> ParsedUpdate:
        """One Update into messages or a membership change; never raises, so Telegram never retries it."""
        update_id = payload.get("update_id") if isinstance(payload, dict) else None
        logged_id = update_id if _int(update_id) is not None else None
        try:
            return self._parse(payload)
        except _Skip as skip:
            log.warning("telegram_update_skipped", update_id=logged_id, reason=skip.reason)
        except Exception as exc:  # a bug here must not make Telegram redeliver the update forever
            log.warning(
                "telegram_update_skipped", update_id=logged_id, reason="parse_error", error=type(exc).__name__
            )
        return ParsedUpdate()

    def _parse(self, payload: Any) -> ParsedUpdate:
        if not isinstance(payload, dict):
            raise _Skip("not_an_object")
        update_id = _int(payload.get("update_id"))
        if update_id is None:
            raise _Skip("missing_update_id")
        dedup_key = f"tg:{self._bot_id}:{update_id}"
        # One field besides update_id, by the Bot API; a known one wins over fields added on the way.
        update_type = next((key for key in payload if key in _HANDLED), None) or next(
            (key for key in payload if key != "update_id"), None
        )
        if update_type is None:
            raise _Skip("no_content")
        body = payload[update_type]
        if update_type not in _HANDLED:
            log.debug("telegram_update_ignored", update_id=update_id, update_type=update_type)
            return ParsedUpdate()
        if not isinstance(body, dict):
            raise _Skip(f"malformed_{update_type}")
        if update_type in _MESSAGE_UPDATES:
            kind, edited = _MESSAGE_UPDATES[update_type]
            business = update_type in _BUSINESS_UPDATES
            return ParsedUpdate(messages=[self._message(body, kind, edited, dedup_key, payload, business)])
        if update_type == "callback_query":
            return ParsedUpdate(messages=[self._callback_query(body, dedup_key, payload)])
        if update_type == "message_reaction":
            return ParsedUpdate(messages=[self._reaction(body, update_id, dedup_key, payload)])
        return ParsedUpdate(memberships=[self._membership(body, dedup_key)])

    def _message(
        self,
        msg: dict[str, Any],
        kind: MessageKind | None,
        edited: bool,
        dedup_key: str,
        raw: dict[str, Any],
        business: bool = False,
    ) -> InboundMessage:
        chat = _obj(msg.get("chat"))
        chat_id = _int(chat.get("id")) if chat else None
        message_id = _int(msg.get("message_id"))
        if chat is None or chat_id is None or message_id is None:
            raise _Skip("malformed_message")
        chat_type = chat.get("type")
        words, entities = _words(msg)
        mentioned, words = self._addressing(words, entities)
        content = _content(msg, words)
        if chat_type in _GROUP_TYPES:
            addressed = mentioned or self._replies_to_bot(msg)
        else:
            addressed = chat_type == "private"
        user_id, user_name = _sender(msg)
        # A business chat (a Telegram Business account lets the bot answer for it): its messages go both
        # ways; only the customer's (the chat's own user) are for the bot, and only a known connection
        # lets a reply be sent there.
        connection = _str(msg.get("business_connection_id")) if business else None
        if business:
            addressed = chat_type == "private" and connection is not None and user_id == str(chat_id)
        if kind is MessageKind.CHANNEL_POST:
            addressed = False
        reply_to = _obj(msg.get("reply_to_message"))
        reply_to_id = _int(reply_to.get("message_id")) if reply_to else None
        date = msg.get("edit_date") if edited else None
        return InboundMessage(
            platform=self.name,
            message_id=f"{chat_id}:{message_id}",
            dedup_key=dedup_key,
            # A business chat is the business's conversation with the user, not the bot's own chat.
            conversation=ConversationKey(self.name, str(chat_id), scope=connection, thread_id=_topic(msg)),
            kind=kind or content.kind,
            timestamp=_time(date) or _time(msg.get("date")) or self._clock(),
            user_id=user_id,
            user_name=user_name,
            text=content.text,
            media=content.media,
            location=content.location,
            reply_to_id=f"{chat_id}:{reply_to_id}" if reply_to_id is not None else None,
            addressed_to_bot=addressed,
            chat_type="group" if chat_type in _GROUP_TYPES else None,
            raw=raw,
        )

    def _callback_query(self, query: dict[str, Any], dedup_key: str, raw: dict[str, Any]) -> InboundMessage:
        query_id = _str(query.get("id"))
        user = _obj(query.get("from"))
        user_id = _int(user.get("id")) if user else None
        if query_id is None or user is None or user_id is None:
            raise _Skip("malformed_callback_query")
        # The message with the button; "inaccessible" (too old) still names its chat and id.
        msg = _obj(query.get("message")) or {}
        chat = _obj(msg.get("chat"))
        chat_id = _int(chat.get("id")) if chat else None
        message_id = _int(msg.get("message_id"))
        in_chat = chat_id is not None
        return InboundMessage(
            platform=self.name,
            message_id=f"callback:{query_id}",
            dedup_key=dedup_key,
            conversation=ConversationKey(
                self.name, str(chat_id if in_chat else user_id), thread_id=_topic(msg) if in_chat else None
            ),
            kind=MessageKind.CALLBACK_QUERY,
            timestamp=self._clock(),
            user_id=str(user_id),
            user_name=_name(user),
            text=_str(query.get("data")),
            reply_to_id=f"{chat_id}:{message_id}" if in_chat and message_id is not None else None,
            callback_query_id=query_id,
            raw=raw,
        )

    def _reaction(
        self, reaction: dict[str, Any], update_id: int, dedup_key: str, raw: dict[str, Any]
    ) -> InboundMessage:
        chat = _obj(reaction.get("chat"))
        chat_id = _int(chat.get("id")) if chat else None
        message_id = _int(reaction.get("message_id"))
        if chat is None or chat_id is None or message_id is None:
            raise _Skip("malformed_message_reaction")
        actor = _obj(reaction.get("user")) or _obj(reaction.get("actor_chat"))
        actor_id = _int(actor.get("id")) if actor else None
        new = reaction.get("new_reaction")
        emoji = "".join(
            r["emoji"]
            for r in (new if isinstance(new, list) else [])
            if isinstance(r, dict) and r.get("type") == "emoji" and isinstance(r.get("emoji"), str)
        )
        return InboundMessage(
            platform=self.name,
            message_id=f"reaction:{update_id}",
            dedup_key=dedup_key,
            conversation=ConversationKey(self.name, str(chat_id)),
            kind=MessageKind.REACTION,
            timestamp=_time(reaction.get("date")) or self._clock(),
            user_id=str(actor_id) if actor_id is not None else None,
            user_name=_name(actor) if actor else None,
            text=emoji or None,
            reply_to_id=f"{chat_id}:{message_id}",
            addressed_to_bot=chat.get("type") == "private",
            raw=raw,
        )

    def _membership(self, update: dict[str, Any], dedup_key: str) -> MembershipChange:
        chat = _obj(update.get("chat"))
        chat_id = _int(chat.get("id")) if chat else None
        member = _obj(update.get("new_chat_member"))
        status = _str(member.get("status")) if member else None
        if chat_id is None or member is None or status is None:
            raise _Skip("malformed_my_chat_member")
        # A restricted bot that is no longer a member cannot send either.
        gone = status in _GONE or (status == "restricted" and member.get("is_member") is False)
        return MembershipChange(
            platform=self.name,
            chat_id=str(chat_id),
            status=status,
            reachable=not gone,
            dedup_key=dedup_key,
            timestamp=_time(update.get("date")) or self._clock(),
        )

    def _addressing(self, words: str | None, entities: Any) -> tuple[bool, str | None]:
        """Whether the text mentions or commands this bot, and the text without that mention.

        Entity offsets count UTF-16 code units, so they are mapped to string indices first; an entity
        that does not fall on character boundaries is ignored.
        """
        if words is None or not isinstance(entities, list) or not entities:
            return False, words
        index = _utf16_index(words)
        username = self.identity.username
        addressed = False
        cuts: list[tuple[int, int]] = []
        for entity in entities:
            ent = _obj(entity)
            offset, length = (_int(ent.get("offset")), _int(ent.get("length"))) if ent else (None, None)
            if ent is None or offset is None or length is None or length <= 0:
                continue
            start, end = index.get(offset), index.get(offset + length)
            if start is None or end is None:
                continue
            fragment = words[start:end]
            kind = ent.get("type")
            if kind == "mention":
                if username and fragment.casefold() == f"@{username}":
                    addressed = True
                    cuts.append((start, end))
                else:
                    self.identity.unrecognized(fragment.removeprefix("@"))
            elif kind == "text_mention":
                user = _obj(ent.get("user"))
                if user is not None and _int(user.get("id")) is not None and str(user["id"]) == self._bot_id:
                    addressed = True
                    cuts.append((start, end))
            elif kind == "bot_command":
                command, at, target = fragment.partition("@")
                if not at:
                    addressed = True  # a bare /command in a group is for every bot there
                elif username and target.casefold() == username:
                    addressed = True
                    cuts.append((start + len(command), end))
                else:
                    self.identity.unrecognized(target)
        return addressed, _remove(words, cuts) if cuts else words

    def _replies_to_bot(self, msg: dict[str, Any]) -> bool:
        reply_to = _obj(msg.get("reply_to_message"))
        author = _obj(reply_to.get("from")) if reply_to else None
        author_id = _int(author.get("id")) if author else None
        return author_id is not None and str(author_id) == self._bot_id


def _words(msg: dict[str, Any]) -> tuple[str | None, Any]:
    """The user's words: the text, or else the media caption, with the entities that index into it."""
    text = _str(msg.get("text"))
    if text is not None:
        return text, msg.get("entities")
    return _str(msg.get("caption")), msg.get("caption_entities")


def _content(msg: dict[str, Any], words: str | None) -> _Content:
    """What the message carries; `words` is its text or caption, already cleaned of the bot's mention."""
    if isinstance(msg.get("text"), str):
        return _Content(MessageKind.TEXT, text=words)
    sizes = [p for p in _list(msg.get("photo")) if _str(p.get("file_id"))]
    if sizes:
        largest = max(sizes, key=lambda p: (_int(p.get("width")) or 0) * (_int(p.get("height")) or 0))
        return _Content(MessageKind.IMAGE, words, MediaRef(largest["file_id"], caption=words))
    for field, kind in MEDIA_FIELDS:
        media = _media(msg.get(field), words)
        if media is not None:
            return _Content(kind, words, media)
    sticker = _obj(msg.get("sticker"))
    if sticker is not None and _str(sticker.get("file_id")):
        # Stickers carry no mime type; the flags say which of the three formats it is.
        mime = (
            "application/x-tgsticker"
            if sticker.get("is_animated") is True
            else "video/webm"
            if sticker.get("is_video") is True
            else "image/webp"
        )
        emoji = _str(sticker.get("emoji"))
        return _Content(MessageKind.STICKER, emoji, MediaRef(sticker["file_id"], mime_type=mime))
    venue = _obj(msg.get("venue"))
    place = (
        _location(venue.get("location"), _str(venue.get("title")), _str(venue.get("address")))
        if venue
        else None
    )
    place = place or _location(msg.get("location"))
    if place is not None:
        return _Content(MessageKind.LOCATION, location=place)
    contact = _obj(msg.get("contact"))
    if contact is not None:
        summary = " ".join(
            s for s in (_name(contact), _str(contact.get("phone_number"))) if s
        )  # the vCard stays in raw
        return _Content(MessageKind.CONTACTS, summary or None)
    joined = [_name(u) or str(_int(u.get("id"))) for u in _list(msg.get("new_chat_members"))]
    if joined:
        return _Content(MessageKind.MEMBERSHIP_CHANGE, "joined: " + ", ".join(joined))
    left = _obj(msg.get("left_chat_member"))
    if left is not None:
        return _Content(MessageKind.MEMBERSHIP_CHANGE, f"left: {_name(left) or _int(left.get('id'))}")
    for field in SERVICE_FIELDS:
        if field in msg:
            return _Content(MessageKind.SYSTEM, field)
    unsupported = next((field for field in UNSUPPORTED_CONTENT if field in msg), None)
    return _Content(MessageKind.UNSUPPORTED, unsupported)


def _media(value: Any, caption: str | None) -> MediaRef | None:
    media = _obj(value)
    file_id = _str(media.get("file_id")) if media else None
    if media is None or not file_id:
        return None
    return MediaRef(
        file_id,
        mime_type=_str(media.get("mime_type")),
        caption=caption,
        file_name=_str(media.get("file_name")),
    )


def _location(value: Any, name: str | None = None, address: str | None = None) -> Location | None:
    point = _obj(value)
    if point is None:
        return None
    latitude, longitude = _float(point.get("latitude")), _float(point.get("longitude"))
    if latitude is None or longitude is None:
        return None
    return Location(latitude, longitude, name=name, address=address)


def _topic(msg: dict[str, Any]) -> str | None:
    """The forum topic id; replies in ordinary groups carry message_thread_id too, but not the flag."""
    thread_id = _int(msg.get("message_thread_id"))
    return str(thread_id) if thread_id is not None and msg.get("is_topic_message") is True else None


def _sender(msg: dict[str, Any]) -> tuple[str | None, str | None]:
    """The sending user, or the chat posted on behalf of (channel posts carry no `from`)."""
    for key in ("from", "sender_chat"):
        who = _obj(msg.get(key))
        who_id = _int(who.get("id")) if who else None
        if who is not None and who_id is not None:
            return str(who_id), _name(who)
    return None, None


def _name(who: dict[str, Any]) -> str | None:
    full = " ".join(n for n in (_str(who.get("first_name")), _str(who.get("last_name"))) if n)
    return full or _str(who.get("title")) or _str(who.get("username"))


def _utf16_index(text: str) -> dict[int, int]:
    """UTF-16 code-unit offset -> string index, for every character boundary of `text`."""
    index = {0: 0}
    units = 0
    for i, char in enumerate(text, start=1):
        units += 2 if ord(char) > 0xFFFF else 1
        index[units] = i
    return index


def _remove(text: str, cuts: list[tuple[int, int]]) -> str:
    """Remove the spans and close each gap: one space, or a newline if the gap held one."""
    limit = len(text)
    for start, end in sorted(set(cuts), reverse=True):
        if end > limit:  # overlaps a span already removed
            continue
        left, right = text[:start], text[end:]
        gap = left[len(left.rstrip()) :] + right[: len(right) - len(right.lstrip())]
        left, right = left.rstrip(), right.lstrip()
        if not left:
            right = right.lstrip(_LEADING_SEPARATORS).lstrip()
        if not left or not right or right[0] in _CLOSING_PUNCTUATION:
            sep = ""
        else:
            sep = "\n" if "\n" in gap else " "
        text = left + sep + right
        limit = len(left)  # spans further left must end before the whitespace just removed
    return text.strip()


def _obj(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _list(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _time(value: Any) -> datetime | None:
    seconds = _int(value)
    if seconds is None or seconds <= 0:  # 0 marks an inaccessible message
        return None
    try:
        return datetime.fromtimestamp(seconds, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None
