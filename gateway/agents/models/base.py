"""What a model is to the runner: one async method from history and tools to the next MODEL message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gateway.domain.messages import Message
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.agents.agent import Agent


@runtime_checkable
class ToolSpec(Protocol):
    """What a model needs to know of a tool: its name, what it does, and its JSON-schema parameters."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...


@runtime_checkable
class Model(Protocol):
    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        """Return the next MODEL message: text, tool calls, or both."""
        ...


class ModelError(GatewayError):
    """A model provider refused or failed a request; carries its HTTP status and message when known.

    `transient`: the provider may well answer later (timeout, 429, 5xx, connection), so the turn is
    worth waiting for; `permanent`: asking again cannot help (a 4xx such as 400, 401, 404, a
    redirect, which is never followed, or a request the provider `refused` in a 200, such as a
    blocked prompt).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        provider: str | None = None,
        transient: bool = False,
        refused: bool = False,
    ) -> None:
        super().__init__(message if status is None else f"{provider or 'model'} answered {status}: {message}")
        self.status = status
        self.message = message
        self.provider = provider
        self.transient = transient
        self.refused = refused

    @property
    def permanent(self) -> bool:
        return self.refused or (
            not self.transient and self.status is not None and 300 <= self.status < 500
        )  # 3xx: never followed
