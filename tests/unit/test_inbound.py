"""The normalized inbound types: session ids, which kinds start a turn, and what the agent reads."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.domain.inbound import (
    DEFAULT_TURN_KINDS,
    ConversationKey,
    InboundMessage,
    Location,
    MediaRef,
    MessageKind,
    agent_text,
    starts_turn,
)

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def message(kind: MessageKind, **fields: object) -> InboundMessage:
    conversation = fields.pop("conversation", ConversationKey("telegram", "42"))
    return InboundMessage(
        platform="telegram",
        message_id="1",
        dedup_key="tg:1:1",
        conversation=conversation,  # type: ignore[arg-type]
        kind=kind,
        timestamp=NOW,
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("key", "session_id"),
    [
        (ConversationKey("whatsapp", "US.123", scope="1065"), "whatsapp:1065:US.123"),
        (ConversationKey("telegram", "-1001"), "telegram:-1001"),
        (ConversationKey("telegram", "-1001", thread_id="7"), "telegram:-1001:7"),
    ],
)
def test_session_ids(key: ConversationKey, session_id: str) -> None:
    assert key.session_id == session_id
    assert hash(key) == hash(ConversationKey(key.platform, key.chat_id, key.scope, key.thread_id))


def test_default_turn_kinds_follow_the_documented_split() -> None:
    recorded_only = {
        MessageKind.REACTION,
        MessageKind.STICKER,
        MessageKind.EDITED_MESSAGE,
        MessageKind.CHANNEL_POST,
        MessageKind.MEMBERSHIP_CHANGE,
        MessageKind.SYSTEM,
        MessageKind.UNSUPPORTED,
    }
    assert set(MessageKind) - DEFAULT_TURN_KINDS == recorded_only
    assert starts_turn(message(MessageKind.TEXT, text="hi"))
    assert not starts_turn(message(MessageKind.REACTION, text="👍"))
    assert not starts_turn(message(MessageKind.TEXT, text="hi", addressed_to_bot=False))
    assert starts_turn(message(MessageKind.STICKER), frozenset({MessageKind.STICKER}))


@pytest.mark.parametrize(
    ("msg", "text"),
    [
        (message(MessageKind.TEXT, text="hello"), "hello"),
        (message(MessageKind.CALLBACK_QUERY, text="btn:1"), "btn:1"),
        (
            message(MessageKind.IMAGE, media=MediaRef("m1", "image/jpeg", caption="my receipt")),
            "[image] my receipt",
        ),
        (message(MessageKind.IMAGE, media=MediaRef("m1", "image/jpeg")), "[image]"),
        (message(MessageKind.DOCUMENT, media=MediaRef("d", file_name="bill.pdf")), "[document bill.pdf]"),
        (message(MessageKind.LOCATION, location=Location(52.5, 13.4)), "[location] 52.5, 13.4"),
        (
            message(MessageKind.LOCATION, location=Location(52.5, 13.4, "Cafe", "Main St 1")),
            "[location] Cafe, Main St 1 (52.5, 13.4)",
        ),
        (message(MessageKind.INTERACTIVE_REPLY, text="Yes, please"), "[interactive reply] Yes, please"),
        (message(MessageKind.ORDER), "[order]"),
    ],
)
def test_agent_text(msg: InboundMessage, text: str) -> None:
    assert agent_text(msg) == text


def test_to_dict_is_json_ready_and_complete() -> None:
    import json
    from dataclasses import fields

    msg = message(
        MessageKind.IMAGE,
        media=MediaRef("m1", "image/jpeg", caption="c"),
        location=Location(1.0, 2.0),
        raw={"update_id": 1},
        conversation=ConversationKey("telegram", "42", thread_id="7"),
    )
    data = json.loads(json.dumps(msg.to_dict()))
    assert {f.name for f in fields(InboundMessage)} <= set(data)
    assert data["session_id"] == "telegram:42:7"
    assert data["kind"] == "image"
    assert data["media"] == {"id": "m1", "mime_type": "image/jpeg", "caption": "c", "file_name": None}
    assert data["conversation"]["thread_id"] == "7"
    assert data["timestamp"] == NOW.isoformat()


def test_from_dict_reads_back_what_to_dict_stored() -> None:
    import json

    msg = message(
        MessageKind.LOCATION,
        location=Location(1.5, 2.5, name="Depot", address="1 Main St"),
        media=MediaRef("m1", "image/jpeg", caption="c", file_name="a.jpg"),
        user_id="9",
        phone="15550001",
        reply_to_id="3",
        addressed_to_bot=False,
        callback_query_id="cb",
        chat_type="group",
        raw={"update_id": 1},
        conversation=ConversationKey("telegram", "42", scope="s", thread_id="7"),
    )
    back = InboundMessage.from_dict(json.loads(json.dumps(msg.to_dict())))
    assert back == msg
    assert back.raw == {"update_id": 1}
    assert back.timestamp.tzinfo is not None


def test_from_dict_tolerates_rows_of_other_versions() -> None:
    """An older row (no chat_type, numeric ids, no conversation) and a newer one (unknown keys and
    kind) both read, with the row's own columns filling the gaps."""
    old = {"message_id": 17, "kind": "text", "text": "hi", "timestamp": "2026-01-01T00:00:00", "user_id": 5}
    back = InboundMessage.from_dict(old, platform="telegram", session_id="telegram:42")
    assert (back.platform, back.chat_id, back.message_id, back.user_id) == ("telegram", "42", "17", "5")
    assert back.session_id == "telegram:42"
    assert back.chat_type is None
    assert back.addressed_to_bot
    assert back.timestamp == datetime(2026, 1, 1, tzinfo=UTC)

    newer = {**message(MessageKind.TEXT, text="x").to_dict(), "kind": "hologram", "mood": "happy"}
    newer["media"] = {"id": "m", "resolution": "8k"}
    newer["location"] = {"latitude": 1.0}  # no longitude: unreadable, dropped
    back = InboundMessage.from_dict(newer)
    assert back.kind is MessageKind.UNSUPPORTED
    assert back.media == MediaRef("m")
    assert back.location is None
    assert back.text == "x"
