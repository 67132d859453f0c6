"""What the database can store, and the rule that makes every webhook's values fit it before batching.

A signed, valid update may still carry values a database refuses: a NUL character (PostgreSQL text
cannot hold one), NaN or Infinity (not JSON), an id longer than its column, JSON nested deeper than an
encoder recurses. Refused inside a group commit, such a value failed every webhook of the batch, and
failed again at each of the platform's retries, for days. The rule, applied to every update before it
is batched (gateway/store/ingest.py):

- NUL characters are removed from every string the update stores (typed columns and JSON alike);
- NaN and ±Infinity become null;
- an id or key longer than its column (KEY_CHARS; a conversation's chat, scope and topic ids
  PART_CHARS each, so the session id built of them fits) keeps its first characters and ends in `~`
  and 40 hex digits of its SHA-256: still one value per original, so deduplication and conversations
  hold;
- JSON nested deeper than MAX_DEPTH levels has its deeper values replaced by the string TOO_DEEP.

Statuses and membership changes follow the same rule. Whatever still fails is isolated by the group
commit (it retries a failed batch one submission at a time), so only the offender gets an answer of
its own (see gateway/web/webhooks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import orjson

from gateway.domain.inbound import (
    ConversationKey,
    InboundMessage,
    MembershipChange,
    ParsedUpdate,
    StatusUpdate,
)

KEY_CHARS = 255  # dedup keys, message ids, session ids: String(255) columns
PART_CHARS = 64  # each part of a conversation key: four of them still make a session id under 255
SHORT_CHARS = 32  # platform, kind and membership status columns: String(32)
MAX_DEPTH = 128  # JSON levels kept; orjson itself stops at 255
TOO_DEEP = "[nested too deep]"
_HASH_CHARS = 40


def bounded(value: str, limit: int = KEY_CHARS) -> str:
    """`value` without NUL, shortened to `limit` characters by the hash rule when longer."""
    value = value.replace("\x00", "") if "\x00" in value else value
    if len(value) <= limit:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return f"{value[: limit - _HASH_CHARS - 1]}~{digest}"


def _text(value: str | None) -> str | None:
    return value.replace("\x00", "") if value is not None and "\x00" in value else value


def _part(value: str | None) -> str | None:
    return None if value is None else bounded(value, PART_CHARS)


def message(m: InboundMessage) -> InboundMessage:
    """The message with every stored value within the rule (the same object when it already is)."""
    c = m.conversation
    conversation = ConversationKey(
        platform=c.platform,
        chat_id=bounded(c.chat_id, PART_CHARS),
        scope=_part(c.scope),
        thread_id=_part(c.thread_id),
    )
    fields: dict[str, Any] = {
        "message_id": bounded(m.message_id),
        "dedup_key": bounded(m.dedup_key),
        "conversation": conversation,
        "user_id": _text(m.user_id),
        "user_name": _text(m.user_name),
        "phone": _text(m.phone),
        "text": _text(m.text),
        "reply_to_id": _text(m.reply_to_id),
        "callback_query_id": _text(m.callback_query_id),
        "chat_type": _text(m.chat_type),
    }
    if m.media is not None:
        fields["media"] = dataclasses.replace(
            m.media,
            id=bounded(m.media.id),
            mime_type=_text(m.media.mime_type),
            caption=_text(m.media.caption),
            file_name=_text(m.media.file_name),
        )
    if m.location is not None:
        fields["location"] = dataclasses.replace(
            m.location,
            latitude=_finite(m.location.latitude),
            longitude=_finite(m.location.longitude),
            name=_text(m.location.name),
            address=_text(m.location.address),
            url=_text(m.location.url),
        )
    if all(getattr(m, name) == value for name, value in fields.items()):
        return m  # the common case: nothing to change, nothing copied
    return dataclasses.replace(m, **fields)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def status(s: StatusUpdate) -> StatusUpdate:
    return dataclasses.replace(
        s,
        message_id=bounded(s.message_id),
        status=bounded(s.status, SHORT_CHARS),
        dedup_key=bounded(s.dedup_key),
        recipient_id=_text(s.recipient_id),
        error_title=_text(s.error_title),
    )


def membership(c: MembershipChange) -> MembershipChange:
    return dataclasses.replace(
        c, chat_id=bounded(c.chat_id), status=bounded(c.status, SHORT_CHARS), dedup_key=bounded(c.dedup_key)
    )


def update(parsed: ParsedUpdate) -> ParsedUpdate:
    """Every item of the update within the rule (the raw JSON is made storable as it is encoded)."""
    return ParsedUpdate(
        messages=[message(m) for m in parsed.messages],
        statuses=[status(s) for s in parsed.statuses],
        memberships=[membership(c) for c in parsed.memberships],
    )


def json_text(value: Any) -> str:
    """JSON for a JSON column, always storable: orjson when it can (a tenth of json.dumps' time, and it
    writes NaN and Infinity as null); else (nested deeper than orjson goes, an integer over 64 bits, a
    lone surrogate) the value made storable, then json.dumps, which keeps big integers exact. NUL
    characters in JSON strings are escaped, which every backend stores."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(_storable(value, 0), ensure_ascii=False, allow_nan=False)


def _storable(value: Any, depth: int) -> Any:
    """A copy of `value` within the rule; recursion bounded by MAX_DEPTH."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8") if _has_surrogate(value) else value
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth >= MAX_DEPTH:
        return TOO_DEEP
    if isinstance(value, dict):
        return {str(_storable(k, depth)): _storable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v, depth + 1) for v in value]
    return str(value)


def _has_surrogate(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
