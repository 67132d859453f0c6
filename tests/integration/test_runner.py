"""The runner on every store: all-or-nothing turns, serialized sessions, tool rounds, handoffs."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from gateway.agents import (
    Agent,
    BaseSessionStore,
    Message,
    Role,
    Runner,
    SessionContext,
    SessionDeletedError,
    SessionStore,
    SQLiteSessionStore,
    SQLSessionStore,
    ToolCall,
    tool,
)
from gateway.agents.models.base import ToolSpec
from tests.helpers import REPO_ROOT
from tests.turn_worker import EchoModel


@pytest.fixture
def store(any_store: BaseSessionStore) -> BaseSessionStore:
    return any_store


BLOCK = object()  # a step that never answers


class ScriptModel:
    """Plays back steps: a Message to return, an exception to raise, or BLOCK to hang (and say so)."""

    def __init__(self, steps: list[Any]) -> None:
        self.steps = list(steps)
        self.blocked = asyncio.Event()

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        if step is BLOCK:
            self.blocked.set()
            await asyncio.Event().wait()
        assert isinstance(step, Message)
        return step


def call(name: str, call_id: str = "c1", **arguments: Any) -> Message:
    return Message(Role.MODEL, None, tool_calls=[ToolCall(call_id, name, arguments)])


def say(text: str) -> Message:
    return Message(Role.MODEL, text)


@tool
def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


def dump(session: SessionContext | None) -> tuple[Any, ...]:
    """A deep snapshot: nothing in it is shared with the live session."""
    assert session is not None
    history = [m.to_dict() for m in session.history]
    return (session.active_agent.name, history, session.title, dict(session.metadata))


async def test_a_completed_turn_is_stored_with_its_tool_exchange(store: BaseSessionStore) -> None:
    model = ScriptModel([call("lookup", q="x"), say("done")])
    runner = Runner(Agent("A", "a", model=model, tools=[lookup]), store)
    result = await runner.run_async("s", "hello", metadata={"platform": "telegram"})
    assert (result.content, result.agent_name, result.session_id) == ("done", "A", "s")
    assert [m.role for m in result.new_messages] == [Role.USER, Role.MODEL, Role.TOOL, Role.MODEL]
    assert result.new_messages[2].content == "found x"
    stored = await store.get("s")
    assert stored is not None
    assert [m.to_dict() for m in stored.history] == [m.to_dict() for m in result.new_messages]
    assert stored.metadata == {"platform": "telegram"}
    assert stored.title == "hello"


class Recording:
    """Answers with how many user messages it saw, and keeps each history it was given."""

    def __init__(self) -> None:
        self.histories: list[list[tuple[Role, str | None]]] = []

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        self.histories.append([(m.role, m.content) for m in history])
        return say(f"{sum(m.role is Role.USER for m in history)} messages")


async def test_several_user_messages_are_one_turn_with_one_reply(store: BaseSessionStore) -> None:
    """A burst the user split over messages: appended in order, one model call, one reply."""
    model = Recording()
    runner = Runner(Agent("A", "a", model=model), store)
    result = await runner.run_async("s", ["hi", "my order 1001", "where is it?"])
    assert result.content == "3 messages"
    user = Role.USER
    assert model.histories == [[(user, "hi"), (user, "my order 1001"), (user, "where is it?")]]
    stored = await store.get("s")
    assert stored is not None
    assert [(m.role, m.content) for m in stored.history] == [
        (user, "hi"),
        (user, "my order 1001"),
        (user, "where is it?"),
        (Role.MODEL, "3 messages"),
    ]
    assert stored.title == "hi"
    with pytest.raises(ValueError, match="at least one user message"):
        await runner.run_async("s", [])


@pytest.mark.parametrize("failure", ["exception", "timeout", "cancellation"])
async def test_a_failed_turn_leaves_the_session_exactly_as_it_was(
    store: BaseSessionStore, failure: str
) -> None:
    billing = Agent("Billing", "b")
    agent = Agent("Support", "s", tools=[lookup], handoffs=[billing])
    first_turn = [say("welcome")]
    # The failing turn: a tool exchange, a handoff, then the new agent's model fails.
    failing_turn = [call("lookup", "c2", q="y"), call("transfer_to_billing", "c3")]
    last = RuntimeError("model crashed") if failure == "exception" else BLOCK
    # Both agents share one scripted model, so the script runs across the handoff.
    agent.model = billing.model = model = ScriptModel([*first_turn, *failing_turn, last, say("recovered")])
    runner = Runner(agent, store)
    await runner.run_async("s", "first", metadata={"k": "v"})
    before_memory = dump(await store.get_or_create("s", agent)) if isinstance(store, SessionStore) else None
    before_stored = dump(await store.get("s"))

    if failure == "exception":
        with pytest.raises(RuntimeError, match="model crashed"):
            await runner.run_async("s", "second", metadata={"k": "changed"})
    elif failure == "timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await runner.run_async("s", "second", metadata={"k": "changed"})
    else:
        task = asyncio.create_task(runner.run_async("s", "second", metadata={"k": "changed"}))
        await model.blocked.wait()  # the turn is past its tool call and handoff, inside the model
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert dump(await store.get("s")) == before_stored
    if before_memory is not None:
        assert dump(await store.get_or_create("s", agent)) == before_memory
    assert (await store.get("s")).active_agent.name == "Support"  # type: ignore[union-attr]
    # The session still works, and nothing of the failed turn shows up later.
    result = await runner.run_async("s", "third")
    assert result.content == "recovered"
    contents = [m.content for m in (await store.get("s")).history]  # type: ignore[union-attr]
    assert contents == ["first", "welcome", "third", "recovered"]


async def test_concurrent_turns_on_one_session_are_serialized(store: BaseSessionStore) -> None:
    runner = Runner(Agent("Echo", "e", model=EchoModel()), store)
    await asyncio.gather(*(runner.run_async("s", f"m{i}") for i in range(20)))
    stored = await store.get("s")
    assert stored is not None
    assert_complete_echo_turns(stored.history, 20)


async def test_turns_on_different_sessions_run_in_parallel(store: BaseSessionStore) -> None:
    gate = asyncio.Event()
    arrived: set[str] = set()

    class Rendezvous:
        """Every session's turn waits until all have started: only possible if they run in parallel."""

        async def respond(
            self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]
        ) -> Message:
            text = history[-1].content or ""
            arrived.add(text)
            if len(arrived) == 8:
                gate.set()
            async with asyncio.timeout(30):
                await gate.wait()
            return say(f"ok {text}")

    runner = Runner(Agent("R", "r", model=Rendezvous()), store)
    results = await asyncio.gather(*(runner.run_async(f"s{i}", f"t{i}") for i in range(8)))
    assert sorted(r.content for r in results) == sorted(f"ok t{i}" for i in range(8))


def assert_complete_echo_turns(history: list[Message], count: int) -> None:
    assert len(history) == 2 * count
    users = history[0::2]
    models = history[1::2]
    assert all(m.role is Role.USER for m in users)
    assert all(m.role is Role.MODEL for m in models)
    assert [m.content for m in models] == [f"echo:{u.content}" for u in users]
    assert len({u.content for u in users}) == count


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_concurrent_turns_from_two_processes_are_serialized(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = (
        f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    store = SQLSessionStore(url)
    await store.get("warm-up")  # migrate once, before the processes race
    workers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.turn_worker",
            url,
            "shared",
            "10",
            prefix,
            cwd=REPO_ROOT,
            stderr=asyncio.subprocess.PIPE,
        )
        for prefix in ("a", "b")
    ]
    errors = [(await w.communicate())[1].decode() for w in workers]
    assert [w.returncode for w in workers] == [0, 0], errors
    stored = await store.get("shared")
    await store.aclose()
    assert stored is not None
    assert_complete_echo_turns(stored.history, 20)
    assert sorted(cast(int, m.position) for m in stored.history) == list(range(40))


async def test_a_turn_on_a_session_deleted_meanwhile_fails_and_writes_nothing(
    store: BaseSessionStore,
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    class Slow:
        async def respond(
            self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]
        ) -> Message:
            entered.set()
            await release.wait()
            return say("late")

    agent = Agent("A", "a", model=ScriptModel([say("one")]))
    runner = Runner(agent, store)
    await runner.run_async("s", "first")
    agent.model = Slow()
    turn = asyncio.create_task(runner.run_async("s", "second"))
    await entered.wait()
    assert await store.delete("s") is True
    release.set()
    with pytest.raises(SessionDeletedError):
        await turn
    assert await store.get("s") is None


async def test_too_many_tool_rounds_end_with_a_fallback_reply(store: BaseSessionStore) -> None:
    model = ScriptModel([call("lookup", f"c{i}", q=str(i)) for i in range(4)])
    runner = Runner(Agent("A", "a", model=model, tools=[lookup]), store, max_tool_rounds=3)
    result = await runner.run_async("s", "loop forever")
    assert "couldn't finish" in result.content
    stored = await store.get("s")
    assert stored is not None
    roles = [m.role for m in stored.history]
    assert roles == [Role.USER] + [Role.MODEL, Role.TOOL] * 3 + [Role.MODEL]
    assert not stored.history[-1].tool_calls  # no call left without its result


async def test_handoff_makes_the_target_answer_in_the_same_turn_and_stay_active(
    store: BaseSessionStore,
) -> None:
    billing = Agent("Billing Desk", "b", model=ScriptModel([say("billing here"), say("still billing")]))
    support = Agent("Support", "s", model=ScriptModel([call("transfer_to_billing_desk")]), handoffs=[billing])
    runner = Runner(support, store)
    first = await runner.run_async("s", "refund please")
    assert (first.content, first.agent_name) == ("billing here", "Billing Desk")
    second = await runner.run_async("s", "and then?")
    assert (second.content, second.agent_name) == ("still billing", "Billing Desk")


async def test_tool_errors_reach_the_model_and_the_turn_goes_on(store: BaseSessionStore) -> None:
    seen: list[str] = []

    class Recorder:
        async def respond(
            self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]
        ) -> Message:
            if history[-1].role is Role.TOOL:
                seen.append(history[-1].content or "")
                return say("sorry, that failed")
            return call("no_such_tool")

    runner = Runner(Agent("A", "a", model=Recorder(), tools=[lookup]), store)
    result = await runner.run_async("s", "go")
    assert result.content == "sorry, that failed"
    assert seen, "the model never saw the tool result"
    assert seen[0].startswith("Error: unknown tool 'no_such_tool'")


def test_run_is_a_blocking_wrapper() -> None:
    runner = Runner(Agent("A", "a", model=ScriptModel([say("hi")])))
    assert runner.run("s", "hello").content == "hi"


async def test_run_inside_an_event_loop_is_refused_without_leaking_a_coroutine() -> None:
    runner = Runner(Agent("A", "a", model=ScriptModel([say("hi")])))
    with pytest.raises(RuntimeError, match="run_async"):
        runner.run("s", "hello")
    # Warnings are errors in this suite, so an un-awaited coroutine ("never awaited") would fail it.


def test_agent_names_must_be_unique_in_the_graph() -> None:
    twin = Agent("Support", "other")
    with pytest.raises(ValueError, match="Support"):
        Runner(Agent("Support", "s", handoffs=[twin]))


def test_agents_without_a_model_use_the_configured_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_MODEL", "scripted")
    runner = Runner(Agent("Plain", "p"))
    assert runner.run("s", "hello").content == "Hello! How can I help you today?"


def test_an_unknown_default_model_is_a_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.errors import SettingsError

    monkeypatch.setenv("GATEWAY_MODEL", "llama")
    runner = Runner(Agent("Plain", "p"))
    with pytest.raises(SettingsError, match="GATEWAY_MODEL"):
        runner.run("s", "hello")


def test_tool_name_clashes_from_handoffs_added_later_are_caught_by_the_runner() -> None:
    support = Agent("Support", "s")
    support.handoffs += [Agent("Billing Agent", "b"), Agent("billing-agent", "b2")]
    with pytest.raises(ValueError, match="transfer_to_billing_agent"):
        Runner(support)


async def test_a_cancellation_during_the_save_leaves_memory_and_storage_agreeing(tmp_path: Path) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    class SlowSaving(SQLiteSessionStore):
        async def save(self, session: SessionContext, also: object | None = None) -> None:
            entered.set()
            await release.wait()
            await super().save(session, also)

    store = SlowSaving(tmp_path / "slow.db")
    runner = Runner(Agent("A", "a", model=ScriptModel([say("stored anyway")])), store)
    turn = asyncio.create_task(runner.run_async("s", "hello"))
    await entered.wait()
    turn.cancel()
    await asyncio.sleep(0)  # the cancellation is delivered while the save waits
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await turn
    stored = await store.get("s")
    await store.aclose()
    assert stored is not None, "the save went through, so the turn must be in storage"
    assert [m.content for m in stored.history] == ["hello", "stored anyway"]
