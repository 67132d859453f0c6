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
