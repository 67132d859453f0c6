"""Telegram adapter: secret-header check, and what each kind of Update becomes."""

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
    MembershipChange,
    MessageKind,
    ParsedUpdate,
    agent_text,
    starts_turn,
)
from gateway.domain.outbound import TelegramTarget
from gateway.errors import SettingsError
from gateway.platforms.base import PlatformAdapter
from gateway.platforms.telegram.adapter import SECRET_HEADER, TelegramAdapter
from gateway.platforms.telegram.spec import TELEGRAM

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads" / "telegram"
SECRET = "s3cr3t-Token_for-tests"
BOT_ID = "7012345678"
BOT_USERNAME = "chatflow_demo_bot"
NOW = datetime(2026, 2, 1, 12, 0, tzinfo=UTC)
DATE = datetime(2026, 1, 1, tzinfo=UTC)  # the fixtures' `date`

PRIVATE = "telegram:123456789"
SUPERGROUP = "telegram:-1001987654321"


@pytest.fixture
def adapter() -> TelegramAdapter:
    return TelegramAdapter(SECRET, BOT_ID, BOT_USERNAME, clock=lambda: NOW)


def load(name: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads((PAYLOADS / f"{name}.json").read_text(encoding="utf-8"))
    return payload


def only_message(parsed: ParsedUpdate) -> InboundMessage:
    assert not parsed.statuses
    assert not parsed.memberships
    (message,) = parsed.messages
    return message


def test_is_a_platform_adapter(adapter: TelegramAdapter) -> None:
    checked: PlatformAdapter = adapter
    assert checked.name == "telegram"


# --- verify -----------------------------------------------------------------------------------------


def test_verify_accepts_the_secret_header(adapter: TelegramAdapter) -> None:
    assert adapter.verify({SECRET_HEADER: SECRET}, b"{}")


@pytest.mark.parametrize(
    "headers",
    [
        {SECRET_HEADER: "wrong"},
        {SECRET_HEADER: ""},
        {SECRET_HEADER: SECRET + "x"},
        {SECRET_HEADER: SECRET[:-1]},
        {SECRET_HEADER: "sécret-non-ascii"},
        {},
        {"x-other-header": SECRET},
    ],
    ids=["wrong", "empty", "longer", "shorter", "non-ascii", "missing", "other-header"],
)
def test_verify_rejects(adapter: TelegramAdapter, headers: dict[str, str]) -> None:
    assert not adapter.verify(headers, b"{}")


def test_verify_fails_closed_without_a_configured_secret() -> None:
    assert not TelegramAdapter("", BOT_ID).verify({SECRET_HEADER: ""}, b"{}")


# --- bot id -----------------------------------------------------------------------------------------


def test_bot_id_from_token() -> None:
    assert TelegramAdapter.bot_id_from_token("7012345678:AAHk-3jd_fake-Secret") == "7012345678"


@pytest.mark.parametrize("token", ["", "no-colon", ":secret", "12ab:secret", "123:", "١٢٣:secret"])
def test_bot_id_from_a_malformed_token_names_no_secret(token: str) -> None:
    with pytest.raises(SettingsError) as caught:
        TelegramAdapter.bot_id_from_token(token)
    assert not token or token not in str(caught.value)


# --- fixtures: one expectation per payload file -------------------------------------------------------

EXPECTED: dict[str, dict[str, Any]] = {
    "private_text": {
        "kind": MessageKind.TEXT,
        "session_id": PRIVATE,
        "message_id": "123456789:101",
        "text": "Hello! Can you help me book a table for two?",
        "user_id": "123456789",
        "user_name": "Alice Moreau",
        "addressed_to_bot": True,
        "timestamp": DATE,
    },
    "private_command": {
        "kind": MessageKind.TEXT,
        "session_id": PRIVATE,
        "text": "/start",
        "addressed_to_bot": True,
    },
    "group_mention_after_emoji": {
        "kind": MessageKind.TEXT,
        "session_id": SUPERGROUP,
        "message_id": "-1001987654321:2001",
        "text": "🎉🎉 what's the weather in Lyon?",
        "user_name": "Bob",
        "addressed_to_bot": True,
    },
    "group_not_addressed": {
        "kind": MessageKind.TEXT,
        "session_id": "telegram:-4098765432",
        "text": "Did anyone see @alice_m today?",
        "addressed_to_bot": False,
    },
    "group_reply_to_bot": {
        "kind": MessageKind.TEXT,
        "session_id": SUPERGROUP,
        "text": "Yes, the second option please",
        "reply_to_id": "-1001987654321:2002",
        "addressed_to_bot": True,
    },
    "group_command_addressed": {
        "kind": MessageKind.TEXT,
        "text": "/help billing",
        "addressed_to_bot": True,
    },
    "group_command_other_bot": {
        "kind": MessageKind.TEXT,
        "text": "/start@other_helper_bot",
        "addressed_to_bot": False,
    },
    "forum_topic": {
        "kind": MessageKind.TEXT,
        "session_id": "telegram:-1002233445566:42",
        "thread_id": "42",
        "chat_id": "-1002233445566",
        "text": "summarize this topic",
        "reply_to_id": "-1002233445566:42",
        "user_name": "Claire Dubois",
        "addressed_to_bot": True,
    },
    "photo_caption": {
        "kind": MessageKind.IMAGE,
        "session_id": SUPERGROUP,
        "text": "what plant is this? 🌿",
        "media": MediaRef("AgACAgQAAxkBAAIBZ2cLarge", caption="what plant is this? 🌿"),
        "addressed_to_bot": True,
    },
    "voice": {
        "kind": MessageKind.AUDIO,
        "text": None,
        "media": MediaRef("AwACAgQAAxkBAAIBaGcVoice", mime_type="audio/ogg"),
    },
    "document": {
        "kind": MessageKind.DOCUMENT,
        "text": "Please check this invoice",
        "media": MediaRef(
            "BQACAgQAAxkBAAIBaWcDoc",
            mime_type="application/pdf",
            caption="Please check this invoice",
            file_name="invoice-2026-01.pdf",
        ),
    },
    "animation": {
        "kind": MessageKind.VIDEO,
        "media": MediaRef("CgACAgQAAxkBAAIBa2cAnim", mime_type="video/mp4", file_name="cat.mp4"),
    },
    "sticker": {
        "kind": MessageKind.STICKER,
        "text": "👍",
        "media": MediaRef("CAACAgIAAxkBAAIBamcSticker", mime_type="image/webp"),
    },
    "location": {
        "kind": MessageKind.LOCATION,
        "location": Location(45.764043, 4.835659),
        "text": None,
    },
    "venue": {
        "kind": MessageKind.LOCATION,
        "location": Location(
            45.762937,
            4.850543,
            name="Les Halles de Lyon Paul Bocuse",
            address="102 Cours Lafayette, 69003 Lyon",
        ),
    },
    "contact": {
        "kind": MessageKind.CONTACTS,
        "text": "Claire Dubois +33612345678",
    },
    "edited_message": {
        "kind": MessageKind.EDITED_MESSAGE,
        "session_id": PRIVATE,
        "message_id": "123456789:101",  # the id of the message it edits
        "text": "Hello! Can you help me book a table for three?",
        "timestamp": datetime(2026, 1, 1, 0, 5, tzinfo=UTC),  # edit_date
    },
    "channel_post": {
        "kind": MessageKind.CHANNEL_POST,
        "session_id": "telegram:-1001122334455",
        "text": "Release 1.2 is out: faster webhooks and forum topics.",
        "user_id": "-1001122334455",
        "user_name": "Chatflow News",
        "addressed_to_bot": False,
    },
    "callback_query": {
        "kind": MessageKind.CALLBACK_QUERY,
        "session_id": PRIVATE,
        "message_id": "callback:4382bfdwdsb323b2d9",
        "callback_query_id": "4382bfdwdsb323b2d9",
        "text": "book:table:2",
        "reply_to_id": "123456789:109",
        "user_id": "123456789",
        "addressed_to_bot": True,
        "timestamp": NOW,
    },
    "callback_query_inaccessible": {
        "kind": MessageKind.CALLBACK_QUERY,
        "session_id": SUPERGROUP,
        "callback_query_id": "4382bfdwdsb323b2e0",
        "text": "poll:vote:yes",
        "reply_to_id": "-1001987654321:55",
        "user_id": "987654321",
        "timestamp": NOW,
    },
    "new_chat_members": {
        "kind": MessageKind.MEMBERSHIP_CHANGE,
        "session_id": SUPERGROUP,
        "text": "joined: Claire Dubois",
        "addressed_to_bot": False,
    },
    "group_migrated": {
        "kind": MessageKind.SYSTEM,
        "text": "migrate_to_chat_id",
        "addressed_to_bot": False,
    },
    "dice": {
        "kind": MessageKind.UNSUPPORTED,
        "text": "dice",
    },
    "unicode_text": {
        "kind": MessageKind.TEXT,
        "text": "Ça va? 👩\u200d👩\u200d👧 日本語 مرحبا é — “quotes” "
        + "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522",  # Fraktur "Unicode"
        "addressed_to_bot": True,
    },
    "message_reaction": {
        "kind": MessageKind.REACTION,
        "session_id": PRIVATE,
        "message_id": "reaction:830000025",
        "text": "👍",
        "reply_to_id": "123456789:109",
        "user_id": "123456789",
        "timestamp": datetime(2026, 1, 1, 0, 1, tzinfo=UTC),
    },
}

MEMBERSHIPS = {
    "my_chat_member_kicked": ("kicked", False, datetime(2026, 1, 1, 1, tzinfo=UTC)),
    "my_chat_member_member": ("member", True, datetime(2026, 1, 1, 2, tzinfo=UTC)),
}
IGNORED = {"inline_query"}


def test_every_fixture_has_an_expectation() -> None:
    names = {path.stem for path in PAYLOADS.glob("*.json")}
    assert names == set(EXPECTED) | set(MEMBERSHIPS) | IGNORED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses_to_the_expected_message(adapter: TelegramAdapter, name: str) -> None:
    payload = load(name)
    message = only_message(adapter.parse(payload))
    assert message.platform == "telegram"
    assert message.dedup_key == f"tg:{BOT_ID}:{payload['update_id']}"
    assert message.raw is payload
    assert message.timestamp.tzinfo is not None
    actual = {field: getattr(message, field) for field in EXPECTED[name]}
    assert actual == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_messages_render_for_the_agent(adapter: TelegramAdapter, name: str) -> None:
    message = only_message(adapter.parse(load(name)))
    assert isinstance(agent_text(message), str)


@pytest.mark.parametrize("name", sorted(MEMBERSHIPS))
def test_my_chat_member_is_a_membership_change(adapter: TelegramAdapter, name: str) -> None:
    status, reachable, when = MEMBERSHIPS[name]
    parsed = adapter.parse(load(name))
    assert parsed.memberships == [
        MembershipChange(
            platform="telegram",
            chat_id="123456789",
            status=status,
            reachable=reachable,
            dedup_key=f"tg:{BOT_ID}:{load(name)['update_id']}",
            timestamp=when,
        )
    ]
    assert not parsed.messages


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_other_update_types_are_ignored(adapter: TelegramAdapter, name: str) -> None:
    with capture_logs() as logs:
        assert adapter.parse(load(name)).empty
    assert all(event["log_level"] != "warning" for event in logs)


# --- addressing and mention stripping ------------------------------------------------------------------


def group_message(text: str, entities: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "update_id": 1,
        "message": {
            "message_id": 9,
            "from": {"id": 42, "is_bot": False, "first_name": "Zoé"},
            "chat": {"id": -100123, "type": "supergroup", "title": "G"},
            "date": 1767225600,
            "text": text,
            "entities": entities,
            **extra,
        },
    }


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


@pytest.mark.parametrize(
    ("prefix", "suffix", "expected"),
    [
        ("", " hi", "hi"),
        ("", ", hi there", "hi there"),
        ("", ": hi", "hi"),
        ("hello ", "", "hello"),
        ("hello ", "!", "hello!"),
        ("say   ", "   hi", "say hi"),
        ("line one\n", "\nline two", "line one\nline two"),
        ("👩\u200d👩\u200d👧 \U0001d518 ", " ok", "👩\u200d👩\u200d👧 \U0001d518 ok"),
    ],
)
def test_mention_is_stripped_at_utf16_offsets(
    adapter: TelegramAdapter, prefix: str, suffix: str, expected: str
) -> None:
    mention = "@Chatflow_Demo_Bot"  # usernames are case-insensitive
    entity = {"type": "mention", "offset": utf16_len(prefix), "length": utf16_len(mention)}
    message = only_message(adapter.parse(group_message(prefix + mention + suffix, [entity])))
    assert message.addressed_to_bot
    assert message.text == expected


def test_text_mention_of_the_bot_addresses_it(adapter: TelegramAdapter) -> None:
    entity = {"type": "text_mention", "offset": 0, "length": 13, "user": {"id": int(BOT_ID), "is_bot": True}}
    message = only_message(adapter.parse(group_message("Chatflow Demo what now?", [entity])))
    assert message.addressed_to_bot
    assert message.text == "what now?"


def test_mention_of_someone_else_is_kept(adapter: TelegramAdapter) -> None:
    entity = {"type": "mention", "offset": 3, "length": 8}
    message = only_message(adapter.parse(group_message("hi @someone", [entity])))
    assert not message.addressed_to_bot
    assert message.text == "hi @someone"


def test_entity_splitting_a_surrogate_pair_is_ignored(adapter: TelegramAdapter) -> None:
    entity = {"type": "mention", "offset": 1, "length": 18}
    message = only_message(adapter.parse(group_message("\U0001d518@chatflow_demo_bot", [entity])))
    assert not message.addressed_to_bot
    assert message.text == "\U0001d518@chatflow_demo_bot"


def test_without_a_username_only_commands_and_replies_address_the_bot() -> None:
    adapter = TelegramAdapter(SECRET, BOT_ID)
    mention = {"type": "mention", "offset": 0, "length": 18}
    assert not only_message(adapter.parse(group_message("@chatflow_demo_bot hi", [mention]))).addressed_to_bot
    command = {"type": "bot_command", "offset": 0, "length": 5}
    assert only_message(adapter.parse(group_message("/help", [command]))).addressed_to_bot


def test_reply_to_someone_else_in_a_group_is_not_addressed(adapter: TelegramAdapter) -> None:
    reply = {"message_id": 3, "from": {"id": 43, "is_bot": False, "first_name": "X"}, "date": 1}
    message = only_message(adapter.parse(group_message("agreed", [], reply_to_message=reply)))
    assert not message.addressed_to_bot
    assert message.reply_to_id == "-100123:3"


def test_thread_id_without_is_topic_message_keeps_the_chat_session(adapter: TelegramAdapter) -> None:
    message = only_message(adapter.parse(group_message("in a reply thread", [], message_thread_id=7)))
    assert message.thread_id is None
    assert message.session_id == "telegram:-100123"


# --- message variants built inline ---------------------------------------------------------------------


def private_message(**content: Any) -> dict[str, Any]:
    return {
        "update_id": 5,
        "message": {
            "message_id": 1,
            "from": {"id": 7, "is_bot": False, "first_name": "Ann", "username": "ann"},
            "chat": {"id": 7, "type": "private", "first_name": "Ann"},
            "date": 1767225600,
            **content,
        },
    }


@pytest.mark.parametrize(
    ("content", "kind", "media"),
    [
        ({"audio": {"file_id": "au", "mime_type": "audio/mpeg", "file_name": "a.mp3"}}, "audio", "au"),
        ({"video": {"file_id": "vi", "mime_type": "video/mp4"}}, "video", "vi"),
        ({"video_note": {"file_id": "vn", "length": 240}}, "video", "vn"),
        ({"sticker": {"file_id": "st", "is_animated": True, "is_video": False}}, "sticker", "st"),
        ({"poll": {"id": "1", "question": "?"}}, "unsupported", None),
        ({"left_chat_member": {"id": 9, "is_bot": False, "first_name": "Max"}}, "membership_change", None),
        ({"pinned_message": {"message_id": 1, "date": 0}}, "system", None),
        ({}, "unsupported", None),
    ],
)
def test_message_kinds(
    adapter: TelegramAdapter, content: dict[str, Any], kind: str, media: str | None
) -> None:
    message = only_message(adapter.parse(private_message(**content)))
    assert message.kind == kind
    assert (message.media.id if message.media else None) == media


def test_user_name_falls_back_to_username(adapter: TelegramAdapter) -> None:
    payload = private_message(text="hi")
    payload["message"]["from"] = {"id": 7, "is_bot": False, "first_name": "", "username": "ann"}
    assert only_message(adapter.parse(payload)).user_name == "ann"


def test_photo_picks_the_largest_size_whatever_the_order(adapter: TelegramAdapter) -> None:
    sizes = [
        {"file_id": "mid", "width": 320, "height": 240},
        {"file_id": "big", "width": 800, "height": 800},
        {"file_id": "wide", "width": 1000, "height": 100},
    ]
    message = only_message(adapter.parse(private_message(photo=sizes)))
    assert message.media == MediaRef("big")


def test_restricted_bot_that_is_no_longer_a_member_is_unreachable(adapter: TelegramAdapter) -> None:
    payload = load("my_chat_member_member")
    payload["my_chat_member"]["new_chat_member"] = {"status": "restricted", "is_member": False}
    (change,) = adapter.parse(payload).memberships
    assert not change.reachable


def test_callback_query_without_a_message_is_the_users_chat(adapter: TelegramAdapter) -> None:
    payload = load("callback_query")
    del payload["callback_query"]["message"]
    payload["callback_query"]["inline_message_id"] = "AAAAAJ0_inline"
    message = only_message(adapter.parse(payload))
    assert message.session_id == PRIVATE
    assert message.reply_to_id is None


def test_a_group_upgrade_is_recorded_in_both_chats_and_starts_no_turn(adapter: TelegramAdapter) -> None:
    # The old group gets `migrate_to_chat_id`; the supergroup's first message has `migrate_from_chat_id`.
    old = only_message(adapter.parse(load("group_migrated")))
    new = only_message(
        adapter.parse(
            {
                "update_id": 830000029,
                "message": {
                    "message_id": 1,
                    "from": {
                        "id": 1087968824,
                        "is_bot": True,
                        "first_name": "Group",
                        "username": "GroupAnonymousBot",
                    },
                    "sender_chat": {"id": -1003344556677, "title": "Family", "type": "supergroup"},
                    "chat": {"id": -1003344556677, "title": "Family", "type": "supergroup"},
                    "date": 1767225600,
                    "migrate_from_chat_id": -4098765432,
                },
            }
        )
    )
    assert (old.kind, old.text, old.session_id) == (
        MessageKind.SYSTEM,
        "migrate_to_chat_id",
        "telegram:-4098765432",
    )
    assert (new.kind, new.text, new.session_id) == (
        MessageKind.SYSTEM,
        "migrate_from_chat_id",
        "telegram:-1003344556677",
    )
    assert not starts_turn(old)
    assert not starts_turn(new)


# --- garbage never raises --------------------------------------------------------------------------------

GARBAGE: list[Any] = [
    {},
    {"update_id": "x"},
    {"update_id": True, "message": {}},
    {"update_id": 1},
    {"update_id": 1, "message": None},
    {"update_id": 1, "message": "text"},
    {"update_id": 1, "message": {}},
    {"update_id": 1, "message": {"message_id": 1, "text": "no chat"}},
    {"update_id": 1, "message": {"message_id": 1, "chat": {"id": "one"}, "text": "x"}},
    {"update_id": 1, "message": {"chat": {"id": 1}, "text": "no message id"}},
    {"update_id": 1, "edited_message": []},
    {"update_id": 1, "callback_query": {}},
    {"update_id": 1, "callback_query": {"id": 5, "from": {"id": 1}}},
    {"update_id": 1, "my_chat_member": {"chat": {"id": 1}}},
    {"update_id": 1, "my_chat_member": {"chat": {"id": 1}, "new_chat_member": {"status": 3}}},
    {"update_id": 1, "message_reaction": {"chat": {"id": 1}}},
    [],
    "not even an object",
]


@pytest.mark.parametrize("payload", GARBAGE)
def test_garbage_gives_an_empty_update_and_a_warning(adapter: TelegramAdapter, payload: Any) -> None:
    with capture_logs() as logs:
        assert adapter.parse(payload).empty
    assert [(e["event"], e["log_level"]) for e in logs] == [("telegram_update_skipped", "warning")]
    assert logs[0]["reason"] != "parse_error"


def test_odd_field_values_are_tolerated(adapter: TelegramAdapter) -> None:
    payload = private_message(
        text="@chatflow_demo_bot hi",
        entities=[None, {"type": "mention"}, {"type": "mention", "offset": -1, "length": 99}, "x"],
        date=10**20,
        reply_to_message=[],
    )
    payload["message"]["from"] = {"id": 7, "first_name": 3}
    message = only_message(adapter.parse(payload))
    assert message.text == "@chatflow_demo_bot hi"
    assert message.timestamp == NOW
    assert message.user_name is None


def test_skip_logs_carry_no_message_text(adapter: TelegramAdapter) -> None:
    with capture_logs() as logs:
        adapter.parse({"update_id": 3, "message": {"text": "private words", "chat": "?"}})
    assert "private words" not in repr(logs)
    assert SECRET not in repr(logs)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)
# Telegram-shaped keys, so the generator reaches deep into the parser rather than stopping at the top.
KEYS = [
    "update_id", "message", "edited_message", "channel_post", "callback_query", "my_chat_member",
    "message_reaction", "chat", "id", "type", "message_id", "from", "text", "entities", "offset", "length",
    "caption", "caption_entities", "photo", "file_id", "width", "height", "venue", "location", "latitude",
    "longitude", "contact", "new_chat_members", "reply_to_message", "message_thread_id", "is_topic_message",
    "new_chat_member", "status", "date", "edit_date", "data", "user", "new_reaction", "emoji", "sticker",
]  # fmt: skip
WORDS = ["private", "group", "supergroup", "mention", "bot_command", "@chatflow_demo_bot", "kicked"]
shaped = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**53) | st.text(max_size=12) | st.sampled_from(WORDS),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS), children, max_size=6)
    ),
    max_leaves=40,
)


ids = st.integers(-(2**52), 2**52)
user = st.fixed_dictionaries(
    {"id": ids}, optional={"first_name": st.text(max_size=5), "is_bot": st.booleans()}
)
chat = st.fixed_dictionaries(
    {"id": ids, "type": st.sampled_from(["private", "group", "supergroup", "channel"])},
    optional={"is_forum": st.booleans()},
)
entity = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["mention", "bot_command", "text_mention", "bold"]),
        "offset": st.integers(-1, 30),
        "length": st.integers(-1, 30),
    },
    optional={"user": user},
)
message = st.fixed_dictionaries(
    {"message_id": st.integers(0, 10**6), "chat": chat, "date": st.integers(-1, 2**40)},
    optional={
        "text": st.text(alphabet=st.sampled_from("a @/\n😀\U0001d518\u200d_chatflowdemobt"), max_size=30),
        "entities": st.lists(entity, max_size=3),
        "caption_entities": st.lists(entity, max_size=3),
        "from": user,
        "reply_to_message": st.fixed_dictionaries({"message_id": ids}, optional={"from": user}),
        "message_thread_id": ids,
        "is_topic_message": st.booleans(),
        **{
            key: shaped
            for key in KEYS
            if key not in {"chat", "message_id", "date", "from", "text", "entities"}
        },
    },
)
# Nearly valid updates: right skeleton, arbitrary flesh, so the property reaches the deep paths too.
updates = st.builds(
    lambda update_id, update_type, body, extra: {"update_id": update_id, update_type: {**body, **extra}},
    st.integers(0, 2**31),
    st.sampled_from(["message", "edited_message", "channel_post", "callback_query", "my_chat_member"]),
    message,
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.text(max_size=5),
            "from": user,
            "message": message,
            "data": st.text(max_size=5),
            "new_chat_member": st.fixed_dictionaries({"status": st.sampled_from(WORDS)}),
        },
    ),
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payload=st.dictionaries(st.text(max_size=12), json_values, max_size=5)
    | st.dictionaries(st.sampled_from(KEYS), shaped, max_size=4)
    | updates
)
def test_parse_never_raises_on_arbitrary_json_objects(
    adapter: TelegramAdapter, payload: dict[str, Any]
) -> None:
    with capture_logs() as logs:
        parsed = adapter.parse(payload)
    assert isinstance(parsed, ParsedUpdate)
    # The catch-all is a safety net; the parser itself must handle every shape.
    assert not [e for e in logs if e.get("reason") == "parse_error"]


def test_group_messages_are_marked_so_replies_quote_them(adapter: TelegramAdapter) -> None:
    group = only_message(adapter.parse(load("group_reply_to_bot")))
    private = only_message(adapter.parse(load("private_text")))
    assert group.chat_type == "group"
    assert private.chat_type is None
    assert group.to_dict()["chat_type"] == "group"


# --- issue 15: numbers sent as strings -------------------------------------------------------------


def test_numbers_sent_as_strings_are_read_as_numbers(adapter: TelegramAdapter) -> None:
    """A proxy that re-encodes updates may quote every number; the message must survive it."""
    text = "@chatflow_demo_bot hours?"
    payload = group_message(text, [{"type": "mention", "offset": "0", "length": "18"}])
    payload["update_id"] = "77"
    msg = payload["message"]
    msg.update(message_id="9", date="1767225600", message_thread_id="4", is_topic_message=True)
    msg["chat"]["id"] = "-100123"
    msg["from"]["id"] = "42"
    message = only_message(adapter.parse(payload))
    assert (message.dedup_key, message.message_id) == (f"tg:{BOT_ID}:77", "-100123:9")
    assert (message.session_id, message.user_id, message.text) == ("telegram:-100123:4", "42", "hours?")
    assert message.timestamp == DATE
    assert starts_turn(message)
    located = private_message(location={"latitude": "52.5", "longitude": "13.25"})
    assert only_message(adapter.parse(located)).location == Location(52.5, 13.25)


# --- issue 15: business chats and fields added to an update -------------------------------------------


def business_update(sender: int, connection: str | None = "BCONN-1", **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "message_id": 123,
        "from": {"id": sender, "is_bot": False, "first_name": "Mario"},
        "chat": {"id": 456, "first_name": "Mario", "type": "private"},
        "date": 1767225600,
        "text": "Is the shop open on Sunday?",
        **extra,
    }
    if connection is not None:
        message["business_connection_id"] = connection
    return {"update_id": 31, "business_message": message}


def test_a_customers_business_message_is_a_turn_in_the_business_chat(adapter: TelegramAdapter) -> None:
    message = only_message(adapter.parse(business_update(sender=456)))
    assert (message.kind, message.text, message.user_id) == (
        MessageKind.TEXT,
        "Is the shop open on Sunday?",
        "456",
    )
    assert message.session_id == "telegram:BCONN-1:456"  # not the bot's own chat with the user
    assert starts_turn(message)
    target = TELEGRAM.reply_target(message)
    assert isinstance(target, TelegramTarget)
    assert (target.chat_id, target.business_connection_id) == ("456", "BCONN-1")


def test_the_business_owners_own_messages_and_unknown_connections_are_only_recorded(
    adapter: TelegramAdapter,
) -> None:
    owner = only_message(adapter.parse(business_update(sender=999)))  # the business account wrote
    assert not starts_turn(owner)
    unknown = only_message(adapter.parse(business_update(sender=456, connection=None)))
    assert not starts_turn(unknown)  # no connection: a reply could not be sent as the business
    edited = adapter.parse(
        {"update_id": 32, "edited_business_message": business_update(456)["business_message"]}
    )
    assert only_message(edited).kind is MessageKind.EDITED_MESSAGE


def test_a_field_added_before_the_update_does_not_hide_it(adapter: TelegramAdapter) -> None:
    payload = {"x_forwarded_by": {"proxy": 1}, **private_message(text="hi")}
    assert only_message(adapter.parse(payload)).text == "hi"


@pytest.mark.parametrize(
    ("field", "kind", "text"),
    [
        ("chat_owner_changed", MessageKind.SYSTEM, "chat_owner_changed"),
        ("checklist_tasks_done", MessageKind.SYSTEM, "checklist_tasks_done"),
        ("poll_option_added", MessageKind.SYSTEM, "poll_option_added"),
        ("rich_message", MessageKind.UNSUPPORTED, "rich_message"),
    ],
)
def test_newer_service_and_content_fields_are_named(
    adapter: TelegramAdapter, field: str, kind: MessageKind, text: str
) -> None:
    message = only_message(adapter.parse(private_message(**{field: {"anything": 1}})))
    assert (message.kind, message.text) == (kind, text)
