"""Many turns of sessions sharing an SQLite lock bucket, each running a sync tool, all finish.

Before the in-process bucket lock, each waiting turn blocked a default-executor thread in flock(); with
more waiters than threads the holders' sync tools (run in that executor) never got one: every turn stopped.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from gateway.agents import Agent, Message, Role, Runner, SQLSessionStore, ToolCall
from gateway.agents.models.base import ToolSpec
from gateway.agents.tools import Tool
from gateway.store import session_locks

EXECUTOR_THREADS = 4
TURNS = 12  # three times the executor's threads


class ToolThenReply:
    """Calls `lookup` first, then answers with what it returned."""

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        last = history[-1]
        if last.role is Role.TOOL:
            return Message(Role.MODEL, f"found {last.content}")
        await asyncio.sleep(0)  # let the other turns reach the lock meanwhile
        return Message(Role.MODEL, None, tool_calls=[ToolCall("call_1", "lookup", {})])


def lookup() -> str:
    return "it"


def sessions_in_one_bucket(count: int) -> list[str]:
    target = session_locks._bucket("telegram:0")
    found = (f"telegram:{n}" for n in itertools.count() if session_locks._bucket(f"telegram:{n}") == target)
    return list(itertools.islice(found, count))


async def test_turns_sharing_a_bucket_all_finish(sqlite_url: str) -> None:
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(EXECUTOR_THREADS))
    tool = Tool(name="lookup", description="Look it up.", parameters={"type": "object"}, function=lookup)
    store = SQLSessionStore(sqlite_url)
    runner = Runner(Agent("Desk", "Help.", model=ToolThenReply(), tools=[tool]), store)
    try:
        async with asyncio.timeout(60):  # a failure guard: the turns deadlocked without the fix
            results = await asyncio.gather(
                *(runner.run_async(session, "hi") for session in sessions_in_one_bucket(TURNS))
            )
    finally:
        await store.aclose()
    assert [result.content for result in results] == ["found it"] * TURNS


def bucket_file_is_free(store: SQLSessionStore, session_id: str) -> bool:
    """What another process would find: can it take the flock of the session's bucket now?"""
    assert store.database.sqlite_file is not None
    path = store.database.sqlite_file.with_suffix(".locks") / f"{session_locks._bucket(session_id)}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


async def test_a_bucket_is_shared_within_the_process_and_exclusive_across(sqlite_url: str) -> None:
    first, second = sessions_in_one_bucket(2)
    store = SQLSessionStore(sqlite_url)
    try:
        async with asyncio.timeout(30):  # a failure guard: the second session must not wait
            async with store.session_lock(first):
                assert not bucket_file_is_free(store, first)
                async with store.session_lock(second):
                    assert not bucket_file_is_free(store, second)
                assert not bucket_file_is_free(store, first)  # still held for the first session
        assert bucket_file_is_free(store, first)
    finally:
        await store.aclose()


async def test_turns_of_one_session_in_one_process_go_one_at_a_time(sqlite_url: str) -> None:
    store = SQLSessionStore(sqlite_url)
    inside: list[str] = []
    try:

        async def turn(name: str, entered: asyncio.Event, leave: asyncio.Event) -> None:
            async with store.session_lock("telegram:7"):
                inside.append(name)
                entered.set()
                await leave.wait()
                inside.remove(name)

        first_in, second_in, leave = asyncio.Event(), asyncio.Event(), asyncio.Event()
        async with asyncio.timeout(30):
            first = asyncio.create_task(turn("first", first_in, leave))
            await first_in.wait()
            second = asyncio.create_task(turn("second", second_in, leave))
            await asyncio.sleep(0)
            assert inside == ["first"]  # the second waits for the session
            leave.set()
            await asyncio.gather(first, second)
        assert second_in.is_set()
    finally:
        await store.aclose()
