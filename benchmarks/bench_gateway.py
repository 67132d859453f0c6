"""Our side: the same measurements on gateway.agents, plus how a turn scales with the database.

Runs in the project's interpreter (run.py imports it). `FixedReplyModel` is the counterpart of the
baseline's fixed-reply engine: a `Model` whose `respond` returns the same MODEL message every turn,
so both sides measure the runtime and its store, not a model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import statistics
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.agents import (
    Agent,
    BaseSessionStore,
    Message,
    Role,
    Runner,
    SessionStore,
    SQLiteSessionStore,
    ToolSpec,
)
from gateway.domain.messages import utcnow
from gateway.store import migrations
from gateway.store.engine import create_engine

TURN_SIZE = 2  # a fixed-reply turn is one USER and one MODEL message
SQLITE_DATETIME = "%Y-%m-%d %H:%M:%S.%f"  # how SQLAlchemy's DateTime stores values on SQLite


class FixedReplyModel:
    """A model that costs nothing: the same text reply to every turn, no tool calls."""

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        return Message(role=Role.MODEL, content=self.reply, agent_name=agent.name)


def make_agent(params: dict[str, Any]) -> Agent:
    return Agent(
        name=params["agent_name"], instructions=params["instructions"], model=FixedReplyModel(params["reply"])
    )


# --- the comparison (one round) ------------------------------------------------------------------
async def persisted_messages_per_second(params: dict[str, Any], workdir: Path) -> float:
    """Each save persists one turn (its USER and MODEL messages), pruned to max_turns as the runner does."""
    store = SQLiteSessionStore(workdir / "persist.db", default_max_turns=params["max_turns"])
    agent = make_agent(params)
    try:
        session = await store.get_or_create("persist-session", agent)

        async def one_turn(i: int) -> None:
            session.history.append(Message(role=Role.USER, content=params["user_text"].format(i=i)))
            session.history.append(Message(role=Role.MODEL, content=params["reply"], agent_name=agent.name))
            session._prune_history()
            await store.save(session)

        for i in range(params["persist_warmup_turns"]):
            await one_turn(i)
        turns: int = params["persist_turns"]
        started = time.perf_counter()
        for i in range(turns):
            await one_turn(i)
        elapsed = time.perf_counter() - started
    finally:
        await store.aclose()
    return TURN_SIZE * turns / elapsed


async def dedup_marks_per_second(params: dict[str, Any], workdir: Path) -> float:
    """mark_message_processed on distinct keys; each must be reported new."""
    store = SQLiteSessionStore(workdir / "dedup.db")
    try:
        for i in range(params["dedup_warmup"]):
            if not await store.mark_message_processed(f"warmup-{i}"):
                raise AssertionError("a new key was reported as a duplicate")
        count: int = params["dedup_marks"]
        keys = [f"wamid.bench-{i}" for i in range(count)]
        started = time.perf_counter()
        for key in keys:
            if not await store.mark_message_processed(key):
                raise AssertionError("a new key was reported as a duplicate")
        elapsed = time.perf_counter() - started
    finally:
        await store.aclose()
    return count / elapsed


async def _turns_per_second(store: BaseSessionStore, params: dict[str, Any], turns: int) -> float:
    """Scripted turns through the Runner, on one session already holding max_turns turns."""
    runner = Runner(make_agent(params), session_store=store)
    session_id = "turns-session"
    try:
        for i in range(params["turns_warmup"]):
            await runner.run_async(session_id, params["user_text"].format(i=i))
        started = time.perf_counter()
        for i in range(turns):
            result = await runner.run_async(session_id, params["user_text"].format(i=i))
            if result.content != params["reply"]:
                raise AssertionError(f"unexpected reply {result.content!r}")
        elapsed = time.perf_counter() - started
    finally:
        await store.aclose()
    return turns / elapsed


async def memory_turns_per_second(params: dict[str, Any], workdir: Path) -> float:
    store = SessionStore(default_max_turns=params["max_turns"])
    return await _turns_per_second(store, params, params["memory_turns"])


async def sqlite_turns_per_second(params: dict[str, Any], workdir: Path) -> float:
    store = SQLiteSessionStore(workdir / "turns.db", default_max_turns=params["max_turns"])
    return await _turns_per_second(store, params, params["sqlite_turns"])


# Keyed like the baseline's metrics; each measurement returns a rate per second.
METRICS: dict[str, Callable[[dict[str, Any], Path], Coroutine[Any, Any, float]]] = {
    "persist_messages": persisted_messages_per_second,
    "dedup_marks": dedup_marks_per_second,
    "turns_memory": memory_turns_per_second,
    "turns_sqlite": sqlite_turns_per_second,
}


def measure(metric: str, params: dict[str, Any], workdir: Path) -> float:
    """One measurement of `metric`, in a fresh event loop, with its files under `workdir`."""
    return asyncio.run(METRICS[metric](params, workdir))


# --- scaling (ours only) -------------------------------------------------------------------------
@dataclass(frozen=True)
class SeededSession:
    """A session to run turns on: it holds `kept_turns` turns after `pruned_turns` were pruned."""

    session_id: str
    pruned_turns: int


def _message_rows(
    session_id: str, first_position: int, turns: int, params: dict[str, Any], stamp: str, iso: str
) -> Iterator[tuple[str, int, str, str, str]]:
    position = first_position
    for i in range(turns):
        for role, content, agent_name in (
            (Role.USER, params["user_text"].format(i=i), None),
            (Role.MODEL, params["reply"], params["agent_name"]),
        ):
            data = {
                "role": role.value,
                "content": content,
                "tool_calls": [],
                "tool_call_id": None,
                "name": None,
                "agent_name": agent_name,
                "created_at": iso,
            }
            yield (session_id, position, role.value, json.dumps(data), stamp)
            position += 1


async def _migrate(path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        await migrations.upgrade(engine)
    finally:
        await engine.dispose()


def seed_database(
    path: Path,
    params: dict[str, Any],
    filler_sessions: int,
    targets: Sequence[SeededSession],
) -> None:
    """Migrate to head, then bulk-insert `filler_sessions` small sessions and the target sessions.

    Filler sessions hold `filler_turns` turns each. A target holds max_turns turns at positions
    starting at pruned_turns * TURN_SIZE, as if that many turns had been pruned before.
    """
    asyncio.run(_migrate(path))
    now = utcnow()
    iso = now.isoformat()
    stamp = now.replace(tzinfo=None).strftime(SQLITE_DATETIME)  # utcnow() is UTC already
    filler_turns: int = params["filler_turns"]
    max_turns: int = params["max_turns"]
    first_text = params["user_text"].format(i=0)

    def session_row(session_id: str, messages: int) -> tuple[str, str, str, str, str, str, int]:
        return (session_id, params["agent_name"], first_text, "{}", stamp, stamp, messages)

    connection = sqlite3.connect(path)
    try:
        with connection:
            connection.executemany(
                "INSERT INTO chatflow_sessions (session_id, active_agent_name, title, metadata_json, "
                "created_at, updated_at, message_count) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    *(
                        session_row(f"filler-{n:06d}", filler_turns * TURN_SIZE)
                        for n in range(filler_sessions)
                    ),
                    *(session_row(t.session_id, max_turns * TURN_SIZE) for t in targets),
                ],
            )
            insert_messages = (
                "INSERT INTO chatflow_messages (session_id, position, role, message_json, created_at) "
                "VALUES (?, ?, ?, ?, ?)"
            )
            connection.executemany(
                insert_messages,
                itertools.chain(
                    *(
                        _message_rows(f"filler-{n:06d}", 0, filler_turns, params, stamp, iso)
                        for n in range(filler_sessions)
                    ),
                    *(
                        _message_rows(t.session_id, t.pruned_turns * TURN_SIZE, max_turns, params, stamp, iso)
                        for t in targets
                    ),
                ),
            )
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # start from a clean file, as after a restart
    finally:
        connection.close()


async def _check_seeded(store: SQLiteSessionStore, target: SeededSession, params: dict[str, Any]) -> None:
    """The store loads a seeded target as a full session at the seeded positions."""
    session = await store.get(target.session_id)
    expected = params["max_turns"] * TURN_SIZE
    if session is None or len(session.history) != expected:
        raise AssertionError(f"seeded session {target.session_id!r} did not load with {expected} messages")
    if session.history[0].position != target.pruned_turns * TURN_SIZE:
        raise AssertionError(f"seeded session {target.session_id!r} starts at the wrong position")


async def _one_turn(runner: Runner, session_id: str, params: dict[str, Any], i: int) -> float:
    started = time.perf_counter()
    result = await runner.run_async(session_id, params["user_text"].format(i=i))
    elapsed = time.perf_counter() - started
    if result.content != params["reply"]:
        raise AssertionError(f"unexpected reply {result.content!r}")
    return elapsed


@dataclass(frozen=True)
class Case:
    """One configuration of the scaling measurements: a database file and a session in it."""

    name: str
    path: Path
    target: SeededSession


async def _scaling_rounds(
    cases: Sequence[Case], params: dict[str, Any], rounds: int
) -> dict[str, list[float]]:
    """Each case's median turn latency (seconds) per round.

    The cases take turns one turn at a time, so the machine's noise falls on all of them alike.
    """
    stores = {
        case.path: SQLiteSessionStore(case.path, default_max_turns=params["max_turns"]) for case in cases
    }
    medians: dict[str, list[float]] = {case.name: [] for case in cases}
    try:
        runners = {}
        for case in cases:
            store = stores[case.path]
            runners[case.name] = Runner(make_agent(params), session_store=store)  # sets the agent resolver
            await _check_seeded(store, case.target, params)
        for i in range(params["scaling_warmup"]):
            for case in cases:
                await _one_turn(runners[case.name], case.target.session_id, params, i)
        for round_number in range(rounds):
            order = list(cases) if round_number % 2 == 0 else list(reversed(cases))
            latencies: dict[str, list[float]] = {case.name: [] for case in cases}
            for i in range(params["scaling_turns"]):
                for case in order:
                    latency = await _one_turn(runners[case.name], case.target.session_id, params, i)
                    latencies[case.name].append(latency)
            for name, values in latencies.items():
                medians[name].append(statistics.median(values))
    finally:
        for store in stores.values():
            await store.aclose()
    return medians


def scaling(params: dict[str, Any], workdir: Path, rounds: int) -> dict[str, list[float]]:
    """Turn latency with few vs many sessions in the database, and after few vs many pruned turns.

    Returns the per-round median latencies of the cases "sessions_small", "sessions_large",
    "pruned_few" and "pruned_many".
    """
    small_db, large_db = workdir / "sessions-small.db", workdir / "sessions-large.db"
    target = SeededSession("target", pruned_turns=0)
    pruned_few = SeededSession("pruned-few", pruned_turns=params["pruned_few"])
    pruned_many = SeededSession("pruned-many", pruned_turns=params["pruned_many"])
    small_targets, large_targets = [target, pruned_few, pruned_many], [target]
    # Filler sessions make up the rest of each database's session count.
    seed_database(small_db, params, params["sessions_small"] - len(small_targets), small_targets)
    seed_database(large_db, params, params["sessions_large"] - len(large_targets), large_targets)
    cases = [
        Case("sessions_small", small_db, target),
        Case("sessions_large", large_db, target),
        Case("pruned_few", small_db, pruned_few),
        Case("pruned_many", small_db, pruned_many),
    ]
    return asyncio.run(_scaling_rounds(cases, params, rounds))
