"""The in-memory store: for tests, scripts and single-process bots that may forget on restart."""

from __future__ import annotations

from typing import Any

from gateway.agents.agent import Agent
from gateway.agents.context import DEFAULT_MAX_TURNS, DEFAULT_TITLE, SessionContext
from gateway.agents.stores.base import (
    DEFAULT_DEDUP_TTL_HOURS,
    BaseSessionStore,
    SessionDeletedError,
    SessionInfo,
)
from gateway.domain.messages import utcnow
from gateway.domain.sessions import StoredVersion


class SessionStore(BaseSessionStore):
    """Sessions and dedup keys in dicts. Safe under concurrent tasks: no await splits an update."""

    save_may_suspend = False

    def __init__(
        self,
        default_max_turns: int = DEFAULT_MAX_TURNS,
        dedup_ttl_hours: float = DEFAULT_DEDUP_TTL_HOURS,
        *,
        default_title: str = DEFAULT_TITLE,
    ) -> None:
        super().__init__(default_max_turns, dedup_ttl_hours, default_title=default_title)
        self._sessions: dict[str, SessionContext] = {}
        self._processed: dict[str, Any] = {}

    async def get_or_create(
        self,
        session_id: str,
        default_agent: Agent,
        *,
        metadata: dict[str, Any] | None = None,
        max_turns: int | None = None,
        stored: StoredVersion | None = None,
    ) -> SessionContext:
        session = self._sessions.get(session_id)
        if session is None:
            return SessionContext(session_id, default_agent, max_turns or self.default_max_turns, metadata)
        if metadata:
            session.metadata.update(metadata)
        return session

    async def get(self, session_id: str) -> SessionContext | None:
        return self._sessions.get(session_id)

    async def save(self, session: SessionContext, also: object | None = None) -> None:
        if also is not None:
            raise TypeError("the in-memory store has no inbox to commit; use an SQL store")
        stored = self._sessions.get(session.session_id)
        if session._is_new and stored is None:
            self._sessions[session.session_id] = session
            session._is_new = False
        elif stored is not session:
            raise SessionDeletedError(session.session_id)
        # The session object itself is what is stored: no positions to track, nothing to copy.
        if session.title is None:
            session.title = self._title_for(session)
        session.updated_at = utcnow()

    async def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    async def list_sessions(self, limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        newest = sorted(self._sessions.values(), key=lambda s: (s.updated_at, s.session_id), reverse=True)
        return [
            SessionInfo(
                session_id=s.session_id,
                title=s.title,
                active_agent_name=s.active_agent.name,
                created_at=s.created_at,
                updated_at=s.updated_at,
                message_count=len(s.history),
                metadata=dict(s.metadata),
            )
            for s in newest[offset : offset + limit]
        ]

    async def is_message_processed(self, key: str) -> bool:
        expires = self._processed.get(key)
        return expires is not None and expires > utcnow()

    async def mark_message_processed(self, key: str, platform: str = "") -> bool:
        now = utcnow()
        expires = self._processed.get(key)
        if expires is not None and expires > now:
            return False
        self._processed[key] = now + self.dedup_ttl
        return True

    async def purge_expired(self) -> int:
        now = utcnow()
        expired = [key for key, expires in self._processed.items() if expires <= now]
        for key in expired:
            del self._processed[key]
        return len(expired)
