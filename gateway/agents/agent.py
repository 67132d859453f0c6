"""Agents: a name, instructions, a model, tools, and the agents it may hand the conversation to."""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from gateway.agents.tools import Tool

if TYPE_CHECKING:
    from gateway.agents.models.base import Model

HANDOFF_PREFIX = "transfer_to_"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def snake_case(name: str) -> str:
    """'Billing Agent', 'BillingAgent' and 'billing-agent' all become 'billing_agent'.

    A name with no ASCII letters or digits (tool names must be ASCII) gets a stable hex stand-in.
    """
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name.strip())
    snake = re.sub(r"[^0-9a-zA-Z]+", "_", spaced).strip("_").lower()
    return snake or "agent_" + hashlib.sha256(name.encode()).hexdigest()[:8]


def handoff_tool_name(agent_name: str) -> str:
    return HANDOFF_PREFIX + snake_case(agent_name)


class Agent:
    """A persona the runner can put in charge of a session.

    `instructions` is a string or a callable returning one (called each time the model is asked,
    so it can include the date or a lookup). `model` is a Model, a spec string ("scripted",
    "openai:<model>") or None for the service default.
    """

    def __init__(
        self,
        name: str,
        instructions: str | Callable[[], str] = "",
        model: Model | str | None = None,
        tools: Iterable[Tool] = (),
        handoffs: Iterable[Agent] = (),
    ) -> None:
        if not name or not name.strip():
            raise ValueError("an agent needs a non-empty name")
        if not (isinstance(instructions, str) or callable(instructions)):
            raise TypeError("instructions must be a string or a callable returning one")
        self.name = name
        self.instructions = instructions
        self.model = model
        self.tools: list[Tool] = list(tools)
        self.handoffs: list[Agent] = list(handoffs)
        self._tools_cache: tuple[object, list[Tool]] | None = None
        self.all_tools()  # names must be unique now; the runner checks again for handoffs added later

    def __repr__(self) -> str:
        tools = [t.name for t in self.tools]
        handoffs = [a.name for a in self.handoffs]
        return f"Agent(name={self.name!r}, tools={tools}, handoffs={handoffs})"

    def render_instructions(self) -> str:
        if isinstance(self.instructions, str):
            return self.instructions
        text = self.instructions()
        if inspect.iscoroutine(text):
            text.close()  # refused, and closed so it does not linger as "never awaited"
        if not isinstance(text, str):
            raise TypeError(f"instructions of agent {self.name!r} must return a string")
        return text

    def handoff_targets(self) -> dict[str, Agent]:
        """Handoff tool name -> the agent it transfers to."""
        return {handoff_tool_name(target.name): target for target in self.handoffs}

    def all_tools(self) -> list[Tool]:
        """The agent's own tools plus one `transfer_to_<agent>` tool per handoff, as the model sees them.

        ValueError when two of them share a name: the model could not tell them apart.
        """
        key = (tuple(map(id, self.tools)), tuple((id(a), a.name) for a in self.handoffs))
        if self._tools_cache is not None and self._tools_cache[0] == key:
            return list(self._tools_cache[1])
        names = [t.name for t in self.tools] + [handoff_tool_name(a.name) for a in self.handoffs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"agent {self.name!r} has several tools with the same name: {', '.join(duplicates)}"
            )
        handoffs = [
            Tool(
                name=tool_name,
                description=f"Hand the conversation over to {target.name}. {_first_line(target)}".strip(),
                parameters=dict(_NO_PARAMETERS),
                function=_no_op,
            )
            for tool_name, target in self.handoff_targets().items()
        ]
        tools = [*self.tools, *handoffs]
        self._tools_cache = (key, tools)  # tools and handoffs rarely change; rebuilt when they do
        return list(tools)


def _first_line(agent: Agent) -> str:
    text = agent.instructions if isinstance(agent.instructions, str) else ""
    return text.strip().splitlines()[0] if text.strip() else ""


def _no_op() -> None:
    """Handoff tools are intercepted by the runner; this body never runs."""
