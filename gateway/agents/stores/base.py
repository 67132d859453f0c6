"""What every session store does, and the parts they share: agent resolution and per-session locks."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

import structlog

from gateway.agents.agent import Agent
from gateway.agents.context import DEFAULT_MAX_TURNS, DEFAULT_TITLE, SessionContext, make_title
from gateway.domain.messages import Role
from gateway.domain.sessions import StoredVersion
from gateway.errors import GatewayError
from gateway.store import dedup

log = structlog.get_logger(__name__)

DEFAULT_DEDUP_TTL_HOURS = dedup.DEFAULT_TTL_HOURS
AgentResolver = Callable[[str], Agent | None]


class SessionDeletedError(GatewayError):
    """The session was deleted while a turn ran on it; the turn writes nothing."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} was deleted during the turn")
        self.session_id = session_id


@dataclass(frozen=True)
class SessionInfo:
    """A session's index entry: what a listing shows, without its messages."""

    session_id: str
    title: str | None
    active_agent_name: str | None
    created_at: datetime
    updated_at: datetime
    message_count: int
    metadata: dict[str, Any] = field(default_factory=dict)


class BaseSessionStore(ABC):
    """One async protocol for every backend; the runner and the gateway only talk to this."""

    # False when save() never awaits anything real, so a cancellation cannot land inside it and the
    # runner may skip the task it otherwise wraps a save in.
    save_may_suspend: ClassVar[bool] = True

    def __init__(
        self,
        default_max_turns: int = DEFAULT_MAX_TURNS,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        default_title: str = DEFAULT_TITLE,
    ) -> None:
        if default_max_turns <= 0:
            raise ValueError(f"default_max_turns must be positive, got {default_max_turns}")
        if dedup_ttl_hours <= 0:
            raise ValueError(f"dedup_ttl_hours must be positive, got {dedup_ttl_hours}")
        self.default_max_turns = default_max_turns
        self.dedup_ttl = timedelta(hours=dedup_ttl_hours)
        self.default_title = default_title
        self._resolver: AgentResolver | None = None
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    # --- agents -------------------------------------------------------------------------------
    def set_agent_resolver(self, resolver: AgentResolver | None) -> None:
        """How a loaded session's `active_agent_name` becomes an Agent (the Runner installs its own)."""
        self._resolver = resolver

    def _resolve_agent(self, name: str) -> Agent:
        agent = self._resolver(name) if self._resolver is not None else None
        if agent is None:
            log.warning("agent_unknown", agent=name, hint="a placeholder agent without tools answers")
            agent = Agent(name=name, instructions="")
        return agent

    # --- serialization of turns -------------------------------------------------------------
    @asynccontextmanager
    async def session_lock(self, session_id: str, *, across_processes: bool = True) -> AsyncIterator[None]:
        """Hold the session exclusively: in this process, then across processes where the backend can
        (unless the caller holds it across processes already: `across_processes=False`)."""
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                if across_processes:
                    async with self._exclusive(session_id):
                        yield
                else:
                    yield
        finally:
            lock, users = self._locks[session_id]
            if users == 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    @asynccontextmanager
    async def _exclusive(self, session_id: str) -> AsyncIterator[None]:
        """Cross-process exclusion; nothing to do for a store only one process can see."""
        yield

    def _title_for(self, session: SessionContext) -> str | None:
        if session.title is not None:
            return session.title
        first = next((m for m in session.history if m.role is Role.USER), None)
        return None if first is None else make_title(first.content, self.default_title)

    # --- the protocol -------------------------------------------------------------------------
    @abstractmethod
    async def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        *,
        metadata: dict[str, Any] | None = None,
        max_turns: int | None = None,
        stored: StoredVersion | None = None,
    ) -> SessionContext: ...

    @abstractmethod
    async def get(self, session_id: str) -> SessionContext | None: ...

    @abstractmethod
    async def save(self, session: SessionContext, also: object | None = None) -> None:
        """Persist one turn's changes; SessionDeletedError if the session is gone.

        `also`: what the caller's unit of work commits in the same transaction (the gateway's worker:
        its inbox row and replies); opaque to the runner, understood by the SQL store only.
        """

    @abstractmethod
    async def delete(self, session_id: str) -> bool:
        """True when a session was deleted; deleting a missing one is not an error."""

    @abstractmethod
    async def list_sessions(self, limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        """Newest `updated_at` first, without loading messages."""

    @abstractmethod
    async def is_message_processed(self, key: str) -> bool: ...

    @abstractmethod
    async def mark_message_processed(self, key: str, platform: str = "") -> bool:
        """True only for the first caller for `key` within its TTL, even under concurrency."""

    @abstractmethod
    async def purge_expired(self) -> int:
        """Delete expired dedup keys; return how many."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook; most stores own nothing
        """Release what the store owns (an engine it created)."""
