"""The demo support desk (gateway.demo:agent) end to end through the Runner and the in-memory store."""

from __future__ import annotations

import importlib
import json

import pytest

from gateway import demo
from gateway.agents import Runner, RunResult, SessionStore
from gateway.domain.messages import Message, Role

SHIPPED_1001 = "Order 1001 is shipped: it left our warehouse yesterday; tracking number TRK-55821."
REFUND_1002 = "Refund RF-1002 is open for order 1002; the money is back on your card in 3-5 business days."


@pytest.fixture
def store() -> SessionStore:
    return SessionStore()


@pytest.fixture
def runner(store: SessionStore) -> Runner:
    return Runner(demo.agent, store)


def kinds(result: RunResult) -> list[tuple[Role, str | None]]:
    """Each new message as (role, what it is): text for USER/MODEL replies, the tool for calls/results."""
    shown: list[tuple[Role, str | None]] = []
    for message in result.new_messages:
        if message.tool_calls:
            shown.extend((Role.MODEL, f"call {c.name}") for c in message.tool_calls)
        elif message.role is Role.TOOL:
            shown.append((Role.TOOL, f"result {message.name}"))
        else:
            shown.append((message.role, message.agent_name))
    return shown


def tool_result(result: RunResult, name: str) -> Message:
    (message,) = [m for m in result.new_messages if m.role is Role.TOOL and m.name == name]
    return message


def assert_well_formed(history: list[Message]) -> None:
    """Every TOOL message answers a call made earlier by a MODEL message; call ids are unique."""
    calls = [c.id for m in history if m.role is Role.MODEL for c in m.tool_calls]
    assert len(calls) == len(set(calls))
    for index, message in enumerate(history):
        if message.role is Role.TOOL:
            earlier = {c.id: c.name for m in history[:index] for c in m.tool_calls}
            assert earlier.get(message.tool_call_id or "") == message.name


# --- the agents -----------------------------------------------------------------------------------------


def test_the_configured_spec_names_the_support_agent() -> None:
    module_name, _, attribute = "gateway.demo:agent".partition(":")
    agent = getattr(importlib.import_module(module_name), attribute)
    assert agent is demo.agent
    assert agent.name == "Support"
    assert [t.name for t in agent.all_tools()] == ["check_order_status", "transfer_to_billing"]
    assert [t.name for t in demo.billing.all_tools()] == ["request_refund", "transfer_to_support"]


def test_the_tools_on_their_own() -> None:
    assert demo.check_order_status(1003) == {
        "found": True,
        "status": "delivered",
        "summary": "Order 1003 is delivered: it was delivered on Monday and signed for at the front door.",
    }
    assert demo.check_order_status(5)["found"] is False
    assert demo.request_refund(1001)["refund_id"] == "RF-1001"
    assert demo.request_refund(1004)["refund_id"] is None
    assert demo.request_refund(77)["refund_id"] is None


# --- single turns ---------------------------------------------------------------------------------------


async def test_greeting(runner: Runner) -> None:
    result = await runner.run_async("s", "Hi there!")
    assert result.agent_name == "Support"
    assert result.content.startswith("Hi! I'm the Acme support assistant.")
    assert "order number" in result.content
    assert kinds(result) == [(Role.USER, None), (Role.MODEL, "Support")]
    assert result.session_id == "s"


async def test_where_is_my_order_asks_for_the_number(runner: Runner) -> None:
    result = await runner.run_async("s", "Where is my order?")
    assert result.agent_name == "Support"
    assert "What's your order number?" in result.content
    assert all(not m.tool_calls for m in result.new_messages)


@pytest.mark.parametrize(
    ("text", "order_id", "answer"),
    [
        ("order 1001", 1001, SHIPPED_1001),
        ("What's the status of order #1002?", 1002, "Order 1002 is processing: it is being packed"),
        ("order number 1003", 1003, "Order 1003 is delivered: it was delivered on Monday"),
        ("1004", 1004, "Order 1004 is cancelled: it was cancelled at your request"),
        ("#1001", 1001, SHIPPED_1001),
    ],
)
async def test_an_order_number_is_looked_up(runner: Runner, text: str, order_id: int, answer: str) -> None:
    result = await runner.run_async("s", text)
    assert result.agent_name == "Support"
    assert result.content.startswith(answer)
    assert kinds(result) == [
        (Role.USER, None),
        (Role.MODEL, "call check_order_status"),
        (Role.TOOL, "result check_order_status"),
        (Role.MODEL, "Support"),
    ]
    call = result.new_messages[1].tool_calls[0]
    assert call.arguments == {"order_id": str(order_id)}
    answer_message = tool_result(result, "check_order_status")
    assert answer_message.tool_call_id == call.id
    assert json.loads(answer_message.content or "")["found"] is True


async def test_an_unknown_order_is_answered_politely(runner: Runner) -> None:
    result = await runner.run_async("s", "Can you check order 9999?")
    assert result.agent_name == "Support"
    assert result.content == "I couldn't find order 9999. Could you double-check the number?"
    assert json.loads(tool_result(result, "check_order_status").content or "") == {
        "found": False,
        "summary": result.content,
    }


async def test_a_refund_is_handed_to_billing_and_opened_in_the_same_turn(
    runner: Runner, store: SessionStore
) -> None:
    result = await runner.run_async("s", "I want a refund for order 1002")
    assert result.agent_name == "Billing"
    assert result.content == REFUND_1002
    assert kinds(result) == [
        (Role.USER, None),
        (Role.MODEL, "call transfer_to_billing"),
        (Role.TOOL, "result transfer_to_billing"),
        (Role.MODEL, "call request_refund"),
        (Role.TOOL, "result request_refund"),
        (Role.MODEL, "Billing"),
    ]
    user, transfer, transferred, refund_call, refund_result, reply = result.new_messages
    assert user.content == "I want a refund for order 1002"
    assert transfer.agent_name == "Support"
    assert transferred.tool_call_id == transfer.tool_calls[0].id
    assert transferred.content == "Transferred to Billing."
    assert refund_call.agent_name == "Billing"
    assert refund_call.tool_calls[0].arguments == {"order_id": "1002"}
    assert refund_result.tool_call_id == refund_call.tool_calls[0].id
    assert json.loads(refund_result.content or "")["refund_id"] == "RF-1002"
    assert reply.agent_name == "Billing"

    session = await store.get("s")
    assert session is not None
    assert session.active_agent is demo.billing
    assert_well_formed(session.history)


async def test_a_refund_for_a_cancelled_order_is_not_opened_twice(runner: Runner) -> None:
    result = await runner.run_async("s", "Can I get my money back for order 1004?")
    assert result.agent_name == "Billing"
    assert result.content == "Order 1004 was already cancelled and refunded in full."


async def test_billing_asks_for_the_number_then_refunds(runner: Runner) -> None:
    first = await runner.run_async("s", "I'd like a refund")
    assert first.agent_name == "Billing"
    assert first.content == "I can open a refund for you. What's the order number?"
    second = await runner.run_async("s", "1001")
    assert second.agent_name == "Billing"
    assert second.content.startswith("Refund RF-1001 is open for order 1001")
    assert [c.name for m in second.new_messages for c in m.tool_calls] == ["request_refund"]


async def test_billing_hands_order_tracking_back_to_support(runner: Runner, store: SessionStore) -> None:
    await runner.run_async("s", "I want a refund for order 1002")
    result = await runner.run_async("s", "Thanks. And where is my order 1001?")
    # "thanks" is Billing's rule too, but tracking comes first in its rules
    assert result.agent_name == "Support"
    assert result.content == SHIPPED_1001
    assert [c.name for m in result.new_messages for c in m.tool_calls] == [
        "transfer_to_support",
        "check_order_status",
    ]
    session = await store.get("s")
    assert session is not None
    assert session.active_agent is demo.agent


async def test_billing_hands_a_tracking_question_without_number_back(runner: Runner) -> None:
    await runner.run_async("s", "I have a question about an invoice")
    result = await runner.run_async("s", "Where is my order?")
    assert result.agent_name == "Support"
    assert "What's your order number?" in result.content


async def test_no_ping_pong_when_both_agents_would_hand_off(runner: Runner) -> None:
    # Support hands "billing" to Billing; Billing would hand "status" back, but not within the turn.
    result = await runner.run_async("s", "what is my billing status")
    assert result.agent_name == "Billing"
    assert result.content == demo.billing_model.fallback
    assert [c.name for m in result.new_messages for c in m.tool_calls] == ["transfer_to_billing"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("thank you!", "You're welcome! Anything else I can help with?"),
        ("ok bye", "Thanks for contacting Acme. Have a great day!"),
        ("Can I talk to a human?", "I'll pass this to our team"),
        ("What are your opening hours?", "Our team is available Monday to Friday"),
        ("blah", "I'm the Acme support assistant. I can check your order status"),
    ],
)
async def test_support_small_talk(runner: Runner, text: str, answer: str) -> None:
    result = await runner.run_async("s", text)
    assert result.agent_name == "Support"
    assert result.content.startswith(answer)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("thanks", "Happy to help! Anything else about billing?"),
        ("bye", "Thanks for contacting Acme billing. Have a great day!"),
        ("I need a receipt", "Invoices are in your account"),
        ("I was charged twice", "Sorry about that! Charges can take up to 3 days"),
    ],
)
async def test_billing_small_talk(runner: Runner, text: str, answer: str) -> None:
    await runner.run_async("s", "question about my payment")
    result = await runner.run_async("s", text)
    assert result.agent_name == "Billing"
    assert result.content.startswith(answer)
    assert all(not m.tool_calls for m in result.new_messages)


# --- a whole conversation -------------------------------------------------------------------------------


async def test_a_whole_support_conversation(runner: Runner, store: SessionStore) -> None:
    script = [
        ("Hello!", "Support", "Hi! I'm the Acme support assistant."),
        ("Where is my order?", "Support", "Sure, I can check that. What's your order number?"),
        ("1001", "Support", SHIPPED_1001),
        ("and order 4242?", "Support", "I couldn't find order 4242."),
        ("I want a refund for order 1002", "Billing", REFUND_1002),
        ("where is order 1003 now?", "Support", "Order 1003 is delivered"),
        ("thanks!", "Support", "You're welcome!"),
        ("bye", "Support", "Thanks for contacting Acme. Have a great day!"),
    ]
    for text, agent_name, answer in script:
        result = await runner.run_async("conv", text)
        assert (result.agent_name, result.content[: len(answer)]) == (agent_name, answer), text
        assert result.new_messages[0].content == text
        assert result.new_messages[-1].content == result.content

    session = await store.get("conv")
    assert session is not None
    assert session.title == "Hello!"
    assert [m.content for m in session.history if m.role is Role.USER] == [text for text, _, _ in script]
    assert_well_formed(session.history)
    calls = [c.name for m in session.history for c in m.tool_calls]
    assert calls == [
        "check_order_status",
        "check_order_status",
        "transfer_to_billing",
        "request_refund",
        "transfer_to_support",
        "check_order_status",
    ]
    # Every turn ends with a plain answer from the agent in charge at the time.
    assert session.history[-1].role is Role.MODEL
    assert session.history[-1].agent_name == "Support"


async def test_sessions_are_independent(runner: Runner) -> None:
    await runner.run_async("a", "I want a refund for order 1002")
    result = await runner.run_async("b", "thanks")
    assert result.agent_name == "Support"
    assert (await runner.run_async("a", "thanks")).agent_name == "Billing"


@pytest.mark.parametrize(
    "text",
    [
        "order" + " " * 20_000 + "x",
        "refund " * 3_000 + "x",
        "refund order " * 1_500,
        "money back " * 2_000 + "no" + " " * 5_000,
        "#" * 20_000,
    ],
    ids=["order-spaces", "refunds", "refund-orders", "money-back", "hashes"],
)
async def test_long_crafted_messages_do_not_block_the_event_loop(runner: Runner, text: str) -> None:
    """The finding: a 20,000-character "order" + spaces message blocked the event loop (and /healthz)
    for 3.1 s: the rules' patterns backtracked quadratically. This guards their complexity, not their
    speed: linear patterns take milliseconds here, the quadratic ones took seconds to tens of seconds."""
    import time

    started = time.process_time()
    await runner.run_async("dos", text)
    await runner.run_async("dos-billing", "I want a refund")  # the Billing agent's rules too
    await runner.run_async("dos-billing", text)
    assert time.process_time() - started < 1.0
