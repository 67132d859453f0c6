"""Each committed turn records, per model, its calls, tokens, model seconds and tool calls, in the turn's
transaction; the store adds them up per session and per day."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from gateway.agents import Agent, Runner, SQLSessionStore, tool
from gateway.agents.models.openai_compat import OpenAIChatModel
from gateway.agents.models.scripted import Rule, ScriptedModel
from gateway.domain.messages import utcnow
from gateway.store import migrations, usage
from gateway.store.database import Database
from gateway.store.tables import TurnUsageRow
from gateway.worker.inbox import InboxWorker
from tests.fakes import FakeOpenAI, chat_completion, tool_call
from tests.helpers import serve_in_thread
from tests.integration.test_inbox_worker import add_rows, table


@tool
def order_status(order_id: int) -> str:
    """Look an order up.

    Args:
        order_id: The order number.
    """
    return f"order {order_id} shipped"


def completion(body: dict[str, object], prompt: int, completion_tokens: int) -> dict[str, object]:
    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens}
    return body


@pytest.fixture
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    server = FakeOpenAI()
    with serve_in_thread(server.app) as url:
        yield server, f"{url}/v1"


@pytest.fixture
async def migrated(database: Database) -> Database:
    await migrations.upgrade(database)
    return database


async def test_a_turn_with_a_tool_round_records_its_usage(
    migrated: Database, fake: tuple[FakeOpenAI, str]
) -> None:
    server, base_url = fake
    server.enqueue(
        body=completion(chat_completion(None, [tool_call("c1", "order_status", {"order_id": 7})]), 30, 5)
    )
    server.enqueue(body=completion(chat_completion("Order 7 shipped."), 45, 9))
    model = OpenAIChatModel("gpt-test", base_url)
    store = SQLSessionStore(migrated)
    runner = Runner(Agent("Desk", "Help.", model=model, tools=[order_status]), store)
    await add_rows(migrated, [("telegram:1", "telegram:1/where is 7")])
    worker = InboxWorker(migrated, runner)
    try:
        assert await worker.run_until_idle() == 1
    finally:
        await model.aclose()
        await store.aclose()

    rows = await table(
        migrated,
        select(
            TurnUsageRow.session_id,
            TurnUsageRow.model,
            TurnUsageRow.calls,
            TurnUsageRow.input_tokens,
            TurnUsageRow.output_tokens,
            TurnUsageRow.tool_calls,
            TurnUsageRow.day,
            TurnUsageRow.inbox_id,
        ),
    )
    assert rows == [("telegram:1", "openai:gpt-test", 2, 75, 14, 1, utcnow().date().isoformat(), 1)]
    series = worker.model_stats.models["openai:gpt-test"]
    assert (series.turns, series.calls, series.input_tokens, series.output_tokens) == (1, 2, 75, 14)
    assert series.latency_s > 0


async def test_totals_per_session_and_per_day(migrated: Database) -> None:
    scripted = ScriptedModel(rules=[Rule(r".*", reply="ok")])
    store = SQLSessionStore(migrated)
    runner = Runner(Agent("Desk", "Help.", model=scripted), store)
    await add_rows(
        migrated,
        [("telegram:1", "telegram:1/a"), ("telegram:1", "telegram:1/b"), ("telegram:2", "telegram:2/a")],
    )
    try:
        assert await InboxWorker(migrated, runner).run_until_idle() == 3
    finally:
        await store.aclose()

    (first,) = await usage.session_totals(migrated, "telegram:1")
    assert (first.model, first.turns, first.calls, first.input_tokens, first.tool_calls) == (
        "scripted",
        2,
        2,
        0,
        0,
    )
    assert await usage.session_totals(migrated, "telegram:9") == []
    today = utcnow().date().isoformat()
    (day,) = await usage.daily_totals(migrated, today)
    assert (day.day, day.model, day.turns, day.calls) == (today, "scripted", 3, 3)
    assert await usage.daily_totals(migrated, "9999-01-01") == []
