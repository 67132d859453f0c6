"""WhatsApp adapter: signatures as Meta computes them, the handshake, and parsing of every payload shape."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from gateway.domain.inbound import (
    InboundMessage,
    Location,
    MediaRef,
    MessageKind,
    ParsedUpdate,
    StatusUpdate,
    agent_text,
)
from gateway.platforms.base import PlatformAdapter
from gateway.platforms.whatsapp import adapter as whatsapp
from gateway.platforms.whatsapp.adapter import SIGNATURE_HEADER, WhatsAppAdapter
from tests.helpers import replace_one_part

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads" / "whatsapp"
SECRET = "0123456789abcdef0123456789abcdef"
PNID = "106540352242922"
PHONE = "16505551234"
BSUID = "US.13491208655302741918"
BIZ_WAMID = "wamid.HBgLMTY1MDU1NTEyMzQVAgARGBI5QTNDQTVCM0Q0Q0Q2RTY3RTcA"
SENT_AT = datetime(2026, 4, 14, 10, 0, tzinfo=UTC)


def raw(name: str) -> bytes:
    return (PAYLOADS / f"{name}.json").read_bytes()


def load(name: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(raw(name))
    return payload


def wamid(n: int) -> str:
    return f"wamid.HBgLMTY1MDU1NTEyMzQVAgASGBQzQUI{n:04d}RjI2QjI2NjA0NDQ3RUEzNwA="


@pytest.fixture
def adapter() -> WhatsAppAdapter:
    return WhatsAppAdapter(SECRET)


def only_message(update: ParsedUpdate) -> InboundMessage:
    assert not update.statuses
    (message,) = update.messages
    return message


def only_status(update: ParsedUpdate) -> StatusUpdate:
    assert not update.messages
    (status,) = update.statuses
    return status


def envelope(*values: Any, field: str = "messages") -> dict[str, Any]:
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "1", "changes": [{"value": value, "field": field} for value in values]}],
    }


def value(*messages: Any, contacts: Any = None, **extra: Any) -> dict[str, Any]:
    v: dict[str, Any] = {"messaging_product": "whatsapp", "metadata": {"phone_number_id": PNID}}
    if contacts is not None:
        v["contacts"] = contacts
    return {**v, "messages": list(messages), **extra}


def text_message(n: int = 1, **fields: Any) -> dict[str, Any]:
    return {
        "from": PHONE,
        "id": wamid(n),
        "timestamp": "1776160800",
        "type": "text",
        "text": {"body": "hi"},
        **fields,
    }


# --- identity -------------------------------------------------------------------------------------


def test_is_a_platform_adapter_and_hides_its_secret(adapter: WhatsAppAdapter) -> None:
    as_protocol: PlatformAdapter = adapter
    assert as_protocol.name == "whatsapp"
    assert SECRET not in repr(adapter)


# --- signature ------------------------------------------------------------------------------------


def test_signature_is_sha256_hmac_of_the_raw_body(adapter: WhatsAppAdapter) -> None:
    body = raw("text")
    signature = WhatsAppAdapter.sign(SECRET, body)
    assert signature.startswith("sha256=")
    assert len(signature) == len("sha256=") + 64
    assert adapter.verify({SIGNATURE_HEADER: signature}, body)
    assert adapter.verify({SIGNATURE_HEADER: signature.upper().replace("SHA256=", "sha256=")}, body)


def test_signature_with_the_wrong_secret_is_rejected(adapter: WhatsAppAdapter) -> None:
    body = raw("text")
    assert not adapter.verify({SIGNATURE_HEADER: WhatsAppAdapter.sign("another-secret", body)}, body)


def test_tampered_body_is_rejected(adapter: WhatsAppAdapter) -> None:
    body = raw("text")
    signature = WhatsAppAdapter.sign(SECRET, body)
    assert not adapter.verify({SIGNATURE_HEADER: signature}, body.replace(b"color", b"colour"))
    assert not adapter.verify({SIGNATURE_HEADER: signature}, body + b"\n")


def test_missing_header_is_rejected(adapter: WhatsAppAdapter) -> None:
    body = raw("text")
    assert not adapter.verify({}, body)
    assert not adapter.verify({"x-hub-signature": "sha1=" + "0" * 40}, body)  # the old SHA-1 header


@pytest.mark.parametrize(
    "header",
    [
        "",
        "sha256=",
        "sha256",
        "sha1=" + "a" * 40,
        "sha256=" + "g" * 64,
        "sha256=" + "a" * 63,
        "sha256=" + "a" * 65,
        " sha256=" + "a" * 64,
        "sha256=" + "é" * 64,
        "md5=sha256=" + "a" * 64,
    ],
)
def test_malformed_header_is_rejected(adapter: WhatsAppAdapter, header: str) -> None:
    assert not adapter.verify({SIGNATURE_HEADER: header}, raw("text"))


def test_malformed_header_carrying_the_right_digest_is_rejected(adapter: WhatsAppAdapter) -> None:
    body = raw("text")
    digest = WhatsAppAdapter.sign(SECRET, body).removeprefix("sha256=")
    assert not adapter.verify({SIGNATURE_HEADER: digest}, body)
    assert not adapter.verify({SIGNATURE_HEADER: f"sha256={digest} "}, body)


def test_no_app_secret_rejects_everything() -> None:
    body = raw("text")
    assert not WhatsAppAdapter("").verify({SIGNATURE_HEADER: WhatsAppAdapter.sign("", body)}, body)


def test_unicode_signature_holds_only_for_the_bytes_meta_sent(adapter: WhatsAppAdapter) -> None:
    body = raw("text_non_ascii")
    assert b"\\u00fc" in body  # non-ASCII arrives as lowercase \uXXXX escapes
    assert b"https:\\/\\/" in body  # and "/" as "\/"
    signature = WhatsAppAdapter.sign(SECRET, body)
    assert adapter.verify({SIGNATURE_HEADER: signature}, body)

    payload = json.loads(body)
    for reserialized in (
        json.dumps(payload).encode(),
        json.dumps(payload, separators=(",", ":")).encode(),
        json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode(),
    ):
        assert json.loads(reserialized) == payload
        assert not adapter.verify({SIGNATURE_HEADER: signature}, reserialized)


# --- handshake ------------------------------------------------------------------------------------


def test_handshake_accepts_subscribe_with_the_right_token() -> None:
    assert WhatsAppAdapter.verify_handshake("subscribe", "my-verify-token", "my-verify-token")
    assert WhatsAppAdapter(SECRET).verify_handshake("subscribe", "my-verify-token", "my-verify-token")


@pytest.mark.parametrize(
    ("mode", "token", "verify_token"),
    [
        ("subscribe", "wrong", "my-verify-token"),
        ("subscribe", None, "my-verify-token"),
        ("subscribe", "", "my-verify-token"),
        ("unsubscribe", "my-verify-token", "my-verify-token"),
        (None, "my-verify-token", "my-verify-token"),
        ("subscribe", "", ""),  # no token configured: nothing matches
        ("subscribe", "tøken", "token"),
    ],
)
def test_handshake_rejects(mode: str | None, token: str | None, verify_token: str) -> None:
    assert not WhatsAppAdapter.verify_handshake(mode, token, verify_token)


# --- messages, one fixture per kind ---------------------------------------------------------------

BY_BSUID = f"whatsapp:{PNID}:{BSUID}"

# fixture: (kind, session_id, user_id, phone, user_name, text, reply_to_id, message number)
MESSAGE_FIXTURES: dict[
    str, tuple[MessageKind, str, str, str | None, str | None, str | None, str | None, int]
] = {
    "text": (
        MessageKind.TEXT,
        f"whatsapp:{PNID}:{PHONE}",
        PHONE,
        PHONE,
        "Sheena Nelson",
        "Does it come in another color?",
        None,
        1,
    ),
    "text_non_ascii": (
        MessageKind.TEXT,
        BY_BSUID,
        BSUID,
        PHONE,
        "Zoë Müller",
        "Grüße aus Zürich! 日本語も大丈夫? 😀 see https://example.com/a/b",
        None,
        2,
    ),
    "image_caption": (
        MessageKind.IMAGE,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Is this one in stock?",
        None,
        3,
    ),
    "audio_voice": (MessageKind.AUDIO, BY_BSUID, BSUID, PHONE, "Sheena Nelson", None, None, 4),
    "document": (MessageKind.DOCUMENT, BY_BSUID, BSUID, PHONE, "Sheena Nelson", "Invoice for March", None, 5),
    "sticker": (MessageKind.STICKER, BY_BSUID, BSUID, PHONE, "Sheena Nelson", None, None, 6),
    "location": (MessageKind.LOCATION, BY_BSUID, BSUID, PHONE, "Sheena Nelson", None, None, 7),
    "contacts": (
        MessageKind.CONTACTS,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Jane Doe: +1 (650) 555-0199, +1 650 555 0100; Bob",
        None,
        8,
    ),
    "interactive_button_reply": (
        MessageKind.INTERACTIVE_REPLY,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Yes, confirm",
        BIZ_WAMID,
        9,
    ),
    "interactive_list_reply": (
        MessageKind.INTERACTIVE_REPLY,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Mon 20 Apr, 10:00",
        BIZ_WAMID,
        10,
    ),
    "interactive_flow_nfm_reply": (
        MessageKind.INTERACTIVE_REPLY,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "appointment_date: 2026-04-20, party_size: 2",
        BIZ_WAMID,
        11,
    ),
    "template_button": (
        MessageKind.TEMPLATE_BUTTON,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Track my order",
        BIZ_WAMID,
        12,
    ),
    "order": (
        MessageKind.ORDER,
        BY_BSUID,
        BSUID,
        PHONE,
        "Sheena Nelson",
        "2 x sku-tshirt-m @ 19.99 USD; 1 x sku-mug @ 12 USD. Note: Please deliver after 5pm",
        None,
        13,
    ),
    "reaction": (MessageKind.REACTION, BY_BSUID, BSUID, PHONE, "Sheena Nelson", "❤️", BIZ_WAMID, 14),
    "system_user_changed_number": (
        MessageKind.SYSTEM,
        f"whatsapp:{PNID}:{PHONE}",
        PHONE,
        PHONE,
        None,  # system messages come without contacts
        "Sheena Nelson changed from 16505551234 to 16505559999",
        None,
        15,
    ),
    "unsupported": (MessageKind.UNSUPPORTED, BY_BSUID, BSUID, PHONE, "Sheena Nelson", None, None, 16),
    "bsuid_without_phone": (
        MessageKind.TEXT,
        f"whatsapp:{PNID}:BR.Pk1YQ2F3e9Jd4mHq7Lx0",
        "BR.Pk1YQ2F3e9Jd4mHq7Lx0",
        None,
        "Maya",
        "Hi, is the shop open on Sunday?",
        None,
        17,
    ),
    "text_group": (
        MessageKind.TEXT,
        f"whatsapp:{PNID}:Y2FwaV9ncm91cDoxNTU1MDc4Mzg4MToxMjAzNjM0MDY1NzAyNDg0OTU=",
        BSUID,
        PHONE,
        "Sheena Nelson",
        "Can someone confirm the pickup time?",
        None,
        18,
    ),
}


@pytest.mark.parametrize("name", sorted(MESSAGE_FIXTURES))
def test_fixture_parses_to_one_message(adapter: WhatsAppAdapter, name: str) -> None:
    kind, session_id, user_id, phone, user_name, text, reply_to_id, n = MESSAGE_FIXTURES[name]
    payload = load(name)
    message = only_message(adapter.parse(payload))
    assert message.platform == "whatsapp"
    assert message.kind is kind
    assert message.message_id == wamid(n)
    assert message.dedup_key == f"wa:msg:{wamid(n)}"
    assert message.session_id == session_id
    assert message.conversation.scope == PNID
    assert message.user_id == user_id
    assert message.phone == phone
    assert message.user_name == user_name
    assert message.text == text
    assert message.reply_to_id == reply_to_id
    assert message.timestamp == SENT_AT
    assert message.addressed_to_bot
    assert message.raw == payload["entry"][0]["changes"][0]["value"]["messages"][0]


def test_media_references(adapter: WhatsAppAdapter) -> None:
    image = only_message(adapter.parse(load("image_caption")))
    assert image.media == MediaRef(
        id="1003383421387256", mime_type="image/jpeg", caption="Is this one in stock?"
    )
    voice = only_message(adapter.parse(load("audio_voice")))
    assert voice.media == MediaRef(id="1171413341225185", mime_type="audio/ogg; codecs=opus")
    assert voice.raw["audio"]["voice"] is True
    document = only_message(adapter.parse(load("document")))
    assert document.media == MediaRef(
        id="2406731106354231",
        mime_type="application/pdf",
        caption="Invoice for March",
        file_name="invoice-2026-03.pdf",
    )
    sticker = only_message(adapter.parse(load("sticker")))
    assert sticker.media == MediaRef(id="1254879456321478", mime_type="image/webp")


def test_named_location(adapter: WhatsAppAdapter) -> None:
    message = only_message(adapter.parse(load("location")))
    assert message.location == Location(
        latitude=37.483307,
        longitude=-122.148981,
        name="Meta Headquarters",
        address="1 Hacker Way, Menlo Park, CA 94025",
        url="https://meta.com",
    )


def test_reply_ids_stay_in_raw(adapter: WhatsAppAdapter) -> None:
    button = only_message(adapter.parse(load("interactive_button_reply")))
    assert button.raw["interactive"]["button_reply"]["id"] == "confirm-order-42"
    listed = only_message(adapter.parse(load("interactive_list_reply")))
    assert listed.raw["interactive"]["list_reply"]["id"] == "slot-2026-04-20-1000"
    template = only_message(adapter.parse(load("template_button")))
    assert template.raw["button"]["payload"] == "TRACK_ORDER_42"


def test_flow_reply_falls_back_to_its_body(adapter: WhatsAppAdapter) -> None:
    reply = {"type": "nfm_reply", "nfm_reply": {"name": "flow", "body": "Sent", "response_json": "not json"}}
    message = only_message(
        adapter.parse(envelope(value(text_message(type="interactive", interactive=reply))))
    )
    assert message.kind is MessageKind.INTERACTIVE_REPLY
    assert message.text == "Sent"


def test_removed_reaction_has_no_text(adapter: WhatsAppAdapter) -> None:
    msg = text_message(type="reaction", reaction={"message_id": BIZ_WAMID})
    message = only_message(adapter.parse(envelope(value(msg))))
    assert message.kind is MessageKind.REACTION
    assert message.text is None
    assert message.reply_to_id == BIZ_WAMID


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "edit", "edit": {"original_message_id": "wamid.X", "text": {"body": "fixed"}}},
        {"type": "revoke", "revoke": {"original_message_id": "wamid.X"}},
        {"type": "request_welcome"},
        {"type": "poll_creation_v9"},
        {"type": None},
        {"type": "interactive", "interactive": {"type": "call_permission_reply", "response": "accept"}},
    ],
)
def test_unknown_types_are_unsupported(adapter: WhatsAppAdapter, fields: dict[str, Any]) -> None:
    msg = {k: v for k, v in text_message().items() if k != "text"} | fields
    message = only_message(adapter.parse(envelope(value(msg))))
    assert message.kind is MessageKind.UNSUPPORTED
    assert message.dedup_key == f"wa:msg:{wamid(1)}"


def test_quoted_reply_and_forwarded_context(adapter: WhatsAppAdapter) -> None:
    quoted = text_message(1, context={"from": "15550783881", "id": BIZ_WAMID})
    forwarded = text_message(2, context={"forwarded": True})
    first, second = adapter.parse(envelope(value(quoted, forwarded))).messages
    assert first.reply_to_id == BIZ_WAMID
    assert second.reply_to_id is None


def test_sender_bsuid_comes_from_the_matching_contact(adapter: WhatsAppAdapter) -> None:
    contacts = [
        {"profile": {"name": "Other"}, "wa_id": "447700900123", "user_id": "GB.other"},
        {"profile": {"name": "Sheena"}, "wa_id": PHONE, "user_id": BSUID},
    ]
    message = only_message(adapter.parse(envelope(value(text_message(), contacts=contacts))))
    assert (message.user_id, message.phone, message.user_name) == (BSUID, PHONE, "Sheena")
    assert message.session_id == BY_BSUID


def test_phone_comes_from_the_matching_contact(adapter: WhatsAppAdapter) -> None:
    msg = {k: v for k, v in text_message().items() if k != "from"} | {"from_user_id": BSUID}
    contacts = [{"profile": {"name": "Sheena"}, "wa_id": PHONE, "user_id": BSUID}]
    message = only_message(adapter.parse(envelope(value(msg, contacts=contacts))))
    assert (message.user_id, message.phone) == (BSUID, PHONE)


def test_unmatched_contact_is_not_borrowed(adapter: WhatsAppAdapter) -> None:
    contacts = [{"profile": {"name": "Someone Else"}, "wa_id": "447700900123"}]
    message = only_message(adapter.parse(envelope(value(text_message(), contacts=contacts))))
    assert message.user_name is None
    assert message.user_id == PHONE


# --- batches --------------------------------------------------------------------------------------


def test_batch_yields_every_message_with_its_own_sender(adapter: WhatsAppAdapter) -> None:
    update = adapter.parse(load("batch"))
    other = "220099887766554"
    got = [(m.message_id, m.session_id, m.user_name, m.phone, m.kind) for m in update.messages]
    assert got == [
        (wamid(101), f"whatsapp:{PNID}:{BSUID}", "Al A", PHONE, MessageKind.TEXT),
        (wamid(102), f"whatsapp:{PNID}:GB.8YtR2mWq0Zc4Lp9Ks", "Bea B", "447700900123", MessageKind.TEXT),
        (wamid(103), f"whatsapp:{PNID}:{BSUID}", "Al A", PHONE, MessageKind.IMAGE),
        (wamid(104), f"whatsapp:{PNID}:4915123456789", "Cem C", "4915123456789", MessageKind.TEXT),
        (wamid(201), f"whatsapp:{other}:DE.Qm3Vb7Hn2Jx8Tc5", "Cem C", "4915123456789", MessageKind.TEXT),
        (wamid(202), f"whatsapp:{other}:GB.8YtR2mWq0Zc4Lp9Ks", "Bea B", None, MessageKind.TEXT),
        (wamid(203), f"whatsapp:{other}:{BSUID}", "Al A", PHONE, MessageKind.REACTION),
    ]
    assert [m.text for m in update.messages][:2] == ["first from A", "first from B"]
    (status,) = update.statuses
    assert status.status == "delivered"
    assert status.recipient_id == PHONE


def test_a_bad_item_costs_only_itself(adapter: WhatsAppAdapter) -> None:
    good = text_message(1)
    no_id = {k: v for k, v in text_message(2).items() if k != "id"}
    no_sender = {k: v for k, v in text_message(3).items() if k != "from"}
    messages = [good, no_id, "not an object", no_sender, None, text_message(4)]
    with capture_logs() as logs:
        update = adapter.parse(envelope(value(*messages)))
    assert [m.message_id for m in update.messages] == [wamid(1), wamid(4)]
    skipped = [e for e in logs if e["event"] == "whatsapp_item_skipped"]
    assert [e["reason"] for e in skipped] == [
        "missing_id",
        "not_an_object",
        "missing_sender",
        "not_an_object",
    ]
    assert all(e["log_level"] == "warning" for e in skipped)


def test_an_unforeseen_error_costs_only_its_item(
    adapter: WhatsAppAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = whatsapp._content

    def explode_on_images(msg: dict[str, Any]) -> Any:
        if msg.get("type") == "image":
            raise KeyError("boom")
        return real(msg)

    monkeypatch.setattr(whatsapp, "_content", explode_on_images)
    with capture_logs() as logs:
        update = adapter.parse(load("batch"))
    assert wamid(103) not in [m.message_id for m in update.messages]
    assert len(update.messages) == 6
    assert logs == [
        {
            "event": "whatsapp_item_skipped",
            "log_level": "warning",
            "item": "message",
            "reason": "unexpected_error",
            "error": "KeyError",
            "message_id": wamid(103),
        }
    ]


def test_skipped_items_never_log_bodies_or_phones(adapter: WhatsAppAdapter) -> None:
    secret_body = "my card number is 4111 1111 1111 1111"
    msg = {"from": PHONE, "timestamp": "1", "type": "text", "text": {"body": secret_body}}
    no_pnid = {"messaging_product": "whatsapp", "messages": [text_message(5, text={"body": secret_body})]}
    with capture_logs() as logs:
        assert adapter.parse(envelope(value(msg), no_pnid)).empty
    dumped = json.dumps(logs, default=str)
    assert [e["reason"] for e in logs] == ["missing_id", "missing_phone_number_id"]
    assert secret_body not in dumped
    assert PHONE not in dumped


def test_unusable_timestamp_becomes_the_time_of_receipt(adapter: WhatsAppAdapter) -> None:
    before = datetime.now(UTC)
    with capture_logs() as logs:
        update = adapter.parse(
            envelope(value(text_message(1, timestamp="soon"), text_message(2, timestamp="9" * 40)))
        )
    assert len(update.messages) == 2
    assert all(m.timestamp >= before and m.timestamp.tzinfo is UTC for m in update.messages)
    assert [e["event"] for e in logs] == ["whatsapp_timestamp_invalid"] * 2


# --- statuses -------------------------------------------------------------------------------------

OUT_WAMID = "wamid.HBgLMTY1MDU1NTEyMzQVAgARGBI2QzE4NUE0RDVGNzk2MDM2QzgA"


@pytest.mark.parametrize(("status", "minute"), [("sent", 1), ("delivered", 2), ("read", 3)])
def test_status_fixture(adapter: WhatsAppAdapter, status: str, minute: int) -> None:
    update = only_status(adapter.parse(load(f"status_{status}")))
    assert update == StatusUpdate(
        platform="whatsapp",
        message_id=OUT_WAMID,
        status=status,
        dedup_key=f"wa:status:{OUT_WAMID}:{status}",
        timestamp=datetime(2026, 4, 14, 10, minute, tzinfo=UTC),
        recipient_id=PHONE,
    )


def test_failed_status_carries_the_error(adapter: WhatsAppAdapter) -> None:
    update = only_status(adapter.parse(load("status_failed")))
    failed = "wamid.HBgLMTY1MDU1NTEyMzQVAgARGBIyRkI4QjE4MzU0M0EyNDk3OTMA"
    assert update.status == "failed"
    assert update.dedup_key == f"wa:status:{failed}:failed"
    assert (update.error_code, update.error_title) == (131047, "Re-engagement message")
    assert update.recipient_id == PHONE


def test_status_sent_to_a_bsuid_names_it_as_recipient(adapter: WhatsAppAdapter) -> None:
    status = {"id": OUT_WAMID, "status": "read", "timestamp": "1776160800", "recipient_user_id": BSUID}
    update = only_status(
        adapter.parse(envelope({"metadata": {"phone_number_id": PNID}, "statuses": [status]}))
    )
    assert update.recipient_id == BSUID


def test_statuses_without_id_or_status_are_skipped(adapter: WhatsAppAdapter) -> None:
    statuses = [{"status": "read"}, {"id": OUT_WAMID}, {"id": OUT_WAMID, "status": 3}, []]
    with capture_logs():
        assert adapter.parse(envelope({"statuses": statuses})).empty


# --- other fields and garbage ---------------------------------------------------------------------


def test_errors_only_value_is_logged_and_yields_nothing(adapter: WhatsAppAdapter) -> None:
    with capture_logs() as logs:
        assert adapter.parse(load("errors_only")).empty
    assert logs == [
        {
            "event": "whatsapp_error_notification",
            "log_level": "warning",
            "code": 131000,
            "title": "Something went wrong",
            "phone_number_id": PNID,
        }
    ]


def test_other_fields_are_ignored(adapter: WhatsAppAdapter) -> None:
    assert adapter.parse(load("template_status_update")).empty
    # A messages-shaped value under another field is still not a message.
    assert adapter.parse(envelope(value(text_message()), field="user_id_update")).empty


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"object": 1},
        {"object": "page", "entry": load("text")["entry"]},
        {"object": "whatsapp_business_account"},
        {"object": "whatsapp_business_account", "entry": None},
        {"object": "whatsapp_business_account", "entry": {"changes": []}},
        {"object": "whatsapp_business_account", "entry": [1, "x", None, []]},
        {"object": "whatsapp_business_account", "entry": [{"changes": "no"}]},
        {"object": "whatsapp_business_account", "entry": [{"changes": [{"field": "messages"}]}]},
        {"object": "whatsapp_business_account", "entry": [{"changes": [{"field": "messages", "value": []}]}]},
        envelope({"messages": {"id": "wamid.1"}}),
        envelope({"metadata": "x", "messages": [text_message()]}),
        envelope(value({"type": "text", "text": {"body": "no id"}}, {"id": None, "from": PHONE})),
        envelope(value(text_message(id=True), text_message(id=[1]), text_message(id=""))),
        envelope(value(text_message() | {"from": {"n": 1}}, text_message() | {"from": False})),
        envelope({"contacts": "x", "statuses": "x", "errors": "x", "messages": 5}),
    ],
)
def test_garbage_gives_an_empty_update(adapter: WhatsAppAdapter, payload: dict[str, Any]) -> None:
    with capture_logs():
        assert adapter.parse(payload).empty


@pytest.mark.parametrize(
    "fields",
    [
        {"image": "not an object", "type": "image"},
        {"image": {"caption": 5}, "type": "image"},
        {"location": {"latitude": "north", "longitude": None}, "type": "location"},
        {"location": {"latitude": float("nan"), "longitude": 1e400}, "type": "location"},
        {"contacts": [None, {"name": "x", "phones": "y"}, {}], "type": "contacts"},
        {"order": {"product_items": [{"quantity": True, "item_price": "x"}, 7]}, "type": "order"},
        {
            "interactive": {"type": "nfm_reply", "nfm_reply": {"response_json": "[" * 100_000}},
            "type": "interactive",
        },
        {"interactive": {"type": "button_reply", "button_reply": None}, "type": "interactive"},
        {"reaction": {"message_id": {"id": 1}}, "type": "reaction"},
        {"context": [], "timestamp": None, "group_id": 5},
    ],
)
def test_malformed_bodies_still_give_the_message(adapter: WhatsAppAdapter, fields: dict[str, Any]) -> None:
    with capture_logs():
        message = only_message(adapter.parse(envelope(value(text_message() | fields))))
    assert message.dedup_key == f"wa:msg:{wamid(1)}"


# --- properties -----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(
        ["whatsapp_business_account", "messages", "text", "image", "interactive", "1776160800"]
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=25,
)
json_objects = st.dictionaries(
    st.sampled_from(["object", "entry", "changes", "value", "field", "messages", "statuses"])
    | st.text(max_size=8),
    json_values,
    max_size=5,
)
PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _parse_checked(payload: dict[str, Any]) -> None:
    """Parses without raising, keeps the invariants, and needs no last-resort catch to get there."""
    with capture_logs() as logs:
        update = WhatsAppAdapter(SECRET).parse(payload)
    assert not [e for e in logs if e.get("reason") == "unexpected_error"]
    for message in update.messages:
        assert message.dedup_key == f"wa:msg:{message.message_id}"
        assert message.session_id.startswith("whatsapp:")
        assert message.timestamp.tzinfo is not None
    for status in update.statuses:
        assert status.dedup_key == f"wa:status:{status.message_id}:{status.status}"


@PROPERTY_SETTINGS
@given(payload=json_objects)
def test_never_raises_on_arbitrary_json_objects(payload: dict[str, Any]) -> None:
    _parse_checked(payload)


FIXTURE_NAMES = sorted(p.stem for p in PAYLOADS.glob("*.json"))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_never_raises_on_mutated_fixtures(data: st.DataObject) -> None:
    """Real payloads with any one part replaced by arbitrary JSON: the shapes parse() actually walks."""
    payload = load(data.draw(st.sampled_from(FIXTURE_NAMES)))
    replace_one_part(data, payload, json_values)
    _parse_checked(payload)


# --- issue 15: what real payloads carry ----------------------------------------------------------


def test_location_gives_the_agent_every_field_of_the_place(adapter: WhatsAppAdapter) -> None:
    message = only_message(adapter.parse(load("location")))
    assert message.location is not None
    assert message.location.url == "https://meta.com"
    assert agent_text(message) == (
        "[location] Meta Headquarters, 1 Hacker Way, Menlo Park, CA 94025 (37.483307, -122.148981) "
        "https://meta.com"
    )


def test_sender_known_only_by_the_single_contact(adapter: WhatsAppAdapter) -> None:
    """The 2026 BSUID rollout: no `from` and no `from_user_id`; the change's one contact is the sender."""
    msg = {k: v for k, v in text_message().items() if k != "from"}
    contacts = [{"profile": {"name": "Sheena"}, "user_id": BSUID}]
    with capture_logs() as logs:
        message = only_message(adapter.parse(envelope(value(msg, contacts=contacts))))
    assert (message.user_id, message.phone, message.user_name) == (BSUID, None, "Sheena")
    assert message.session_id == BY_BSUID
    assert [e["event"] for e in logs] == ["whatsapp_sender_from_single_contact"]
    assert BSUID not in str(logs)
    assert "Sheena" not in str(logs)


def test_sender_is_not_guessed_among_several_contacts(adapter: WhatsAppAdapter) -> None:
    msg = {k: v for k, v in text_message().items() if k != "from"}
    contacts = [{"user_id": BSUID}, {"user_id": "GB.other"}]
    with capture_logs() as logs:
        update = adapter.parse(envelope(value(msg, contacts=contacts)))
    assert update.messages == []
    assert [(e["event"], e["reason"]) for e in logs] == [("whatsapp_item_skipped", "missing_sender")]


@pytest.mark.parametrize(
    ("quantity", "price", "expected"),
    [
        (3, 12.5, "3 x SKU-1 @ 12.5 USD"),
        ("3", "12.5", "3 x SKU-1 @ 12.5 USD"),
        ("2", "15.0", "2 x SKU-1 @ 15 USD"),
        (" 3", "1_0", "? x SKU-1 @ USD"),  # not numbers as JSON writes them
    ],
)
def test_order_numbers_may_be_strings(
    adapter: WhatsAppAdapter, quantity: Any, price: Any, expected: str
) -> None:
    item = {"product_retailer_id": "SKU-1", "quantity": quantity, "item_price": price, "currency": "USD"}
    msg = text_message() | {"type": "order", "order": {"catalog_id": "1", "product_items": [item]}}
    del msg["text"]
    assert only_message(adapter.parse(envelope(value(msg)))).text == expected


def test_location_coordinates_may_be_strings(adapter: WhatsAppAdapter) -> None:
    msg = text_message() | {"type": "location", "location": {"latitude": "52.5", "longitude": "-13.25"}}
    location = only_message(adapter.parse(envelope(value(msg)))).location
    assert location is not None
    assert (location.latitude, location.longitude) == (52.5, -13.25)


def test_a_place_without_readable_coordinates_keeps_its_name_and_address(adapter: WhatsAppAdapter) -> None:
    place = {"latitude": "LATITUDE", "longitude": None, "name": "Cafe Roma", "address": "Via Po 1"}
    msg = text_message() | {"type": "location", "location": place}
    message = only_message(adapter.parse(envelope(value(msg))))
    assert (message.kind, message.location) == (MessageKind.LOCATION, None)
    assert agent_text(message) == "[location] Cafe Roma, Via Po 1"
