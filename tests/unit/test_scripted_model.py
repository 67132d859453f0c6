"""ScriptedModel: deterministic rules, tool calls from regex groups, handoffs, composed replies."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agents import Agent, Rule, Runner, ScriptedModel, SessionStore, Tool, tool
from gateway.agents.models.scripted import DEFAULT_FALLBACK, MAX_SCAN_CHARS
from gateway.domain.messages import Message, Role, ToolCall

FAST = settings(max_examples=200, deadline=None, database=None)


def _noop(**kwargs: Any) -> None:
    return None


def make_tool(name: str) -> Tool:
    return Tool(name, f"The {name} tool.", {"type": "object", "properties": {}}, _noop)


LOOKUP = make_tool("lookup")
AGENT = Agent(name="Support")


def user(text: str) -> Message:
    return Message(role=Role.USER, content=text)


def call_message(*calls: ToolCall) -> Message:
    return Message(role=Role.MODEL, content=None, tool_calls=list(calls))


def result(call: ToolCall, content: str) -> Message:
    return Message(role=Role.TOOL, content=content, tool_call_id=call.id, name=call.name)


async def respond(
    model: ScriptedModel,
    history: Sequence[Message] | str,
    tools: Sequence[Tool] = (),
    agent: Agent = AGENT,
) -> Message:
    messages = [user(history)] if isinstance(history, str) else list(history)
    return await model.respond(agent, messages, list(tools))


def shape(message: Message) -> tuple[Any, ...]:
    """What a reply says, without its creation time."""
    return (message.role, message.content, message.tool_calls, message.tool_call_id, message.agent_name)


# --- rules ---------------------------------------------------------------------------------------


def test_a_rule_calls_a_tool_or_hands_off_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        Rule("x", tool="lookup", handoff="Billing")


def test_a_rule_needs_something_to_do() -> None:
    with pytest.raises(ValueError, match="needs"):
        Rule("x")


def test_a_rule_with_a_bad_pattern_fails_at_once() -> None:
    with pytest.raises(re.error):
        Rule("(unclosed", reply="x")


async def test_the_first_matching_rule_wins() -> None:
    model = ScriptedModel(
        rules=[
            Rule(r"\bnothing\b", reply="none"),
            Rule("order", reply="first"),
            Rule("order 1", reply="second"),
        ]
    )
    reply = await respond(model, "about order 1")
    assert reply.role is Role.MODEL
    assert reply.content == "first"
    assert reply.tool_calls == []
    assert reply.agent_name == "Support"


async def test_patterns_are_searched_case_insensitively_across_lines() -> None:
    model = ScriptedModel(rules=[Rule(r"hello.*world", reply="matched")])
    assert (await respond(model, "well, HELLO\nbig World!")).content == "matched"


async def test_rules_read_only_the_first_characters_of_a_message() -> None:
    """However linear a rule's pattern, a long crafted message costs at most MAX_SCAN_CHARS of scanning."""
    model = ScriptedModel(rules=[Rule("order", reply="found")], fallback="pardon?")
    assert (await respond(model, " " * (MAX_SCAN_CHARS - 5) + "order")).content == "found"
    assert (await respond(model, " " * (MAX_SCAN_CHARS - 4) + "order")).content == "pardon?"


async def test_only_the_last_user_message_is_read() -> None:
    model = ScriptedModel(rules=[Rule("hello", reply="hi")], fallback="pardon?")
    history = [user("hello"), Message(role=Role.MODEL, content="hi"), user("something else")]
    assert (await respond(model, history)).content == "pardon?"


async def test_reply_templates_use_named_and_positional_groups() -> None:
    model = ScriptedModel(
        rules=[
            Rule(r"my name is (?P<name>\w+)", reply="Nice to meet you, {name}!"),
            Rule(r"(\w+) or (\w+)\?", reply="I'd pick {1} over {0}."),
            Rule(r"colou?r(?P<plural>s)? (?P<which>\w+)", reply="[{plural}] {which}"),
        ]
    )
    assert (await respond(model, "Hi, my name is Ada")).content == "Nice to meet you, Ada!"
    assert (await respond(model, "tea or coffee?")).content == "I'd pick coffee over tea."
    # A group that took no part in the match fills in as an empty string.
    assert (await respond(model, "color red")).content == "[] red"


async def test_a_template_that_does_not_fit_the_match_is_used_as_it_is() -> None:
    model = ScriptedModel(rules=[Rule(r"x", reply="{missing} and {0}")])
    assert (await respond(model, "x")).content == "{missing} and {0}"


async def test_fallback_when_nothing_matches() -> None:
    assert (await respond(ScriptedModel(rules=[Rule("a", reply="b")]), "zzz")).content == DEFAULT_FALLBACK
    model = ScriptedModel(rules=[Rule("a", reply="b")], fallback="Sorry?")
    reply = await respond(model, "zzz")
    assert (reply.content, reply.tool_calls, reply.agent_name) == ("Sorry?", [], "Support")


async def test_no_history_at_all_gets_the_fallback() -> None:
    assert (await respond(ScriptedModel(rules=[Rule("x", reply="y")]), [])).content == DEFAULT_FALLBACK


@pytest.mark.parametrize(
    ("text", "reply"),
    [
        ("hello", "Hello! How can I help you today?"),
        ("Hey there", "Hello! How can I help you today?"),
        ("Good morning!", "Hello! How can I help you today?"),
        ("thanks a lot", "You're welcome! Anything else I can do?"),
        ("Thank you", "You're welcome! Anything else I can do?"),
        ("ok bye", "Goodbye, and have a nice day!"),
        ("see you", "Goodbye, and have a nice day!"),
        ("what is the meaning of life", DEFAULT_FALLBACK),
        ("this is odd", DEFAULT_FALLBACK),  # a greeting only at the start, as a whole word
    ],
)
async def test_a_model_without_rules_makes_small_talk(text: str, reply: str) -> None:
    assert (await respond(ScriptedModel(), text)).content == reply


async def test_an_empty_rule_list_is_not_the_generic_one() -> None:
    assert (await respond(ScriptedModel(rules=[]), "hello")).content == DEFAULT_FALLBACK


# --- tool calls -----------------------------------------------------------------------------------


async def test_a_tool_rule_calls_the_tool_with_the_named_groups_as_arguments() -> None:
    model = ScriptedModel(
        rules=[Rule(r"order (?P<order_id>\d+)(?: for (?P<reason>\w+))?", tool="lookup", reply="x")]
    )
    reply = await respond(model, "check order 1001 please", [LOOKUP])
    assert reply.role is Role.MODEL
    assert reply.content is None
    assert reply.agent_name == "Support"
    # `reason` did not take part in the match, so it is not sent.
    assert reply.tool_calls == [ToolCall("call_1", "lookup", {"order_id": "1001"})]

    reply = await respond(model, "order 7 for damage", [LOOKUP])
    assert reply.tool_calls == [ToolCall("call_1", "lookup", {"order_id": "7", "reason": "damage"})]


async def test_explicit_argument_templates() -> None:
    model = ScriptedModel(
        rules=[
            Rule(
                r"order (?P<order_id>\d+) (\w+)",
                tool="lookup",
                arguments={"order_id": "#{order_id}", "note": "via {1}", "limit": 5, "source": "chat"},
            )
        ]
    )
    reply = await respond(model, "order 42 urgently", [LOOKUP])
    assert reply.tool_calls == [
        ToolCall(
            "call_1", "lookup", {"order_id": "#42", "note": "via urgently", "limit": 5, "source": "chat"}
        )
    ]


async def test_tool_rules_are_skipped_when_the_tool_is_not_offered() -> None:
    model = ScriptedModel(
        rules=[Rule(r"order (?P<order_id>\d+)", tool="lookup"), Rule("order", reply="no tool today")]
    )
    assert (await respond(model, "order 1", [make_tool("other")])).content == "no tool today"
    assert (await respond(model, "order 1", [])).tool_calls == []
    assert (await respond(model, "order 1", [LOOKUP])).tool_calls[0].name == "lookup"


async def test_call_ids_count_the_calls_already_in_the_history() -> None:
    model = ScriptedModel(rules=[Rule(r"order (?P<order_id>\d+)", tool="lookup")])
    first, second = ToolCall("call_1", "lookup", {}), ToolCall("call_2", "lookup", {})
    history = [
        user("order 1"),
        call_message(first, second),
        result(first, "{}"),
        result(second, "{}"),
        Message(role=Role.MODEL, content="done"),
        user("order 2"),
    ]
    reply = await respond(model, history, [LOOKUP])
    assert reply.tool_calls == [ToolCall("call_3", "lookup", {"order_id": "2"})]


# --- composing replies from tool results --------------------------------------------------------------


async def test_after_a_tool_result_the_calling_rule_composes_the_reply() -> None:
    model = ScriptedModel(
        rules=[
            Rule(
                r"weather in (?P<city>\w+)", tool="weather", reply="{city}: {result[sky]}, {result[temp]}°C"
            ),
        ]
    )
    call = ToolCall("call_1", "weather", {"city": "Oslo"})
    history = [user("weather in Oslo?"), call_message(call), result(call, '{"sky": "snow", "temp": -3}')]
    reply = await respond(model, history, [make_tool("weather")])
    assert reply.content == "Oslo: snow, -3°C"
    assert reply.tool_calls == []
    assert reply.agent_name == "Support"


async def test_a_plain_text_result_fills_result() -> None:
    model = ScriptedModel(rules=[Rule(r"time", tool="clock", reply="It is {result}.")])
    call = ToolCall("call_1", "clock")
    reply = await respond(
        model, [user("time?"), call_message(call), result(call, "12:00")], [make_tool("clock")]
    )
    assert reply.content == "It is 12:00."


async def test_a_tool_error_becomes_an_apology() -> None:
    model = ScriptedModel(rules=[Rule(r"order (?P<order_id>\d+)", tool="lookup", reply="{result[summary]}")])
    call = ToolCall("call_1", "lookup", {"order_id": "1"})
    history = [user("order 1"), call_message(call), result(call, "Error: lookup failed: TimeoutError")]
    reply = await respond(model, history, [LOOKUP])
    assert reply.content == "Sorry, I couldn't do that: lookup failed: TimeoutError"
    assert reply.tool_calls == []


async def test_a_result_without_a_template_is_reported_as_found() -> None:
    model = ScriptedModel(rules=[Rule(r"order (?P<order_id>\d+)", tool="lookup")])
    call = ToolCall("call_1", "lookup", {"order_id": "1"})
    reply = await respond(
        model, [user("order 1"), call_message(call), result(call, '{"ok": true}')], [LOOKUP]
    )
    assert reply.content == 'Here is what I found: {"ok": true}'


async def test_several_results_give_one_line_each() -> None:
    model = ScriptedModel(rules=[Rule(r"both", tool="lookup", reply="got {result[n]}")])
    one, two = ToolCall("call_1", "lookup"), ToolCall("call_2", "lookup")
    history = [user("both"), call_message(one, two), result(one, '{"n": 1}'), result(two, "Error: boom")]
    reply = await respond(model, history, [LOOKUP])
    assert reply.content == "got 1\nSorry, I couldn't do that: boom"


async def test_results_from_an_earlier_turn_do_not_compose_a_reply() -> None:
    model = ScriptedModel(rules=[Rule(r"order", tool="lookup", reply="{result}"), Rule("hi", reply="hello")])
    call = ToolCall("call_1", "lookup")
    history = [user("order"), call_message(call), result(call, "old"), user("hi")]
    assert (await respond(model, history, [LOOKUP])).content == "hello"


# --- handoffs ----------------------------------------------------------------------------------------


async def test_a_handoff_rule_calls_the_transfer_tool() -> None:
    billing = Agent(name="Billing Agent")
    support = Agent(name="Support", handoffs=[billing])
    model = ScriptedModel(rules=[Rule("refund", handoff="Billing Agent")])
    reply = await respond(model, "I need a refund", support.all_tools(), support)
    assert reply.content is None
    assert reply.tool_calls == [ToolCall("call_1", "transfer_to_billing_agent", {})]
    assert reply.agent_name == "Support"


async def test_a_handoff_rule_is_skipped_when_the_agent_cannot_hand_off() -> None:
    model = ScriptedModel(rules=[Rule("refund", handoff="Billing"), Rule("refund", reply="I can't, sorry.")])
    assert (await respond(model, "refund", [LOOKUP])).content == "I can't, sorry."


async def test_no_handoff_back_within_the_turn_of_a_handoff() -> None:
    support = Agent(name="Support")
    billing = Agent(name="Billing", handoffs=[support])
    model = ScriptedModel(rules=[Rule("refund", handoff="Support"), Rule("refund", reply="Billing here.")])
    transfer = ToolCall("call_1", "transfer_to_billing")
    turn = [user("refund"), call_message(transfer), result(transfer, "Transferred to Billing.")]
    reply = await respond(model, turn, billing.all_tools(), billing)
    assert reply.content == "Billing here."
    assert reply.tool_calls == []

    # In the next turn the handoff rule applies again.
    later = [*turn, Message(role=Role.MODEL, content="Billing here."), user("refund")]
    reply = await respond(model, later, billing.all_tools(), billing)
    assert reply.tool_calls == [ToolCall("call_2", "transfer_to_support", {})]


async def test_after_a_handoff_the_new_agent_may_still_call_tools_and_compose() -> None:
    support = Agent(name="Support")
    refund = make_tool("refund")
    billing = Agent(name="Billing", tools=[refund], handoffs=[support])
    model = ScriptedModel(
        rules=[Rule(r"refund (?P<order_id>\d+)", tool="refund", reply="Done: {result[id]}")]
    )
    transfer = ToolCall("call_1", "transfer_to_billing")
    turn = [user("refund 12"), call_message(transfer), result(transfer, "Transferred to Billing.")]
    reply = await respond(model, turn, billing.all_tools(), billing)
    assert reply.tool_calls == [ToolCall("call_2", "refund", {"order_id": "12"})]
    call = reply.tool_calls[0]
    reply = await respond(
        model, [*turn, reply, result(call, '{"id": "RF-12"}')], billing.all_tools(), billing
    )
    assert reply.content == "Done: RF-12"


async def test_two_agents_whose_rules_hand_off_to_each_other_do_not_ping_pong() -> None:
    support = Agent(name="Support", model=ScriptedModel(rules=[Rule("money", handoff="Billing")]))
    billing = Agent(
        name="Billing",
        model=ScriptedModel(rules=[Rule("money", handoff="Support")], fallback="Billing fallback"),
        handoffs=[support],
    )
    support.handoffs.append(billing)
    result_ = await Runner(support, SessionStore()).run_async("s", "money money money")
    assert result_.agent_name == "Billing"
    assert result_.content == "Billing fallback"
    transfers = [c.name for m in result_.new_messages for c in m.tool_calls]
    assert transfers == ["transfer_to_billing"]


# --- determinism -----------------------------------------------------------------------------------


@tool
def echo(order_id: str) -> dict[str, str]:
    """Echo an order id."""
    return {"summary": f"order {order_id}"}


RICH = ScriptedModel(
    rules=[
        Rule(r"^\W*(hi|hello)\b", reply="Hello!"),
        Rule(r"refund", handoff="Billing"),
        Rule(r"order (?P<order_id>\d+)", tool="echo", reply="{result[summary]}"),
        Rule(r"(?P<word>\w+)!", reply="{word}?"),
    ]
)


@FAST
@given(
    text=st.text(max_size=40) | st.sampled_from(["hello", "refund", "order 12", "wow!", "order 5 refund"]),
    earlier_calls=st.integers(0, 3),
)
def test_the_same_input_always_gives_the_same_output(text: str, earlier_calls: int) -> None:
    calls = [ToolCall(f"call_{i + 1}", "echo") for i in range(earlier_calls)]
    history = [user("before"), call_message(*calls), user(text)] if calls else [user(text)]
    support = Agent(name="Support", tools=[echo], handoffs=[Agent(name="Billing")])

    async def twice() -> tuple[Message, Message]:
        return (
            await respond(RICH, history, support.all_tools(), support),
            await respond(RICH, list(history), support.all_tools(), support),
        )

    first, second = asyncio.run(twice())
    assert shape(first) == shape(second)
    assert first.role is Role.MODEL
    assert first.agent_name == "Support"
    # Either text or exactly one call, numbered after the calls already made.
    if first.tool_calls:
        assert first.content is None
        assert [c.id for c in first.tool_calls] == [f"call_{earlier_calls + 1}"]
    else:
        assert isinstance(first.content, str)
        assert first.content


async def test_a_turn_through_the_runner_calls_the_tool_and_composes_the_answer() -> None:
    agent = Agent(name="Support", model=RICH, tools=[echo])
    run = await Runner(agent, SessionStore()).run_async("s", "status of order 77")
    assert run.content == "order 77"
    roles = [m.role for m in run.new_messages]
    assert roles == [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]
    call = run.new_messages[1].tool_calls[0]
    assert (call.name, call.arguments) == ("echo", {"order_id": "77"})
    assert run.new_messages[2].tool_call_id == call.id
    assert json.loads(run.new_messages[2].content or "") == {"summary": "order 77"}


async def test_call_ids_stay_unique_after_pruning() -> None:
    store = SessionStore(default_max_turns=2)
    runner = Runner(Agent(name="Support", model=RICH, tools=[echo]), store)
    for order_id in range(10, 14):
        await runner.run_async("s", f"order {order_id}")
    session = await store.get("s")
    assert session is not None
    ids = [c.id for m in session.history for c in m.tool_calls]
    assert len(ids) == 2
    assert len(set(ids)) == len(ids)


async def test_rules_may_be_given_as_dicts_pairs_or_a_mapping() -> None:
    for rules in (
        [{"pattern": r"\bhi\b", "reply": "Hello there"}],
        [(r"\bhi\b", "Hello there")],
        {r"\bhi\b": "Hello there"},
    ):
        runner = Runner(Agent("A", "a", model=ScriptedModel(rules)))
        assert (await runner.run_async("s", "hi!")).content == "Hello there"
    with pytest.raises(TypeError, match="not a rule"):
        ScriptedModel([42])  # type: ignore[list-item]
