"""Function tools: schemas from signatures and docstrings, argument checks, tool calls that never crash."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import UTC, datetime
from typing import Any, Literal, Optional

import pydantic
import pytest
import structlog

from gateway.agents.models.base import ToolSpec
from gateway.agents.tools import Tool, ToolArgumentsError, execute_tool_call, tool
from gateway.domain.messages import Message, Role, ToolCall


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(id="call-1", name=name, arguments=arguments)


async def run(t: Tool, **arguments: Any) -> Message:
    return await execute_tool_call({t.name: t}, call(t.name, **arguments), agent_name="support")


def all_keys(node: Any) -> set[str]:
    """Every key of every mapping in a schema, however deep."""
    if isinstance(node, dict):
        return set(node) | {key for value in node.values() for key in all_keys(value)}
    if isinstance(node, list):
        return {key for item in node for key in all_keys(item)}
    return set()


# --- schemas -------------------------------------------------------------------------------------


def test_schema_covers_every_supported_type() -> None:
    @tool
    def search(  # type: ignore[no-untyped-def]  # `anything` has no hint on purpose
        text: str,
        limit: int,
        ratio: float,
        exact: bool,
        ids: list[int],
        meta: dict,  # type: ignore[type-arg]
        weights: dict[str, float],
        page: int | None,
        cursor: Optional[str],  # noqa: UP045 - the typing spelling must work too
        kind: Literal["order", "refund"],
        anything,
        sort: str = "newest",
        tags: list[str] | None = None,
    ) -> None:
        """Search."""

    assert search.parameters == {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "limit": {"type": "integer"},
            "ratio": {"type": "number"},
            "exact": {"type": "boolean"},
            "ids": {"type": "array", "items": {"type": "integer"}},
            "meta": {"type": "object", "additionalProperties": True},
            "weights": {"type": "object", "additionalProperties": {"type": "number"}},
            "page": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "cursor": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "kind": {"type": "string", "enum": ["order", "refund"]},
            "anything": {},
            "sort": {"type": "string", "default": "newest"},
            "tags": {
                "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                "default": None,
            },
        },
        "required": [
            "text",
            "limit",
            "ratio",
            "exact",
            "ids",
            "meta",
            "weights",
            "page",
            "cursor",
            "kind",
            "anything",
        ],
        "additionalProperties": False,
    }
    assert not all_keys(search.parameters) & {"title", "$defs", "$ref"}


def test_schema_of_a_function_without_parameters_is_an_empty_object() -> None:
    @tool
    def ping() -> str:
        return "pong"

    assert ping.parameters == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }


def test_parameters_named_like_pydantic_or_schema_keywords_are_kept() -> None:
    @tool
    def rename(title: str, json: int = 1, model_config: bool = False) -> None:
        """Rename."""

    assert rename.parameters["properties"] == {
        "title": {"type": "string"},
        "json": {"type": "integer", "default": 1},
        "model_config": {"type": "boolean", "default": False},
    }
    assert rename.parameters["required"] == ["title"]


def test_default_data_that_holds_a_title_key_is_left_alone() -> None:
    @tool
    def styled(options: dict[str, str] = {"title": "bold"}) -> None:  # noqa: B006 - never mutated
        """Styled."""

    assert styled.parameters["properties"]["options"]["default"] == {"title": "bold"}


def test_docstring_gives_the_description_and_each_argument_s_description() -> None:
    @tool
    def check_order_status(order_id: int, verbose: bool = False, note: str = "") -> str:
        """Look up where an order is.

        Use it when the customer asks about delivery.

        Args:
            order_id: The order number,
                as printed on the receipt.
            verbose (bool): Whether to include
                every tracking event
                since dispatch.

        Returns:
            The status, in words.
        """
        return "shipped"

    assert check_order_status.name == "check_order_status"
    assert check_order_status.description == (
        "Look up where an order is.\n\nUse it when the customer asks about delivery."
    )
    properties = check_order_status.parameters["properties"]
    assert properties["order_id"]["description"] == "The order number, as printed on the receipt."
    assert properties["verbose"]["description"] == "Whether to include every tracking event since dispatch."
    assert "description" not in properties["note"]


def test_a_function_without_docstring_has_an_empty_description() -> None:
    @tool
    def bare(x: int) -> int:
        return x

    assert bare.description == ""
    assert "description" not in bare.parameters["properties"]["x"]


def test_decorator_with_arguments_overrides_name_and_description() -> None:
    @tool(name="lookup", description="Find a customer.")
    def find_customer(email: str) -> str:
        """Ignored summary."""
        return email

    assert isinstance(find_customer, Tool)
    assert (find_customer.name, find_customer.description) == ("lookup", "Find a customer.")
    assert find_customer.function.__name__ == "find_customer"


def test_decorator_with_empty_parentheses_and_as_a_function_call() -> None:
    @tool()
    def first() -> int:
        """First."""
        return 1

    def second() -> int:
        return 2

    built = tool(second, name="renamed")
    assert (first.name, first.description) == ("first", "First.")
    assert built.name == "renamed"
    assert built() == 2


def test_async_function_becomes_a_tool_with_the_same_schema_rules() -> None:
    @tool
    async def fetch(url: str, retries: int = 3) -> str:
        """Fetch a page."""
        return url

    assert fetch.description == "Fetch a page."
    assert fetch.parameters["required"] == ["url"]
    assert fetch.parameters["properties"]["retries"] == {"type": "integer", "default": 3}


def test_openai_schema_wraps_name_description_and_parameters() -> None:
    @tool
    def add(a: int, b: int = 0) -> int:
        """Add two numbers."""
        return a + b

    schema = add.openai_schema()
    assert schema == {
        "type": "function",
        "function": {"name": "add", "description": "Add two numbers.", "parameters": add.parameters},
    }
    schema["function"]["parameters"]["required"].append("zzz")
    assert add.parameters["required"] == ["a"]  # the copy handed out cannot change the tool


def test_signature_tool_satisfies_the_model_tool_spec() -> None:
    @tool
    def noop() -> None:
        """Nothing."""

    assert isinstance(noop, ToolSpec)


def args_only(*values: int) -> None:
    """Variadic positional."""


def kwargs_only(**values: int) -> None:
    """Variadic keyword."""


def positional_only(value: int, /) -> None:
    """Positional only."""


@pytest.mark.parametrize("function", [args_only, kwargs_only, positional_only])
def test_parameters_a_model_cannot_pass_by_keyword_are_refused(function: Any) -> None:
    with pytest.raises(TypeError, match="must be passable by keyword"):
        tool(function)


def test_unresolvable_type_hint_is_a_type_error_at_decoration() -> None:
    def broken(x: NoSuchType) -> None:  # type: ignore[name-defined]  # noqa: F821
        """Broken."""

    with pytest.raises(TypeError, match="NoSuchType"):
        tool(broken)


def test_tool_name_must_be_acceptable_to_providers() -> None:
    with pytest.raises(ValueError, match="tool name"):
        tool(lambda: None, name="has spaces")


# --- the tool object -----------------------------------------------------------------------------


def test_calling_the_tool_calls_the_function_directly() -> None:
    @tool
    def double(x: int) -> int:
        """Double."""
        return x * 2

    assert double(21) == 42
    assert double(x="ab") == "abab"  # no validation on a direct call


async def test_calling_an_async_tool_directly_returns_its_coroutine() -> None:
    @tool
    async def triple(x: int) -> int:
        """Triple."""
        return x * 3

    assert await triple(2) == 6


def test_tool_is_immutable() -> None:
    @tool
    def fixed() -> None:
        """Fixed."""

    with pytest.raises(AttributeError, match="immutable"):
        fixed.name = "other"
    assert fixed.name == "fixed"


async def test_invoke_coerces_arguments_in_lax_mode() -> None:
    seen: dict[str, Any] = {}

    @tool
    def record(count: int, ratio: float, flag: bool, ids: list[int], note: str | None = None) -> None:
        """Record."""
        seen.update(count=count, ratio=ratio, flag=flag, ids=ids, note=note)

    await record.invoke({"count": "42", "ratio": "2.5", "flag": "true", "ids": ["1", 2]})
    assert seen == {"count": 42, "ratio": 2.5, "flag": True, "ids": [1, 2], "note": None}
    assert type(seen["count"]) is int


async def test_invoke_leaves_unsent_arguments_to_the_function_defaults() -> None:
    @tool
    def greet(name: str, greeting: str = "Hello") -> str:
        """Greet."""
        return f"{greeting}, {name}"

    assert await greet.invoke({"name": "Ada"}) == "Hello, Ada"
    assert await greet.invoke({"name": "Ada", "greeting": "Hi"}) == "Hi, Ada"


class Address(pydantic.BaseModel):
    city: str


async def test_invoke_passes_validated_objects_not_dicts() -> None:
    received: list[Any] = []

    @tool
    def ship(address: Address) -> None:
        """Ship."""
        received.append(address)

    await ship.invoke({"address": {"city": "Lyon"}})
    assert received == [Address(city="Lyon")]


async def test_invoke_raises_a_readable_error_naming_the_bad_argument() -> None:
    @tool
    def check(order_id: int, kind: Literal["order", "refund"] = "order") -> None:
        """Check."""

    with pytest.raises(ToolArgumentsError, match=r"^order_id: Input should be a valid integer"):
        await check.invoke({"order_id": "abc"})
    with pytest.raises(ToolArgumentsError, match=r"^kind: Input should be 'order' or 'refund'"):
        await check.invoke({"order_id": 1, "kind": "other"})
    with pytest.raises(ToolArgumentsError, match="must be a JSON object"):
        await check.invoke(["order_id", 1])  # type: ignore[arg-type]
    assert issubclass(ToolArgumentsError, ValueError)


async def test_sync_tool_runs_in_a_worker_thread() -> None:
    threads: list[int] = []

    @tool
    def where() -> str:
        """Where."""
        threads.append(threading.get_ident())
        return "done"

    assert await where.invoke({}) == "done"
    assert len(threads) == 1
    assert threads[0] != threading.get_ident()


async def test_async_tool_is_awaited_on_the_event_loop() -> None:
    threads: list[int] = []

    @tool
    async def where() -> str:
        """Where."""
        threads.append(threading.get_ident())
        return "awaited"

    assert await where.invoke({}) == "awaited"
    assert threads == [threading.get_ident()]


# --- explicit tools ------------------------------------------------------------------------------

HANDOFF_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "required": [],
    "additionalProperties": False,
}


async def test_explicit_tool_without_parameters() -> None:
    handoff = Tool(
        "transfer_to_billing", "Hand the conversation to billing.", HANDOFF_SCHEMA, lambda: "billing"
    )

    assert isinstance(handoff, ToolSpec)
    assert handoff.openai_schema()["function"] == {
        "name": "transfer_to_billing",
        "description": "Hand the conversation to billing.",
        "parameters": HANDOFF_SCHEMA,
    }
    assert await handoff.invoke({}) == "billing"
    with pytest.raises(ToolArgumentsError, match=r"^reason: unexpected argument"):
        await handoff.invoke({"reason": "x"})


async def test_explicit_tool_checks_required_unknown_and_top_level_types() -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    forecast = Tool("forecast", "Weather.", schema, lambda city, days=1: f"{city}:{days}")

    assert await forecast.invoke({"city": "Oslo", "days": 3}) == "Oslo:3"
    with pytest.raises(ToolArgumentsError, match=r"^city: missing required argument$"):
        await forecast.invoke({"days": 3})
    with pytest.raises(ToolArgumentsError, match=r"^days: expected integer, got string$"):
        await forecast.invoke({"city": "Oslo", "days": "3"})
    with pytest.raises(ToolArgumentsError, match=r"^days: expected integer, got boolean$"):
        await forecast.invoke({"city": "Oslo", "days": True})
    with pytest.raises(ToolArgumentsError, match=r"^hours: unexpected argument \(known: city, days\)$"):
        await forecast.invoke({"city": "Oslo", "hours": 2})


async def test_explicit_tool_allows_extra_arguments_when_its_schema_does() -> None:
    echo = Tool("echo", "Echo.", {"type": "object", "properties": {}}, lambda **kw: kw)

    assert await echo.invoke({"anything": 1}) == {"anything": 1}


async def test_explicit_tool_awaits_an_async_function() -> None:
    async def answer() -> int:
        return 42

    assert await Tool("answer", "", HANDOFF_SCHEMA, answer).invoke({}) == 42


def test_explicit_tool_keeps_its_own_copy_of_the_schema() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    built = Tool("copy", "", schema, lambda: None)
    schema["required"].append("x")
    assert built.parameters["required"] == []


def test_explicit_tool_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        Tool("nothing", "", HANDOFF_SCHEMA, "not a function")  # type: ignore[arg-type]


# --- executing tool calls ------------------------------------------------------------------------


@tool
def check_order_status(order_id: int) -> dict[str, Any]:
    """Look up an order."""
    if order_id == 13:
        raise ValueError("order 13 is cursed")
    return {"order_id": order_id, "status": "expédiée"}


async def test_successful_call_answers_with_the_json_result() -> None:
    message = await run(check_order_status, order_id="7")

    assert message.role is Role.TOOL
    assert (message.tool_call_id, message.name, message.agent_name) == (
        "call-1",
        "check_order_status",
        "support",
    )
    assert message.content == '{"order_id": 7, "status": "expédiée"}'
    assert message.created_at.tzinfo is not None


class Status(pydantic.BaseModel):
    code: int


class Opaque:
    def __str__(self) -> str:
        return "<opaque>"


@pytest.mark.parametrize(
    ("result", "content"),
    [
        ("plain text", "plain text"),
        (None, "null"),
        (3, "3"),
        ([1, "a"], '[1, "a"]'),
        (Status(code=2), '{"code": 2}'),
        (datetime(2024, 5, 1, 12, 0, tzinfo=UTC), '"2024-05-01T12:00:00Z"'),
        ({"x": Opaque()}, '{"x": "<opaque>"}'),
    ],
    ids=["str", "none", "int", "list", "model", "datetime", "fallback-str"],
)
async def test_results_are_rendered_as_text(result: Any, content: str) -> None:
    returns = Tool("returns", "", HANDOFF_SCHEMA, lambda: result)

    assert (await run(returns)).content == content


async def test_invalid_argument_is_an_error_message_naming_it() -> None:
    message = await run(check_order_status, order_id="abc")

    assert message.role is Role.TOOL
    assert message.tool_call_id == "call-1"
    assert message.content is not None
    assert message.content.startswith(
        "Error: invalid arguments for check_order_status: order_id: Input should be a valid integer"
    )


async def test_missing_required_argument_is_an_error_message() -> None:
    message = await run(check_order_status)

    assert (
        message.content
        == "Error: invalid arguments for check_order_status: order_id: missing required argument"
    )


async def test_unknown_extra_argument_is_an_error_message() -> None:
    message = await run(check_order_status, order_id=1, priority="high")

    assert message.content == (
        "Error: invalid arguments for check_order_status: priority: unexpected argument (known: order_id)"
    )


async def test_unknown_tool_lists_the_available_ones() -> None:
    @tool
    def refund() -> None:
        """Refund."""

    tools = {"check_order_status": check_order_status, "refund": refund}
    message = await execute_tool_call(tools, call("cancel_order", order_id=1))

    assert message.role is Role.TOOL
    assert (message.tool_call_id, message.name, message.agent_name) == ("call-1", "cancel_order", None)
    assert (
        message.content == "Error: unknown tool 'cancel_order'; available tools: check_order_status, refund"
    )


async def test_unknown_tool_with_no_tools_at_all() -> None:
    message = await execute_tool_call({}, call("anything"))

    assert message.content == "Error: unknown tool 'anything'; available tools: none"


async def test_exception_inside_a_tool_is_an_error_message_and_is_logged_without_arguments() -> None:
    with structlog.testing.capture_logs() as logs:
        message = await run(check_order_status, order_id=13)

    assert message.content == "Error: check_order_status failed: ValueError: order 13 is cursed"
    failed = [entry for entry in logs if entry["event"] == "tool_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"
    assert failed[0]["tool"] == "check_order_status"
    assert failed[0]["error_type"] == "ValueError"
    loud = [entry for entry in logs if entry["log_level"] in {"info", "warning", "error", "critical"}]
    assert "13" not in json.dumps(loud, default=str)


async def test_exception_without_message_names_its_type() -> None:
    def explode() -> None:
        raise KeyError

    message = await run(Tool("explode", "", HANDOFF_SCHEMA, explode))

    assert message.content == "Error: explode failed: KeyError"


async def test_bad_arguments_are_logged_as_a_warning_without_their_values() -> None:
    with structlog.testing.capture_logs() as logs:
        await run(check_order_status, order_id="secret-value")

    assert [(e["event"], e["log_level"], e["error_type"]) for e in logs] == [
        ("tool_failed", "warning", "invalid_arguments")
    ]
    assert "secret-value" not in json.dumps(logs, default=str)


async def test_tool_may_reject_its_arguments_itself() -> None:
    @tool
    def book(day: str) -> None:
        """Book."""
        raise ToolArgumentsError(f"day: no free slot on {day}")

    message = await run(book, day="monday")

    assert message.content == "Error: invalid arguments for book: day: no free slot on monday"


async def test_async_tool_exception_is_an_error_message() -> None:
    @tool
    async def flaky() -> None:
        """Flaky."""
        raise ConnectionError("upstream down")

    message = await run(flaky)

    assert message.content == "Error: flaky failed: ConnectionError: upstream down"


async def test_cancelled_error_raised_by_a_tool_propagates() -> None:
    @tool
    async def cancelled() -> None:
        """Cancelled."""
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await run(cancelled)


async def test_cancelling_a_running_tool_call_cancels_the_caller() -> None:
    started = asyncio.Event()
    never = asyncio.Event()
    finished: list[bool] = []

    @tool
    async def wait_forever() -> None:
        """Wait."""
        started.set()
        await never.wait()
        finished.append(True)

    task = asyncio.create_task(run(wait_forever))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert finished == []
