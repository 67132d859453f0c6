"""WhatsApp Cloud API, inbound side: the signature, the GET handshake and the webhook body.

Facts follow docs/platform-specs.md section 1. Parsing is defensive on purpose: Meta retries anything
but a 200 for up to 7 days and batches up to 1,000 updates per POST, so one bad item is logged and
skipped while every other item of the batch still gets through, and nothing here ever raises.

Users are keyed by their business-scoped user id (BSUID) when the webhook carries one, else by phone:
once a user adopts a username the phone is withheld, while the BSUID is always there (spec 1.6).
Group messages (`group_id`) are one conversation per group, since that is where a reply must go.
Every message counts as addressed to the bot: the Cloud API has no mention or privacy-mode signal,
and a business is only in groups it created for talking to its customers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog

from gateway.domain.inbound import (
    ConversationKey,
    InboundMessage,
    Location,
    MediaRef,
    MessageKind,
    ParsedUpdate,
    StatusUpdate,
)
from gateway.platforms.wire import integer as _int
from gateway.platforms.wire import number as _float
from gateway.platforms.wire import written as _number

log = structlog.get_logger(__name__)

PLATFORM = "whatsapp"
SIGNATURE_HEADER = "x-hub-signature-256"
OBJECT_TYPE = "whatsapp_business_account"
_SIGNATURE_PREFIX = "sha256="
_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
_T = TypeVar("_T")

_MEDIA_KINDS = {
    "image": MessageKind.IMAGE,
    "video": MessageKind.VIDEO,
    "audio": MessageKind.AUDIO,  # voice notes too (`audio.voice` is true; kept in raw)
    "document": MessageKind.DOCUMENT,
    "sticker": MessageKind.STICKER,
}


class WhatsAppAdapter:
    """Verifies and parses WhatsApp Cloud API webhooks; holds only the app secret (no I/O)."""

    name: str = PLATFORM

    def __init__(self, app_secret: str) -> None:
        self._app_secret = app_secret

    def __repr__(self) -> str:
        return f"{type(self).__name__}(app_secret=***)"

    @staticmethod
    def sign(app_secret: str, body: bytes) -> str:
        """The `X-Hub-Signature-256` value Meta would send for `body` (for tests and `gateway simulate`)."""
        return _SIGNATURE_PREFIX + hmac.new(app_secret.encode(), body, hashlib.sha256).hexdigest()

    def verify_headers(self, headers: Mapping[str, str]) -> bool:
        """A signature header of the right form (the HMAC itself needs the body); fails closed without
        an app secret, since anyone could then compute the signature."""
        return self._app_secret != "" and self._signature(headers) is not None

    def verify(self, headers: Mapping[str, str], body: bytes) -> bool:
        """HMAC-SHA256 of the raw body bytes, never re-serialized JSON (Meta escapes non-ASCII and `/`)."""
        received = self._signature(headers)
        if not self._app_secret or received is None:
            return False
        expected = self.sign(self._app_secret, body)[len(_SIGNATURE_PREFIX) :]
        return hmac.compare_digest(expected.encode(), received.lower().encode())

    @staticmethod
    def _signature(headers: Mapping[str, str]) -> str | None:
        """The hex digest of `X-Hub-Signature-256`, when the header has the form `sha256=<64 hex>`."""
        header = headers.get(SIGNATURE_HEADER)
        if not isinstance(header, str) or not header.startswith(_SIGNATURE_PREFIX):
            return None
        received = header[len(_SIGNATURE_PREFIX) :]
        # Also keeps non-ASCII away from compare_digest, which would raise on it.
        return received if _HEX_DIGEST.fullmatch(received) else None

    @staticmethod
    def verify_handshake(mode: str | None, token: str | None, verify_token: str) -> bool:
        """The GET subscription check: `hub.mode == "subscribe"` and the token, compared in constant time."""
        if mode != "subscribe" or not isinstance(token, str) or not verify_token:
            return False
        return hmac.compare_digest(token.encode(), verify_token.encode())

    def parse(self, payload: dict[str, Any]) -> ParsedUpdate:
        """Every message and status of every entry and change; anything else gives an empty update."""
        update = ParsedUpdate()
        if not isinstance(payload, dict) or payload.get("object") != OBJECT_TYPE:
            return update
        for value in _message_values(payload):
            _parse_value(value, update)
        return update


def _message_values(payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The `value` of each `messages` change of each entry; other fields are acknowledged and ignored."""
    for entry in _items(payload.get("entry"), "entry"):
        for change in _items(entry.get("changes"), "change"):
            field = change.get("field")
            if field != "messages":
                log.debug("whatsapp_field_ignored", field=field if isinstance(field, str) else None)
                continue
            value = change.get("value")
            if isinstance(value, dict):
                yield value
            else:
                _skipped("change", "value_not_an_object")


def _parse_value(value: dict[str, Any], update: ParsedUpdate) -> None:
    metadata = _obj(value.get("metadata"))
    phone_number_id = _ident(metadata.get("phone_number_id"))
    for error in _items(value.get("errors"), "error"):
        log.warning(
            "whatsapp_error_notification",
            code=_int(error.get("code")),
            title=_text(error.get("title")),
            phone_number_id=phone_number_id,
        )
    contacts = _contact_index(value.get("contacts"))
    for raw in _items(value.get("messages"), "message"):
        message = _guarded(_message, raw, phone_number_id, contacts)
        if message is not None:
            update.messages.append(message)
    for raw in _items(value.get("statuses"), "status"):
        status = _guarded(_status, raw)
        if status is not None:
            update.statuses.append(status)


def _guarded(build: Callable[..., _T | None], raw: dict[str, Any], *args: Any) -> _T | None:
    """Last line of defence: a shape nobody foresaw costs one item, never the whole batch."""
    try:
        return build(raw, *args)
    except Exception as exc:
        item = build.__name__.strip("_")
        _skipped(item, "unexpected_error", error=type(exc).__name__, message_id=_ident(raw.get("id")))
        return None


def _message(
    msg: dict[str, Any], phone_number_id: str | None, contacts: _ContactIndex
) -> InboundMessage | None:
    wamid = _ident(msg.get("id"))
    if wamid is None:
        _skipped("message", "missing_id")
        return None
    if phone_number_id is None:
        _skipped("message", "missing_phone_number_id", message_id=wamid)
        return None
    phone = _ident(msg.get("from"))
    bsuid = _ident(msg.get("from_user_id"))
    contact = _sender_contact(contacts, phone, bsuid)
    if phone is None and bsuid is None and len(contacts.cards) == 1:
        # The BSUID rollout's shape: the message names no sender; the change's one contact is it.
        contact = contacts.cards[0]
        log.info("whatsapp_sender_from_single_contact", message_id=wamid)
    bsuid = bsuid or _ident(contact.get("user_id"))
    phone = phone or _ident(contact.get("wa_id"))
    user_id = bsuid or phone
    if user_id is None:
        _skipped("message", "missing_sender", message_id=wamid)
        return None

    content = _content(msg)
    context = _obj(msg.get("context"))
    return InboundMessage(
        platform=PLATFORM,
        message_id=wamid,
        dedup_key=f"wa:msg:{wamid}",
        conversation=ConversationKey(
            platform=PLATFORM, scope=phone_number_id, chat_id=_ident(msg.get("group_id")) or user_id
        ),
        kind=content.kind,
        timestamp=_timestamp(msg.get("timestamp"), "message", wamid),
        user_id=user_id,
        user_name=_text(_obj(contact.get("profile")).get("name")),
        phone=phone,
        text=content.text,
        media=content.media,
        location=content.location,
        reply_to_id=content.reply_to_id or _ident(context.get("id")),
        addressed_to_bot=True,
        raw=msg,
    )


@dataclass(frozen=True)
class _ContactIndex:
    """`contacts[]` by BSUID and by phone: their order need not follow `messages[]` (spec 1.4)."""

    by_key: dict[tuple[str, str], dict[str, Any]]
    cards: list[dict[str, Any]]  # the contacts that name someone (a BSUID or a phone)


def _contact_index(contacts: Any) -> _ContactIndex:
    index = _ContactIndex({}, [])
    for contact in _items(contacts, "contact"):
        keys = [(key, ident) for key in ("user_id", "wa_id") if (ident := _ident(contact.get(key)))]
        for key in keys:
            index.by_key.setdefault(key, contact)
        if keys:
            index.cards.append(contact)
    return index


def _sender_contact(contacts: _ContactIndex, phone: str | None, bsuid: str | None) -> dict[str, Any]:
    by_bsuid = contacts.by_key.get(("user_id", bsuid)) if bsuid else None
    by_phone = contacts.by_key.get(("wa_id", phone)) if phone else None
    return by_bsuid or by_phone or {}


def _status(raw: dict[str, Any]) -> StatusUpdate | None:
    wamid = _ident(raw.get("id"))
    status = _text(raw.get("status"))
    if wamid is None or status is None:
        _skipped("status", "missing_id_or_status", message_id=wamid)
        return None
    error = next(iter(_items(raw.get("errors"), "status_error")), {})
    return StatusUpdate(
        platform=PLATFORM,
        message_id=wamid,
        status=status,
        dedup_key=f"wa:status:{wamid}:{status}",
        timestamp=_timestamp(raw.get("timestamp"), "status", wamid),
        recipient_id=_ident(raw.get("recipient_id")) or _ident(raw.get("recipient_user_id")),
        error_code=_int(error.get("code")),
        error_title=_text(error.get("title")),
    )


@dataclass(frozen=True)
class _Content:
    kind: MessageKind
    text: str | None = None
    media: MediaRef | None = None
    location: Location | None = None
    reply_to_id: str | None = None


def _content(msg: dict[str, Any]) -> _Content:
    """What the message carries, by `type`; unknown ones (edit, revoke, request_welcome…) are unsupported."""
    type_ = msg.get("type")
    if not isinstance(type_, str):
        return _Content(MessageKind.UNSUPPORTED)
    if type_ in _MEDIA_KINDS:
        return _media(_MEDIA_KINDS[type_], _obj(msg.get(type_)))
    if type_ == "contacts":  # the one type whose body is an array
        return _contacts(msg.get("contacts"))
    parser = _CONTENT_PARSERS.get(type_)
    return parser(_obj(msg.get(type_))) if parser else _Content(MessageKind.UNSUPPORTED)


def _media(kind: MessageKind, body: dict[str, Any]) -> _Content:
    caption = _text(body.get("caption"))
    media_id = _ident(body.get("id"))
    media = None
    if media_id is not None:
        media = MediaRef(
            id=media_id,
            mime_type=_text(body.get("mime_type")),
            caption=caption,
            file_name=_text(body.get("filename")),
        )
    return _Content(kind, text=caption, media=media)


def _text_message(body: dict[str, Any]) -> _Content:
    return _Content(MessageKind.TEXT, text=_text(body.get("body")))


def _location(body: dict[str, Any]) -> _Content:
    """The place with every field a model would use; without readable coordinates, still its name,
    address and web page, as text."""
    latitude, longitude = _float(body.get("latitude")), _float(body.get("longitude"))
    name, address, url = _text(body.get("name")), _text(body.get("address")), _text(body.get("url"))
    if latitude is None or longitude is None:
        place = ", ".join(part for part in (name, address) if part)
        text = " ".join(part for part in (place, url) if part)
        return _Content(MessageKind.LOCATION, text=text or None)
    location = Location(latitude, longitude, name=name, address=address, url=url)
    return _Content(MessageKind.LOCATION, location=location)


def _contacts(shared: Any) -> _Content:
    """One part per shared card: the formatted name, then its phone numbers."""
    cards = []
    for card in _items(shared, "shared_contact"):
        name = _obj(card.get("name"))
        label = _text(name.get("formatted_name")) or " ".join(
            part for part in (_text(name.get("first_name")), _text(name.get("last_name"))) if part
        )
        phones = [p for p in (_text(_obj(ph).get("phone")) for ph in _list(card.get("phones"))) if p]
        cards.append(": ".join(part for part in (label, ", ".join(phones)) if part) or "(no name)")
    return _Content(MessageKind.CONTACTS, text="; ".join(cards) or None)


def _interactive(body: dict[str, Any]) -> _Content:
    """Button and list replies give the title the user saw (the id stays in raw); flows give their fields."""
    reply_type = body.get("type")
    if reply_type in ("button_reply", "list_reply"):
        return _Content(MessageKind.INTERACTIVE_REPLY, text=_text(_obj(body.get(reply_type)).get("title")))
    if reply_type == "nfm_reply":
        reply = _obj(body.get("nfm_reply"))
        # The body is a fixed "Sent"; what the user filled in is in response_json.
        text = _flow_summary(reply.get("response_json")) or _text(reply.get("body"))
        return _Content(MessageKind.INTERACTIVE_REPLY, text=text)
    return _Content(MessageKind.UNSUPPORTED)


def _flow_summary(response_json: Any) -> str | None:
    if not isinstance(response_json, str):
        return None
    try:
        fields = json.loads(response_json)
    except (ValueError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    parts = [
        f"{key}: {value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
        for key, value in fields.items()
        if key != "flow_token"  # an opaque correlation token, not something the user said
    ]
    return ", ".join(parts) or None


def _template_button(body: dict[str, Any]) -> _Content:
    return _Content(MessageKind.TEMPLATE_BUTTON, text=_text(body.get("text")))


def _order(body: dict[str, Any]) -> _Content:
    """E.g. "2 x SKU-1 @ 9.99 USD; 1 x SKU-2 @ 15 USD. Note: gift wrap, please"."""
    items = []
    for item in _items(body.get("product_items"), "order_item"):
        product = _ident(item.get("product_retailer_id")) or "?"
        quantity = _number(item.get("quantity")) or "?"
        price = _number(item.get("item_price"))
        currency = _text(item.get("currency"))
        cost = " ".join(part for part in (price, currency) if part)
        items.append(f"{quantity} x {product}" + (f" @ {cost}" if cost else ""))
    summary = "; ".join(items) or "no items"
    note = _text(body.get("text"))
    return _Content(MessageKind.ORDER, text=f"{summary}. Note: {note}" if note else summary)


def _reaction(body: dict[str, Any]) -> _Content:
    """`emoji` is absent when the user removes a reaction; the reacted-to message is the reply target."""
    return _Content(
        MessageKind.REACTION, text=_text(body.get("emoji")), reply_to_id=_ident(body.get("message_id"))
    )


def _system(body: dict[str, Any]) -> _Content:
    return _Content(MessageKind.SYSTEM, text=_text(body.get("body")))


_CONTENT_PARSERS: dict[str, Callable[[dict[str, Any]], _Content]] = {
    "text": _text_message,
    "location": _location,
    "interactive": _interactive,
    "button": _template_button,
    "order": _order,
    "reaction": _reaction,
    "system": _system,
}
# The message types the adapter reads, for docs/platforms.md (checked by tests/test_platform_docs.py);
# every other type (unsupported, edit, revoke, request_welcome, ...) is UNSUPPORTED.
MESSAGE_TYPES: tuple[str, ...] = (*_MEDIA_KINDS, "contacts", *_CONTENT_PARSERS)


# Defensive accessors: JSON from outside may hold any type anywhere.


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _items(value: Any, item: str) -> Iterator[dict[str, Any]]:
    """The objects of a JSON array; a non-object element is skipped and logged."""
    for element in _list(value):
        if isinstance(element, dict):
            yield element
        else:
            _skipped(item, "not_an_object")


def _ident(value: Any) -> str | None:
    """Ids are strings; a bare number is accepted as its decimal form."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _timestamp(value: Any, item: str, wamid: str) -> datetime:
    """Meta sends unix seconds as a string; an unusable one becomes the time of receipt, keeping the item."""
    seconds = _int(value)
    if seconds is not None:
        try:
            return datetime.fromtimestamp(seconds, tz=UTC)
        except (OverflowError, OSError, ValueError):
            pass
    log.warning("whatsapp_timestamp_invalid", item=item, message_id=wamid)
    return datetime.now(UTC)


def _skipped(item: str, reason: str, **ids: Any) -> None:
    """Logs ids and the reason only: bodies and phone numbers stay out of the logs."""
    log.warning("whatsapp_item_skipped", item=item, reason=reason, **ids)
