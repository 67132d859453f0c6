"""Agent: construction, instructions, handoff tools and the tool list a model sees."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest

from gateway.agents import Agent, ScriptedModel, Tool, tool
from gateway.agents.agent import handoff_tool_name, snake_case


def _noop(**kwargs: Any) -> None:
    return None


def make_tool(name: str) -> Tool:
    return Tool(name, f"The {name} tool.", {"type": "object", "properties": {}}, _noop)


@tool
def lookup(order_id: int) -> str:
    """Look an order up."""
    return str(order_id)


# --- construction -----------------------------------------------------------------------------------


def test_positional_arguments_in_order() -> None:
    model = ScriptedModel()
    billing = Agent("Billing")
    agent = Agent("Support", "Be helpful.", model, [lookup], [billing])
    assert agent.name == "Support"
    assert agent.instructions == "Be helpful."
    assert agent.model is model
    assert agent.tools == [lookup]
    assert agent.handoffs == [billing]


def test_defaults() -> None:
    agent = Agent("Support")
    assert agent.instructions == ""
    assert agent.render_instructions() == ""
    assert agent.model is None
    assert agent.tools == []
    assert agent.handoffs == []
    assert agent.all_tools() == []
    assert agent.handoff_targets() == {}


def test_a_model_spec_string_is_kept_as_given() -> None:
    assert Agent("Support", model="openai:gpt-4o-mini").model == "openai:gpt-4o-mini"


def test_tools_and_handoffs_may_be_any_iterable_and_are_copied() -> None:
    tools = [lookup]
    agent = Agent("Support", tools=iter(tools), handoffs=(a for a in [Agent("Billing")]))
    assert agent.tools == [lookup]
    assert [a.name for a in agent.handoffs] == ["Billing"]
    tools.append(make_tool("other"))
    assert agent.tools == [lookup]


@pytest.mark.parametrize("keyword", ["tool", "handoff", "description", "max_turns"])
def test_an_unknown_keyword_is_a_type_error(keyword: str) -> None:
    with pytest.raises(TypeError, match=keyword):
        Agent("Support", **{keyword: None})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "   ", "\n"])
def test_an_agent_needs_a_name(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        Agent(name)


@pytest.mark.parametrize("instructions", [None, 42, b"bytes", ["a list"]])
def test_instructions_must_be_a_string_or_a_callable(instructions: Any) -> None:
    with pytest.raises(TypeError, match="instructions"):
        Agent("Support", instructions=instructions)


def test_repr_names_tools_and_handoffs() -> None:
    agent = Agent("Support", tools=[lookup], handoffs=[Agent("Billing")])
    assert repr(agent) == "Agent(name='Support', tools=['lookup'], handoffs=['Billing'])"


# --- instructions ------------------------------------------------------------------------------------


def test_string_instructions_render_as_they_are() -> None:
    assert Agent("Support", "  Be brief.\n").render_instructions() == "  Be brief.\n"


def test_callable_instructions_are_rendered_each_time() -> None:
    calls: list[int] = []

    def instructions() -> str:
        calls.append(1)
        return f"Call number {len(calls)}."

    agent = Agent("Support", instructions)
    assert calls == []  # not at construction
    assert agent.render_instructions() == "Call number 1."
    assert agent.render_instructions() == "Call number 2."
    assert len(calls) == 2


def test_callable_instructions_must_return_a_string() -> None:
    agent = Agent("Support", lambda: 42)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="'Support' must return a string"):
        agent.render_instructions()


async def _async_instructions() -> str:
    return "async"


def test_async_instructions_are_refused() -> None:
    agent = Agent("Support", _async_instructions)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="must return a string"):
            agent.render_instructions()
        gc.collect()


def test_async_instructions_are_refused_without_leaking_a_coroutine() -> None:
    agent = Agent("Support", _async_instructions)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError):
            agent.render_instructions()
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


# --- handoff tools ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent_name", "tool_name"),
    [
        ("Billing Agent", "transfer_to_billing_agent"),
        ("BillingAgent", "transfer_to_billing_agent"),
        ("billing-agent", "transfer_to_billing_agent"),
        ("billing_agent", "transfer_to_billing_agent"),
        ("  Billing   Agent  ", "transfer_to_billing_agent"),
        ("Billing", "transfer_to_billing"),
        ("Tier 2 Support", "transfer_to_tier_2_support"),
        ("Agent2Go", "transfer_to_agent2_go"),
        ("Billing & Refunds!", "transfer_to_billing_refunds"),
    ],
)
def test_handoff_tool_names_are_snake_case(agent_name: str, tool_name: str) -> None:
    assert handoff_tool_name(agent_name) == tool_name
    assert snake_case(agent_name) == tool_name.removeprefix("transfer_to_")
    agent = Agent("Front desk", handoffs=[Agent(agent_name)])
    assert [t.name for t in agent.all_tools()] == [tool_name]


def test_all_tools_lists_own_tools_first_then_one_handoff_tool_per_target_in_order() -> None:
    billing = Agent("Billing Agent", instructions="Handles refunds.\nAnd invoices.")
    sales = Agent("Sales")
    agent = Agent("Support", tools=[lookup, make_tool("search")], handoffs=[billing, sales])
    tools = agent.all_tools()
    assert [t.name for t in tools] == ["lookup", "search", "transfer_to_billing_agent", "transfer_to_sales"]
    assert tools[0] is lookup
    transfer = tools[2]
    assert isinstance(transfer, Tool)
    assert transfer.description == "Hand the conversation over to Billing Agent. Handles refunds."
    assert tools[3].description == "Hand the conversation over to Sales."
    assert transfer.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert transfer.openai_schema()["function"]["name"] == "transfer_to_billing_agent"


def test_handoff_targets_map_tool_names_to_agents() -> None:
    billing, sales = Agent("Billing Agent"), Agent("Sales")
    agent = Agent("Support", handoffs=[billing, sales])
    assert agent.handoff_targets() == {"transfer_to_billing_agent": billing, "transfer_to_sales": sales}


def test_handoffs_added_later_are_offered() -> None:
    support = Agent("Support")
    billing = Agent("Billing", handoffs=[support])
    support.handoffs.append(billing)  # a cycle, as the demo builds it
    assert [t.name for t in support.all_tools()] == ["transfer_to_billing"]
    assert [t.name for t in billing.all_tools()] == ["transfer_to_support"]


def test_all_tools_is_a_fresh_list() -> None:
    agent = Agent("Support", tools=[lookup])
    agent.all_tools().append(make_tool("sneaky"))
    assert [t.name for t in agent.all_tools()] == ["lookup"]


async def test_handoff_tools_do_nothing_when_invoked() -> None:
    transfer = Agent("Support", handoffs=[Agent("Billing")]).all_tools()[0]
    assert await transfer.invoke({}) is None


# --- duplicate tool names ------------------------------------------------------------------------------


def test_two_tools_with_the_same_name_are_refused() -> None:
    with pytest.raises(ValueError, match="same name"):
        Agent("Support", tools=[make_tool("lookup"), make_tool("search"), make_tool("lookup")])


def test_an_own_tool_may_not_share_a_name_with_a_handoff_tool() -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - any wording will do
        Agent("Support", tools=[make_tool("transfer_to_billing")], handoffs=[Agent("Billing")])


def test_two_handoffs_may_not_share_a_tool_name() -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - any wording will do
        Agent("Support", handoffs=[Agent("Billing Agent"), Agent("billing-agent")])


def test_a_name_without_ascii_letters_still_gets_a_distinct_handoff_tool() -> None:
    from gateway.agents.agent import handoff_tool_name

    first, second = handoff_tool_name("客服"), handoff_tool_name("財務")
    assert first.startswith("transfer_to_agent_")
    assert first != second
    assert first == handoff_tool_name("客服")
