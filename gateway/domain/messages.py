"""Conversation messages: what a session holds and what models read and write."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    MODEL = "model"
    TOOL = "tool"


@dataclass(frozen=True)
class ToolCall:
    """A model's request to run one tool; its result comes back as a TOOL message with the same id."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ToolCall:
        return cls(id=str(data["id"]), name=str(data["name"]), arguments=dict(data.get("arguments") or {}))


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class ModelUsage:
    """What one model call cost: the model ("openai:gpt-4o-mini"), its tokens, and its seconds."""

    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0


@dataclass
class Message:
    """One message of a conversation. A MODEL message may carry tool calls; a TOOL message answers one."""

    role: Role
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    agent_name: str | None = None
    created_at: datetime = field(default_factory=utcnow)
    # Where a store keeps this message within its session; None until stored. Not part of the JSON.
    position: int | None = field(default=None, compare=False, repr=False, kw_only=True)
    # What the model call that wrote this MODEL message cost; None otherwise. Not part of the JSON.
    usage: ModelUsage | None = field(default=None, compare=False, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        self.role = Role(self.role)
        if self.created_at.tzinfo is None:
            raise ValueError("Message.created_at must be timezone-aware")

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "content": self.content,
            "tool_calls": [call.to_dict() for call in self.tool_calls],
            "tool_call_id": self.tool_call_id,
            "name": self.name,
            "agent_name": self.agent_name,
            "created_at": self.created_at.isoformat(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        created = data.get("created_at")
        return cls(
            role=Role(data["role"]),
            content=data.get("content"),
            tool_calls=[ToolCall.from_dict(c) for c in data.get("tool_calls") or []],
            tool_call_id=data.get("tool_call_id"),
            name=data.get("name"),
            agent_name=data.get("agent_name"),
            created_at=datetime.fromisoformat(created) if created else utcnow(),
        )
