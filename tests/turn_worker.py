"""Runs N concurrent echo turns on one session of a SQL store: a second process for serialization tests.

Usage: python -m tests.turn_worker DATABASE_URL SESSION_ID COUNT PREFIX
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore
from gateway.agents.models.base import ToolSpec


class EchoModel:
    """Answers 'echo:<last user text>' after yielding to the loop, so unserialized turns would interleave."""

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        last_user = next(m for m in reversed(history) if m.role is Role.USER)
        for _ in range(5):
            await asyncio.sleep(0.001)  # stands for model latency, not for synchronization
        return Message(Role.MODEL, f"echo:{last_user.content}")


async def main(url: str, session_id: str, count: int, prefix: str) -> None:
    store = SQLSessionStore(url)
    runner = Runner(Agent("Echo", "Echo.", model=EchoModel()), store)
    try:
        await asyncio.gather(*(runner.run_async(session_id, f"{prefix}{i}") for i in range(count)))
    finally:
        await store.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
