"""`gateway worker` as a process: answers inbox rows, stops on SIGTERM, and survives SIGKILL mid-turn."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import insert, select, update

from gateway.store import migrations
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, MessageRow, OutboxRow
from tests.helpers import GATEWAY, gateway_env

pytestmark = pytest.mark.e2e
T = TypeVar("T")

# An agent whose model hangs while the file `block` exists in the working directory.
BLOCKING_AGENT = """
import asyncio, pathlib
from gateway.agents import Agent, Message, Role

class Blocking:
    async def respond(self, agent, history, tools):
        while pathlib.Path("block").exists():
            await asyncio.sleep(0.05)
        return Message(Role.MODEL, "answer to " + (history[-1].content or ""))

agent = Agent("Blocking", "b", model=Blocking())
"""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def query(url: str, statement: Any) -> list[Any]:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(statement)
            return list(result) if result.returns_rows else []
    finally:
        await engine.dispose()


async def seed(url: str) -> None:
    engine = create_engine(url)
    await migrations.upgrade(engine)
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        await conn.execute(
            insert(InboxRow).values(
                dedup_key="tg:1:1",
                platform="telegram",
                session_id="telegram:42",
                message_id="42:1",
                kind="text",
                text="hello",
                message_json={
                    "conversation": {"platform": "telegram", "chat_id": "42"},
                    "message_id": "42:1",
                },
                status="pending",
                attempts=0,
                next_attempt_at=now,
                received_at=now,
            )
        )
    await engine.dispose()


def wait_for(url: str, statement: Any, predicate: Any, what: str) -> list[Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = run(query(url, statement))
        if predicate(rows):
            return rows
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def start_worker(cwd: Path, url: str) -> subprocess.Popen[str]:
    env = gateway_env(GATEWAY_DATABASE_URL=url, GATEWAY_AGENT="blocking_agent:agent", PYTHONPATH=str(cwd))
    return subprocess.Popen([GATEWAY, "worker"], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_worker_killed_mid_turn_leaves_exactly_one_committed_turn(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    (tmp_path / "blocking_agent.py").write_text(BLOCKING_AGENT)
    run(seed(url))
    (tmp_path / "block").touch()
    first = start_worker(tmp_path, url)
    wait_for(url, select(InboxRow.lease_owner), lambda rows: rows[0][0] is not None, "the first claim")
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    # Nothing of the turn was committed; time moves on until the dead worker's lease expires.
    assert run(query(url, select(OutboxRow.id))) == []
    run(query(url, update(InboxRow).values(lease_until=datetime.now(UTC) - timedelta(seconds=1))))
    (tmp_path / "block").unlink()
    second = start_worker(tmp_path, url)
    try:
        wait_for(url, select(InboxRow.status), lambda rows: rows == [("done",)], "the second worker's turn")
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert run(query(url, select(OutboxRow.text))) == [("answer to hello",)]
    assert len(run(query(url, select(MessageRow.id)))) == 2  # one user message, one answer


def test_sigterm_hands_a_row_in_flight_back(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    (tmp_path / "blocking_agent.py").write_text(BLOCKING_AGENT)
    run(seed(url))
    (tmp_path / "block").touch()
    worker = start_worker(tmp_path, url)
    wait_for(url, select(InboxRow.lease_owner), lambda rows: rows[0][0] is not None, "the claim")
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert run(query(url, select(InboxRow.status, InboxRow.lease_owner))) == [("pending", None)]
