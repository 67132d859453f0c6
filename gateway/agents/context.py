"""A session in memory: its history, active agent and metadata, with checkpoints and turn pruning."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gateway.domain.messages import Message, Role, utcnow

if TYPE_CHECKING:
    from gateway.agents.agent import Agent

DEFAULT_MAX_TURNS = 40
DEFAULT_TITLE = "New conversation"
TITLE_LENGTH = 30


def make_title(text: str | None, default: str = DEFAULT_TITLE) -> str:
    """A sidebar title from the first user message: one line, at most 30 characters plus '...'."""
    line = " ".join((text or "").split())
    if not line:
        return default
    return line if len(line) <= TITLE_LENGTH else line[:TITLE_LENGTH] + "..."


@dataclass(frozen=True)
class Checkpoint:
    """Everything a turn may change, so a failed turn can be undone exactly."""

    history: tuple[Message, ...]
    active_agent: Agent
    metadata: dict[str, Any]
    title: str | None
    stored_positions: frozenset[int]


class SessionContext:
    """One conversation. Stores load and save it; the runner changes it one turn at a time."""

    def __init__(
        self,
        session_id: str,
        initial_agent: Agent,
        max_turns: int = DEFAULT_MAX_TURNS,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if max_turns <= 0:
            raise ValueError(f"max_turns must be positive, got {max_turns}")
        self.session_id = session_id
        self.active_agent = initial_agent
        self.history: list[Message] = []
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.max_turns = max_turns
        self.title: str | None = None
        self.created_at: datetime = utcnow()
        self.updated_at: datetime = self.created_at
        # Positions of this session's messages as the store last saved them, so a save can
        # delete exactly the pruned ones and insert exactly the new ones.
        self._stored_positions: set[int] = set()
        self._is_new = True  # not stored yet: the first save creates it

    def __repr__(self) -> str:
        return (
            f"SessionContext(session_id={self.session_id!r}, active_agent={self.active_agent.name!r}, "
            f"messages={len(self.history)}, max_turns={self.max_turns})"
        )

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(
            history=tuple(self.history),
            active_agent=self.active_agent,
            metadata=dict(self.metadata),
            title=self.title,
            stored_positions=frozenset(self._stored_positions),
        )

    def rollback_to(self, checkpoint: Checkpoint | int) -> None:
        """Undo everything since `checkpoint` (not the side effects of tools that already ran).

        An int is a history length, as in chatflow-agent: only the history is cut back to it.
        """
        if isinstance(checkpoint, int):
            if checkpoint < 0:
                raise ValueError("a checkpoint length cannot be negative")
            del self.history[checkpoint:]
            return
        self.history = list(checkpoint.history)
        self.active_agent = checkpoint.active_agent
        self.metadata = dict(checkpoint.metadata)
        self.title = checkpoint.title
        self._stored_positions = set(checkpoint.stored_positions)

    def _prune_history(self) -> None:
        """Keep the system messages (at the front) and the newest `max_turns` complete turns.

        A turn is a USER message and every MODEL and TOOL message after it. Whatever precedes the
        first kept USER message goes, so the kept history never opens with a MODEL or TOOL message
        and a tool result never outlives the call that asked for it.
        """
        history = self.history
        user, system_role = Role.USER, Role.SYSTEM  # locals: enum attribute lookups are slow in loops
        roles = [m.role for m in history]  # then list.count/index do the scanning at C speed
        users = roles.count(user)
        if not users:
            self.history = [m for m in history if m.role is system_role]
            return
        start = -1  # index of the oldest USER message to keep: skip all but the newest max_turns
        for _ in range(max(0, users - self.max_turns) + 1):
            start = roles.index(user, start + 1)
        if system_role in roles:
            system = [m for m in history if m.role is system_role]
            self.history = system + [m for m in history[start:] if m.role is not system_role]
        elif start:
            self.history = history[start:]

    def _unsaved_messages(self) -> list[Message]:
        return [m for m in self.history if m.position is None or m.position not in self._stored_positions]

    def _pruned_positions(self) -> set[int]:
        return self._stored_positions - {m.position for m in self.history if m.position is not None}

    def _next_position(self) -> int:
        return max(self._stored_positions, default=-1) + 1

    def _mark_saved(self) -> None:
        self._stored_positions = {m.position for m in self.history if m.position is not None}
        self._is_new = False
