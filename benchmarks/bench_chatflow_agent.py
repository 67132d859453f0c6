"""The baseline side: the comparison measurements on chatflow-agent 0.3.4.

Runs inside the benchmark's own virtualenv (benchmarks/.venv-baseline, made by run.py), never in
the project's: it imports only ``chatflow_agent`` and the standard library. run.py starts it as

    benchmarks/.venv-baseline/bin/python -I benchmarks/bench_chatflow_agent.py '<params as JSON>'

It first prints a JSON line with the library's version, then serves run.py: for each metric name
read from stdin (one a line) it runs one measurement and prints a JSON line with the rate per second.
So run.py can interleave the two sides measurement by measurement.

chatflow-agent has no offline engine, so `FixedReplyEngine` implements its `BaseEngine` and always
answers the same text; the gateway side uses the equivalent fixed-reply `Model`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chatflow_agent
from chatflow_agent import Agent, Message, Role, Runner, SessionStore, SQLiteSessionStore
from chatflow_agent.core.engines.base import BaseEngine, EngineTurnResult


class FixedReplyEngine(BaseEngine):
    """An engine that costs nothing: the same text reply to every turn, no tool calls."""

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def generate_turn_async(self, agent: Agent, history: list[Message]) -> EngineTurnResult:
        return EngineTurnResult(text=self.reply)


def make_agent(params: dict[str, Any]) -> Agent:
    return Agent(name=params["agent_name"], instructions=params["instructions"])


def persisted_messages_per_second(params: dict[str, Any], workdir: Path) -> float:
    """Append a turn's USER and MODEL messages one by one, as the runner does (add_message each)."""
    store = SQLiteSessionStore(workdir / "persist.db", default_max_turns=params["max_turns"])
    session = store.get_or_create("persist-session", make_agent(params))

    def one_turn(i: int) -> None:
        session.add_message(Message(role=Role.USER, content=params["user_text"].format(i=i)))
        session.add_message(Message(role=Role.MODEL, content=params["reply"]))

    for i in range(params["persist_warmup_turns"]):
        one_turn(i)
    turns: int = params["persist_turns"]
    started = time.perf_counter()
    for i in range(turns):
        one_turn(i)
    elapsed = time.perf_counter() - started
    return 2 * turns / elapsed


def dedup_marks_per_second(params: dict[str, Any], workdir: Path) -> float:
    """record_processed_message on distinct keys; each must be reported new."""
    store = SQLiteSessionStore(workdir / "dedup.db")
    for i in range(params["dedup_warmup"]):
        if not store.record_processed_message(f"warmup-{i}"):
            raise AssertionError("a new key was reported as a duplicate")
    count: int = params["dedup_marks"]
    keys = [f"wamid.bench-{i}" for i in range(count)]
    started = time.perf_counter()
    for key in keys:
        if not store.record_processed_message(key):
            raise AssertionError("a new key was reported as a duplicate")
    elapsed = time.perf_counter() - started
    return count / elapsed


async def _turns_per_second(runner: Runner, params: dict[str, Any], turns: int) -> float:
    session_id = "turns-session"
    for i in range(params["turns_warmup"]):
        await runner.run_async(session_id, params["user_text"].format(i=i))
    started = time.perf_counter()
    for i in range(turns):
        response = await runner.run_async(session_id, params["user_text"].format(i=i))
        if response.content != params["reply"]:
            raise AssertionError(f"unexpected reply {response.content!r}")
    elapsed = time.perf_counter() - started
    return turns / elapsed


def _runner(params: dict[str, Any], store: SessionStore | SQLiteSessionStore) -> Runner:
    return Runner(make_agent(params), session_store=store, engine=FixedReplyEngine(params["reply"]))


def memory_turns_per_second(params: dict[str, Any], workdir: Path) -> float:
    """Scripted turns through the Runner, on one session already holding max_turns turns."""
    runner = _runner(params, SessionStore(default_max_turns=params["max_turns"]))
    return asyncio.run(_turns_per_second(runner, params, params["memory_turns"]))


def sqlite_turns_per_second(params: dict[str, Any], workdir: Path) -> float:
    """The same on the SQLite store (which loads the session from the file every turn)."""
    store = SQLiteSessionStore(workdir / "turns.db", default_max_turns=params["max_turns"])
    return asyncio.run(_turns_per_second(_runner(params, store), params, params["sqlite_turns"]))


METRICS: dict[str, Callable[[dict[str, Any], Path], float]] = {
    "persist_messages": persisted_messages_per_second,
    "dedup_marks": dedup_marks_per_second,
    "turns_memory": memory_turns_per_second,
    "turns_sqlite": sqlite_turns_per_second,
}


def main(argv: list[str]) -> int:
    """Announce the version, then answer one measurement per metric name read from stdin."""
    params: dict[str, Any] = json.loads(argv[1])
    print(json.dumps({"version": chatflow_agent.__version__, "metrics": sorted(METRICS)}), flush=True)
    with tempfile.TemporaryDirectory(prefix="chatflow-agent-bench-") as tmp:
        for number, line in enumerate(sys.stdin):
            metric = line.strip()
            if not metric:
                continue
            workdir = Path(tmp) / str(number)
            workdir.mkdir()
            value = METRICS[metric](params, workdir)
            print(json.dumps({"metric": metric, "value": value}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
