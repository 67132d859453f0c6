"""SessionContext (checkpoints, rollback, complete-turn pruning), titles, and the messages it holds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import FrozenInstanceError
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agents import Agent, Rule, Runner, ScriptedModel, SessionStore
from gateway.agents.context import DEFAULT_MAX_TURNS, DEFAULT_TITLE, SessionContext, make_title
from gateway.domain.messages import Message, Role, ToolCall

FAST = settings(max_examples=200, deadline=None, database=None)

SUPPORT = Agent(name="Support", instructions="Help.")
BILLING = Agent(name="Billing", instructions="Refunds.")


def session(history: Sequence[Message] = (), max_turns: int = DEFAULT_MAX_TURNS) -> SessionContext:
    context = SessionContext("s-1", SUPPORT, max_turns=max_turns)
    context.history = list(history)
    return context


def pruned(history: Sequence[Message], max_turns: int) -> list[Message]:
    context = session(history, max_turns)
    context._prune_history()
    return context.history


def same(a: Sequence[Message], b: Sequence[Message]) -> bool:
    """The same message objects in the same order (Message equality would also accept copies)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def model(text: str | None, *calls: ToolCall) -> Message:
    return Message(role=Role.MODEL, content=text, tool_calls=list(calls))


def tool_result(call_id: str, text: str = "{}") -> Message:
    return Message(role=Role.TOOL, content=text, tool_call_id=call_id, name="lookup")


def system(text: str) -> Message:
    return Message(role=Role.SYSTEM, content=text)


# --- construction --------------------------------------------------------------------------------


def test_a_new_session_exposes_its_state() -> None:
    context = SessionContext("abc", SUPPORT, max_turns=7, metadata={"platform": "web"})
    assert context.session_id == "abc"
    assert context.active_agent is SUPPORT
    assert context.history == []
    assert context.metadata == {"platform": "web"}
    assert context.max_turns == 7
    assert context.title is None


def test_defaults() -> None:
    context = SessionContext("abc", SUPPORT)
    assert context.max_turns == DEFAULT_MAX_TURNS == 40
    assert context.metadata == {}


def test_metadata_is_copied_not_shared_with_the_caller() -> None:
    given_metadata = {"platform": "web"}
    context = SessionContext("abc", SUPPORT, metadata=given_metadata)
    context.metadata["user"] = "u1"
    assert given_metadata == {"platform": "web"}


@pytest.mark.parametrize("max_turns", [0, -1, -40])
def test_max_turns_must_be_positive(max_turns: int) -> None:
    with pytest.raises(ValueError, match="max_turns"):
        SessionContext("abc", SUPPORT, max_turns=max_turns)


def test_max_turns_of_one_is_allowed() -> None:
    assert SessionContext("abc", SUPPORT, max_turns=1).max_turns == 1


# --- checkpoints -----------------------------------------------------------------------------------


def test_rollback_restores_history_agent_metadata_and_title_exactly() -> None:
    first, reply = user("hello"), model("hi")
    context = SessionContext("abc", SUPPORT, metadata={"platform": "web", "lang": "en"})
    context.history = [first, reply]
    context.title = "hello"
    checkpoint = context.checkpoint()

    context.history.append(user("refund please"))
    context.history[0] = user("rewritten")
    context.active_agent = BILLING
    context.metadata["lang"] = "de"
    context.metadata["extra"] = 1
    del context.metadata["platform"]
    context.title = "changed"

    context.rollback_to(checkpoint)
    assert same(context.history, [first, reply])
    assert context.active_agent is SUPPORT
    assert context.metadata == {"platform": "web", "lang": "en"}
    assert context.title == "hello"


def test_rollback_restores_a_missing_title() -> None:
    context = session([user("hi")])
    checkpoint = context.checkpoint()
    context.title = "hi"
    context.rollback_to(checkpoint)
    assert context.title is None


def test_a_checkpoint_is_a_snapshot_and_can_be_used_twice() -> None:
    context = session([user("one")])
    context.metadata["k"] = "v"
    checkpoint = context.checkpoint()
    history_before = list(checkpoint.history)

    for attempt in range(2):
        context.history.append(user(f"attempt {attempt}"))
        context.metadata["k"] = f"changed {attempt}"
        context.rollback_to(checkpoint)
        assert same(context.history, history_before)
        assert context.metadata == {"k": "v"}

    # The restored containers are the session's own: changing them leaves the checkpoint alone.
    context.history.clear()
    context.metadata.clear()
    assert same(checkpoint.history, history_before)
    assert checkpoint.metadata == {"k": "v"}


def test_checkpoints_are_immutable() -> None:
    checkpoint = session().checkpoint()
    with pytest.raises(FrozenInstanceError):
        checkpoint.title = "x"  # type: ignore[misc]


def test_rollback_restores_pruned_history() -> None:
    history = [user("1"), model("a"), user("2"), model("b")]
    context = session(history, max_turns=1)
    checkpoint = context.checkpoint()
    context._prune_history()
    assert len(context.history) == 2
    context.rollback_to(checkpoint)
    assert same(context.history, history)


class ExplodingModel:
    async def respond(self, *args: object) -> Message:
        raise RuntimeError("model down")


async def test_a_failed_turn_leaves_history_agent_and_title_as_they_were() -> None:
    store = SessionStore()
    agent = Agent(name="Support", model=ScriptedModel())
    runner = Runner(agent, store)
    await runner.run_async("s", "hello there")
    stored = await store.get("s")
    assert stored is not None
    history, title = list(stored.history), stored.title

    agent.model = ExplodingModel()
    with pytest.raises(RuntimeError, match="model down"):
        await runner.run_async("s", "second message")

    assert same(stored.history, history)
    assert stored.title == title == "hello there"
    assert stored.active_agent is agent


async def test_a_failed_turn_leaves_metadata_as_it_was() -> None:
    store = SessionStore()
    agent = Agent(name="Support", model=ScriptedModel())
    runner = Runner(agent, store)
    await runner.run_async("s", "hello", {"lang": "en"})
    agent.model = ExplodingModel()
    with pytest.raises(RuntimeError):
        await runner.run_async("s", "again", {"lang": "de", "new": True})
    stored = await store.get("s")
    assert stored is not None
    assert stored.metadata == {"lang": "en"}


# --- pruning: examples -------------------------------------------------------------------------------


def test_pruning_keeps_the_newest_complete_turns() -> None:
    call = ToolCall("call_1", "lookup", {"order_id": 1})
    history = [
        system("be nice"),
        user("one"),
        model("a"),
        user("two"),
        model(None, call),
        tool_result("call_1"),
        model("b"),
        user("three"),
        model("c"),
    ]
    assert same(pruned(history, 2), [history[0], *history[3:]])
    assert same(pruned(history, 1), [history[0], *history[7:]])
    assert same(pruned(history, 3), history)
    assert same(pruned(history, 100), history)


def test_pruning_moves_system_messages_to_the_front_in_order() -> None:
    s1, s2, s3 = system("s1"), system("s2"), system("s3")
    u1, m1, u2, m2 = user("1"), model("a"), user("2"), model("b")
    assert same(pruned([u1, s1, m1, s2, u2, s3, m2], 1), [s1, s2, s3, u2, m2])
    assert same(pruned([u1, s1, m1, s2, u2, s3, m2], 5), [s1, s2, s3, u1, m1, u2, m2])


def test_pruning_drops_what_comes_before_the_first_user_message() -> None:
    orphan_model, orphan_tool = model("stray"), tool_result("call_0")
    u1, m1 = user("1"), model("a")
    assert same(pruned([orphan_tool, orphan_model, u1, m1], 5), [u1, m1])


def test_pruning_never_keeps_a_tool_result_without_its_call() -> None:
    # With one turn kept, the call in turn 1 goes and so must its result (which belongs to turn 1).
    call = ToolCall("call_1", "lookup")
    history = [user("1"), model(None, call), tool_result("call_1"), model("a"), user("2"), model("b")]
    kept = pruned(history, 1)
    assert same(kept, history[4:])
    assert all(m.role is not Role.TOOL for m in kept)


def test_pruning_without_user_messages_keeps_only_system_messages() -> None:
    s1 = system("s1")
    assert same(pruned([model("a"), s1, tool_result("x"), model("b")], 3), [s1])
    assert pruned([], 3) == []


async def test_the_runner_prunes_after_every_turn() -> None:
    store = SessionStore(default_max_turns=2)
    runner = Runner(Agent(name="Support", model=ScriptedModel(rules=[Rule(r".", reply="ok")])), store)
    for text in ["one", "two", "three", "four"]:
        await runner.run_async("s", text)
        stored = await store.get("s")
        assert stored is not None
        assert len([m for m in stored.history if m.role is Role.USER]) <= 2
    assert stored is not None
    assert [(m.role, m.content) for m in stored.history] == [
        (Role.USER, "three"),
        (Role.MODEL, "ok"),
        (Role.USER, "four"),
        (Role.MODEL, "ok"),
    ]


# --- pruning: properties -----------------------------------------------------------------------------


@st.composite
def any_history(draw: st.DrawFn) -> list[Message]:
    """Any sequence of roles, malformed ones included: orphan results, MODEL first, no USER at all."""
    roles = draw(st.lists(st.sampled_from(list(Role)), max_size=30))
    call_ids = st.sampled_from(["call_1", "call_2", "call_3"])
    history = []
    for index, role in enumerate(roles):
        content = f"{role.value}-{index}"
        if role is Role.MODEL and draw(st.booleans()):
            history.append(model(content, ToolCall(draw(call_ids), "lookup")))
        elif role is Role.TOOL:
            history.append(tool_result(draw(call_ids), content))
        else:
            history.append(Message(role=role, content=content))
    return history


@st.composite
def well_formed_history(draw: st.DrawFn) -> list[Message]:
    """Turns of USER, then MODEL-with-tool-calls each followed by its results, then a final MODEL.

    SYSTEM messages are then inserted anywhere, even between a call and its results.
    """
    dialogue: list[Message] = []
    calls = 0
    for turn in range(draw(st.integers(0, 8))):
        dialogue.append(user(f"user-{turn}"))
        for _ in range(draw(st.integers(0, 3))):
            ids = [f"call_{calls + k + 1}" for k in range(draw(st.integers(1, 3)))]
            calls += len(ids)
            dialogue.append(model(None, *(ToolCall(i, "lookup") for i in ids)))
            dialogue.extend(tool_result(i) for i in ids)
        dialogue.append(model(f"answer-{turn}"))
    places = draw(st.lists(st.integers(0, len(dialogue)), max_size=4))
    for n, place in enumerate(sorted(places, reverse=True)):
        dialogue.insert(place, system(f"system-{n}"))
    return dialogue


def max_turns_for(history: Sequence[Message]) -> st.SearchStrategy[int]:
    users = sum(m.role is Role.USER for m in history)
    return st.integers(1, users + 3)


def check_invariants(history: list[Message], max_turns: int) -> list[Message]:
    kept = pruned(history, max_turns)
    systems = [m for m in history if m.role is Role.SYSTEM]
    dialogue = [m for m in history if m.role is not Role.SYSTEM]
    kept_dialogue = kept[len(systems) :]

    # (1) every SYSTEM message, in its original order, at the front
    assert same(kept[: len(systems)], systems)
    assert all(m.role is not Role.SYSTEM for m in kept_dialogue)
    # (2) the rest is a suffix of the original non-system messages
    assert same(kept_dialogue, dialogue[len(dialogue) - len(kept_dialogue) :])
    # (3) it is empty or opens with a USER message (never with a MODEL or TOOL message)
    assert not kept_dialogue or kept_dialogue[0].role is Role.USER
    # (4) exactly the newest min(max_turns, turns) turns
    users = sum(m.role is Role.USER for m in dialogue)
    assert sum(m.role is Role.USER for m in kept_dialogue) == min(max_turns, users)
    # never reorders: the kept messages appear in the original in the same relative order, or are
    # system messages moved (in order) to the front
    positions = [next(i for i, m in enumerate(history) if m is k) for k in kept_dialogue]
    assert positions == sorted(positions)
    # idempotent
    assert same(pruned(kept, max_turns), kept)
    return kept


@FAST
@given(st.data())
def test_pruning_invariants_on_arbitrary_histories(data: st.DataObject) -> None:
    history = data.draw(any_history())
    max_turns = data.draw(max_turns_for(history))
    check_invariants(history, max_turns)


@FAST
@given(st.data())
def test_pruning_keeps_tool_results_with_their_calls_on_well_formed_histories(data: st.DataObject) -> None:
    history = data.draw(well_formed_history())
    max_turns = data.draw(max_turns_for(history))
    kept = check_invariants(history, max_turns)
    for index, message in enumerate(kept):
        if message.role is Role.TOOL:
            earlier_calls = {c.id for m in kept[:index] if m.role is Role.MODEL for c in m.tool_calls}
            assert message.tool_call_id in earlier_calls
    # well-formed input stays well-formed: every kept turn still ends with the model's answer
    if kept and kept[-1].role is not Role.SYSTEM:
        assert kept[-1].role is Role.MODEL
        assert not kept[-1].tool_calls


@FAST
@given(any_history(), st.integers(1, 50))
def test_pruning_with_a_large_enough_limit_only_drops_the_leading_orphans(
    history: list[Message], extra: int
) -> None:
    users = sum(m.role is Role.USER for m in history)
    kept = pruned(history, users + extra)
    dialogue = [m for m in history if m.role is not Role.SYSTEM]
    first_user = next((i for i, m in enumerate(dialogue) if m.role is Role.USER), len(dialogue))
    assert same(kept, [m for m in history if m.role is Role.SYSTEM] + dialogue[first_user:])


# --- titles -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("Where is my order?", "Where is my order?"),
        ("   padded   ", "padded"),
        ("line one\nline two\r\nline three", "line one line two line three"),
        ("\n\n  leading newlines\n", "leading newlines"),
        ("tabs\tand  double  spaces", "tabs and double spaces"),
        ("x" * 30, "x" * 30),
        ("x" * 31, "x" * 30 + "..."),
        ("Ünïcödé çhäràctérs ☕ ok", "Ünïcödé çhäràctérs ☕ ok"),
        ("é" * 30, "é" * 30),
        ("é" * 31, "é" * 30 + "..."),
        ("日本語のメッセージ" * 4, ("日本語のメッセージ" * 4)[:30] + "..."),
        ("I want a refund for order 1002, it arrived broken", "I want a refund for order 1002..."),
    ],
)
def test_make_title(text: str, title: str) -> None:
    assert make_title(text) == title


def test_make_title_collapses_newlines_before_counting() -> None:
    # 29 + 1 + 1 = 31 characters: one over the limit
    assert make_title("a" * 29 + "\n" + "b") == "a" * 29 + " " + "..."
    # 28 + 1 + 1 = 30 characters: exactly the limit
    assert make_title("a" * 28 + "\n\n\n" + "b") == "a" * 28 + " b"


@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n", None])
def test_make_title_falls_back_to_the_default(text: str | None) -> None:
    assert make_title(text) == DEFAULT_TITLE == "New conversation"
    assert make_title(text, default="Chat") == "Chat"


def test_make_title_default_is_only_for_empty_text() -> None:
    assert make_title("hi", default="Chat") == "hi"


@FAST
@given(st.text())
def test_make_title_properties(text: str) -> None:
    title = make_title(text)
    words = " ".join(text.split())
    if not words:
        assert title == DEFAULT_TITLE
    elif len(words) <= 30:
        assert title == words
    else:
        assert title == words[:30] + "..."
    assert "\n" not in title
    assert title == title.strip() or title.endswith("...")


# --- messages as JSON ------------------------------------------------------------------------------------


def roundtrip(message: Message) -> Message:
    return Message.from_dict(json.loads(json.dumps(message.to_dict())))


def test_message_to_dict_shape() -> None:
    created = datetime(2024, 5, 17, 9, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    call = ToolCall("call_1", "check_order_status", {"order_id": 1001, "nested": {"a": [1, None]}})
    message = Message(
        role=Role.MODEL, content=None, tool_calls=[call], agent_name="Support", created_at=created
    )
    assert message.to_dict() == {
        "role": "model",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "name": "check_order_status",
                "arguments": {"order_id": 1001, "nested": {"a": [1, None]}},
            }
        ],
        "tool_call_id": None,
        "name": None,
        "agent_name": "Support",
        "created_at": "2024-05-17T09:30:00.123456+02:00",
    }
    back = roundtrip(message)
    assert back == message
    assert back.content is None
    assert back.tool_calls == [call]
    assert back.created_at.utcoffset() == timedelta(hours=2)


def test_a_tool_message_round_trips() -> None:
    message = Message(
        role=Role.TOOL, content='{"found": true}', tool_call_id="call_7", name="lookup", agent_name="Billing"
    )
    back = roundtrip(message)
    assert back == message
    assert (back.role, back.tool_call_id, back.name) == (Role.TOOL, "call_7", "lookup")


def test_the_stored_position_is_not_part_of_the_json() -> None:
    message = Message(role=Role.USER, content="hi", position=3)
    assert "position" not in message.to_dict()
    assert roundtrip(message).position is None


def test_a_naive_created_at_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        Message(role=Role.USER, content="hi", created_at=datetime(2024, 1, 1, 12, 0))  # noqa: DTZ001
    data = Message(role=Role.USER, content="hi").to_dict()
    data["created_at"] = "2024-01-01T12:00:00"
    with pytest.raises(ValueError, match="timezone-aware"):
        Message.from_dict(data)


def test_from_dict_fills_in_what_is_missing() -> None:
    before = datetime.now(UTC)
    message = Message.from_dict({"role": "user"})
    assert message.role is Role.USER
    assert message.content is None
    assert message.tool_calls == []
    assert message.created_at.tzinfo is not None
    assert before <= message.created_at <= datetime.now(UTC)


def test_roles_are_coerced_and_checked() -> None:
    assert Message(role="tool", content="x").role is Role.TOOL  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="assistant"):
        Message.from_dict({"role": "assistant", "content": "x"})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
tool_calls = st.builds(
    ToolCall,
    id=st.text(min_size=1, max_size=12),
    name=st.from_regex(r"[a-z_]{1,20}", fullmatch=True),
    arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)
# Whole-second UTC offsets, as real time zones have (CPython 3.11 cannot parse sub-second ones back).
fixed_offsets = st.integers(-86399, 86399).map(lambda seconds: timezone(timedelta(seconds=seconds)))
messages = st.builds(
    Message,
    role=st.sampled_from(list(Role)),
    content=st.none() | st.text(),
    tool_calls=st.lists(tool_calls, max_size=3),
    tool_call_id=st.none() | st.text(max_size=12),
    name=st.none() | st.text(max_size=12),
    agent_name=st.none() | st.text(max_size=12),
    created_at=st.datetimes(timezones=st.just(UTC) | fixed_offsets),
)


@FAST
@given(messages)
def test_messages_round_trip_through_json(message: Message) -> None:
    back = roundtrip(message)
    assert back == message
    assert back.to_dict() == message.to_dict()
    assert back.created_at.utcoffset() == message.created_at.utcoffset()
    assert all(isinstance(call, ToolCall) for call in back.tool_calls)


def test_rollback_to_a_history_length_as_chatflow_agent_does() -> None:
    session = SessionContext("s", Agent("A", "a"))
    session.history.append(Message(Role.USER, "one"))
    length = len(session.history)
    session.history.append(Message(Role.MODEL, "two"))
    session.rollback_to(length)
    assert [m.content for m in session.history] == ["one"]
    with pytest.raises(ValueError, match="negative"):
        session.rollback_to(-1)
