"""The runner: a user message (or several sent in a row) in, one reply out, with tools and handoffs, and an
all-or-nothing turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from gateway.agents.agent import Agent
from gateway.agents.context import SessionContext
from gateway.agents.models.base import Model
from gateway.agents.stores.base import BaseSessionStore
from gateway.agents.stores.memory import SessionStore
from gateway.agents.tools import execute_tool_call
from gateway.domain.messages import Message, ModelUsage, Role
from gateway.domain.sessions import StoredVersion
from gateway.domain.text import sendable

log = structlog.get_logger(__name__)

DEFAULT_MAX_TOOL_ROUNDS = 10
TOO_MANY_STEPS_REPLY = (
    "Sorry, I couldn't finish that: it took more steps than I'm allowed. Could you try again, "
    "maybe in smaller parts?"
)


@dataclass(frozen=True)
class RunResult:
    content: str
    agent_name: str
    session_id: str
    new_messages: list[Message] = field(default_factory=list)


ModelFactory = Callable[[Model | str | None], Model]


class Runner:
    """Runs turns for a graph of agents (the starting agent and every agent reachable by handoffs).

    `model_factory` turns an agent's model spec (or None) into a Model; by default specs are
    resolved with the service's settings (GATEWAY_MODEL, GATEWAY_OPENAI_*), read on first need.
    """

    def __init__(
        self,
        starting_agent: Agent,
        session_store: BaseSessionStore | None = None,
        *,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        model_factory: ModelFactory | None = None,
    ) -> None:
        if max_tool_rounds < 0:
            raise ValueError("max_tool_rounds must be zero or more")
        self.starting_agent = starting_agent
        self.agents = reachable_agents(starting_agent)
        self.session_store: BaseSessionStore = session_store if session_store is not None else SessionStore()
        self.session_store.set_agent_resolver(self.agents.get)
        self.max_tool_rounds = max_tool_rounds
        self._model_factory = model_factory
        self._models: dict[int, Model] = {}

    def run(
        self, session_id: str, user_message: str | Sequence[str], metadata: Mapping[str, Any] | None = None
    ) -> RunResult:
        """Blocking wrapper of run_async, for scripts; refuses to run inside an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop running: the normal case for a script
        else:
            # Checked before the coroutine exists, so none is left un-awaited.
            raise RuntimeError(
                "Runner.run() was called inside a running event loop; use `await runner.run_async(...)`"
            )
        return asyncio.run(self.run_async(session_id, user_message, metadata))

    async def run_async(
        self,
        session_id: str,
        user_message: str | Sequence[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        commit_with: Callable[[list[Message]], object] | None = None,
        leased: bool = False,
        session_version: StoredVersion | None = None,
    ) -> RunResult:
        """Run one turn. On any failure (exception, timeout, cancellation) the session is left as it was.

        `user_message`: one message, or several the user sent in a row (a burst split over messages,
        gathered by the gateway's worker): they are appended in order and answered by one reply.

        `commit_with` turns the turn's new messages into what the caller commits along with the
        session, in the same transaction (the gateway's worker: its inbox row done, the replies to
        deliver); the runner hands it to the store's save without looking at it. `leased`: the caller
        holds the session against other processes already (the worker's lease on the conversation,
        checked again by that commit), so only this process's lock is taken: on PostgreSQL the
        cross-process lock holds a pooled connection for the whole turn. `session_version`: the
        session's version as the caller read it under that lease (the worker's claim), so the store may
        skip reading a session it remembers (or one that has no row yet).
        """
        texts = [user_message] if isinstance(user_message, str) else list(user_message)
        if not texts:
            raise ValueError("a turn needs at least one user message")
        store = self.session_store
        async with store.session_lock(session_id, across_processes=not leased):
            session = await store.get_or_create(session_id, self.starting_agent, stored=session_version)
            checkpoint = session.checkpoint()
            saved = False
            try:
                if metadata:
                    session.metadata.update(metadata)  # after the checkpoint: a failed turn undoes it
                new_messages = await self._turn(session, texts)
                session._prune_history()
                also = commit_with(new_messages) if commit_with is not None else None
                if store.save_may_suspend:
                    saving = asyncio.ensure_future(store.save(session, also))
                    try:
                        await asyncio.shield(saving)
                    except asyncio.CancelledError:
                        # Let the short save finish, so memory and storage agree on whether the
                        # turn happened; then pass the cancellation on.
                        if not saving.done():
                            await asyncio.wait([saving])
                        saved = not saving.cancelled() and saving.exception() is None
                        raise
                else:
                    await store.save(session, also)  # never suspends, so it cannot be cut in half
                saved = True
            except BaseException:
                if not saved:
                    session.rollback_to(checkpoint)
                raise
        reply = new_messages[-1]
        return RunResult(
            content=reply.content or "",
            agent_name=session.active_agent.name,
            session_id=session_id,
            new_messages=new_messages,
        )

    async def _turn(self, session: SessionContext, texts: list[str]) -> list[Message]:
        new: list[Message] = []

        def add(message: Message) -> None:
            session.history.append(message)
            new.append(message)

        for text in texts:
            add(Message(role=Role.USER, content=text))
        agent = session.active_agent
        for round_number in range(self.max_tool_rounds + 1):
            tools = agent.all_tools()
            model = self._model(agent)
            started = time.perf_counter()
            reply = await model.respond(agent, list(session.history), tools)
            reply.agent_name = agent.name
            reply.content = sendable(reply.content)
            if reply.usage is None:  # a model that counts nothing: its name and seconds
                name = str(getattr(model, "spec", type(model).__name__))
                reply.usage = ModelUsage(name, latency_s=time.perf_counter() - started)
            if not reply.tool_calls:
                add(reply)
                return new
            if round_number == self.max_tool_rounds:
                break  # the model still wants tools: answer without them, keeping history well-formed
            add(reply)
            handoffs = agent.handoff_targets()
            own_tools = {t.name: t for t in agent.tools}
            next_agent = agent
            for call in reply.tool_calls:
                if call.name in handoffs:
                    next_agent = handoffs[call.name]
                    add(
                        Message(
                            role=Role.TOOL,
                            content=f"Transferred to {next_agent.name}.",
                            tool_call_id=call.id,
                            name=call.name,
                            agent_name=agent.name,
                        )
                    )
                else:
                    add(await execute_tool_call(own_tools, call, agent_name=agent.name))
            if next_agent is not agent:
                log.info(
                    "agent_handoff", session_id=session.session_id, source=agent.name, target=next_agent.name
                )
                session.active_agent = agent = next_agent
        log.warning("tool_rounds_exceeded", session_id=session.session_id, limit=self.max_tool_rounds)
        add(Message(role=Role.MODEL, content=TOO_MANY_STEPS_REPLY, agent_name=agent.name))
        return new

    def _model(self, agent: Agent) -> Model:
        if not isinstance(agent.model, str) and agent.model is not None:
            return agent.model
        key = id(agent)
        if key not in self._models:
            factory = self._model_factory or _settings_model_factory()
            self._models[key] = factory(agent.model)
        return self._models[key]


def _settings_model_factory() -> ModelFactory:
    """The library default (issue 3's API): a Runner built without a factory resolves specs with the
    service's settings (GATEWAY_MODEL, GATEWAY_OPENAI_*), read on first need. The one import of the
    settings outside bootstrap, app and cli (an ignored import in pyproject.toml's contract)."""
    from gateway.agents.models.registry import model_factory
    from gateway.settings import load_settings

    settings = load_settings()
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
    return model_factory(settings.model, openai_base_url=settings.openai_base_url, openai_api_key=key)


def reachable_agents(start: Agent) -> dict[str, Agent]:
    """Every agent reachable by handoffs, by name; ValueError when two different agents share a name
    or an agent's tool names clash."""
    agents: dict[str, Agent] = {}
    pending = [start]
    while pending:
        agent = pending.pop()
        known = agents.get(agent.name)
        if known is agent:
            continue
        if known is not None:
            raise ValueError(f"two different agents are named {agent.name!r}")
        agent.all_tools()  # tool names unique, handoffs added after construction included
        agents[agent.name] = agent
        pending.extend(agent.handoffs)
    return agents
