"""Benchmarks of the agent runtime (gateway.agents), side by side with chatflow-agent 0.3.4.

Run from the repository root, with the project's virtualenv active (or call its python directly):

    python benchmarks/run.py

It prints a markdown table to stdout (progress goes to stderr) and writes it, with the workload and
every round's figures, to benchmarks/results.md. Options: ``--rounds N`` (default 5), ``--output
PATH``, ``--baseline-venv PATH``. A full run takes about a minute on 2 cores.

chatflow-agent is never a dependency of the project: the first run creates benchmarks/.venv-baseline
(``python -m venv`` + ``pip install chatflow-agent==0.3.4``, git-ignored) and later runs reuse it.
Its measurements run there in a subprocess (bench_chatflow_agent.py, which reports JSON); ours run
in this interpreter (bench_gateway.py). Each round runs every measurement on both sides back to back,
alternating which goes first, so a noisy neighbour hurts both alike; the table shows the median over
the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BASELINE_PACKAGE = "chatflow-agent"
BASELINE_VERSION = "0.3.4"
BASELINE_SCRIPT = HERE / "bench_chatflow_agent.py"
DEFAULT_VENV = HERE / ".venv-baseline"
DEFAULT_OUTPUT = HERE / "results.md"
COMMAND = "python benchmarks/run.py"

# The workload, the same for both sides (bench_chatflow_agent.py receives it as JSON).
PARAMS: dict[str, Any] = {
    "agent_name": "Support",
    "instructions": "You are Acme's friendly support assistant.",
    "reply": "Thanks for your message! Our team will get back to you shortly.",
    "user_text": "Hi, where is my order number {i}? It has not arrived yet.",
    "max_turns": 40,  # both libraries' default
    "persist_warmup_turns": 20,
    "persist_turns": 250,
    "dedup_warmup": 20,
    "dedup_marks": 500,
    "turns_warmup": 40,  # fills the session to max_turns before timing: every timed turn prunes one
    "memory_turns": 2000,
    "sqlite_turns": 200,
    # scaling, ours only
    "filler_turns": 2,
    "sessions_small": 1_000,
    "sessions_large": 100_000,
    "pruned_few": 10,
    "pruned_many": 10_000,
    "scaling_warmup": 10,
    "scaling_turns": 100,
}


@dataclass(frozen=True)
class Comparison:
    key: str
    label: str
    goal: float  # ours / theirs must be at least this


COMPARISONS = (
    Comparison("persist_messages", "Persisted messages/s (SQLite file)", 5.0),
    Comparison("dedup_marks", "Dedup marks/s (SQLite file, distinct keys)", 5.0),
    Comparison("turns_memory", "Scripted turns/s through the Runner (memory store)", 3.0),
    Comparison("turns_sqlite", "Scripted turns/s through the Runner (SQLite file store)", 3.0),
)


@dataclass(frozen=True)
class Scaling:
    label: str
    small: str
    large: str
    small_label: str
    large_label: str
    goal: float  # median latency large / small must be at most this


SCALINGS = (
    Scaling(
        "Turn latency (SQLite file), 100,000 vs 1,000 sessions in the database",
        "sessions_small",
        "sessions_large",
        f"{PARAMS['sessions_small']:,} sessions",
        f"{PARAMS['sessions_large']:,} sessions",
        1.3,
    ),
    Scaling(
        "Turn latency (SQLite file), 10,000 vs 10 turns pruned from the session",
        "pruned_few",
        "pruned_many",
        f"{PARAMS['pruned_few']:,} pruned",
        f"{PARAMS['pruned_many']:,} pruned",
        1.3,
    ),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the baseline's virtualenv ------------------------------------------------------------------
def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def installed_version(python: Path) -> str | None:
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-I", "-c", f"import importlib.metadata as m; print(m.version({BASELINE_PACKAGE!r}))"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure_baseline_venv(venv: Path) -> Path:
    """The python of a virtualenv holding chatflow-agent==0.3.4, created or repaired as needed."""
    python = venv_python(venv)
    if installed_version(python) == BASELINE_VERSION:
        return python
    if not python.exists():
        log(f"creating {venv} ...")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log(f"installing {BASELINE_PACKAGE}=={BASELINE_VERSION} into {venv} ...")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{BASELINE_PACKAGE}=={BASELINE_VERSION}"],
        check=True,
    )
    found = installed_version(python)
    if found != BASELINE_VERSION:
        raise SystemExit(f"{venv} holds {BASELINE_PACKAGE} {found}, not {BASELINE_VERSION}")
    return python


class Baseline:
    """bench_chatflow_agent.py in the baseline's virtualenv, isolated (-I) from this environment.

    A long-lived worker: each metric name written to it runs one measurement there.
    """

    def __init__(self, python: Path) -> None:
        self._process = subprocess.Popen(
            [str(python), "-I", str(BASELINE_SCRIPT), json.dumps(PARAMS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        if hello.get("version") != BASELINE_VERSION:
            self.close()
            raise SystemExit(
                f"the baseline runs chatflow-agent {hello.get('version')}, not {BASELINE_VERSION}"
            )

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise SystemExit(f"the baseline worker stopped (exit code {self._process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def measure(self, metric: str) -> float:
        assert self._process.stdin is not None
        self._process.stdin.write(metric + "\n")
        self._process.stdin.flush()
        answer = self._read()
        if answer.get("metric") != metric:
            raise SystemExit(f"the baseline answered {answer!r} to {metric!r}")
        return float(answer["value"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=60)


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class Results:
    ours: dict[str, list[float]]
    theirs: dict[str, list[float]]
    scaling: dict[str, list[float]]  # per-round median turn latency, seconds
    seconds: float


def measure(rounds: int, python: Path) -> Results:
    """Every comparison measurement `rounds` times, the two sides back to back, then the scaling."""
    import bench_gateway  # the project's code: imported here, so --help works anywhere

    started = time.perf_counter()
    ours: dict[str, list[float]] = {c.key: [] for c in COMPARISONS}
    theirs: dict[str, list[float]] = {c.key: [] for c in COMPARISONS}
    baseline = Baseline(python)
    try:
        with tempfile.TemporaryDirectory(prefix="chatflow-gateway-bench-") as tmp:
            for round_number in range(rounds):
                log(f"comparison round {round_number + 1}/{rounds} ...")
                for c in COMPARISONS:
                    workdir = Path(tmp) / f"{round_number}-{c.key}"
                    workdir.mkdir()

                    def run_ours(key: str = c.key, workdir: Path = workdir) -> None:
                        ours[key].append(bench_gateway.measure(key, PARAMS, workdir))

                    def run_theirs(key: str = c.key) -> None:
                        theirs[key].append(baseline.measure(key))

                    # Alternate which side goes first, so neither always follows the other's work.
                    sides: list[Callable[[], None]] = [run_ours, run_theirs]
                    for side in sides if round_number % 2 == 0 else reversed(sides):
                        side()
    finally:
        baseline.close()
    log(f"scaling: seeding {PARAMS['sessions_large']:,} sessions, then {rounds} rounds ...")
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-scaling-") as tmp:
        scaling = bench_gateway.scaling(PARAMS, Path(tmp), rounds)
    return Results(ours, theirs, scaling, time.perf_counter() - started)


# --- reporting -----------------------------------------------------------------------------------
def _rate(value: float) -> str:
    return f"{value:,.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def table(results: Results) -> str:
    lines = [
        f"| Metric | ours (chatflow-gateway) | chatflow-agent {BASELINE_VERSION} | ratio | goal | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for c in COMPARISONS:
        ours, theirs = statistics.median(results.ours[c.key]), statistics.median(results.theirs[c.key])
        ratio = ours / theirs
        verdict = "PASS" if ratio >= c.goal else "FAIL"
        lines.append(
            f"| {c.label} | {_rate(ours)} | {_rate(theirs)} | {ratio:.2f}x | ours >= {c.goal:g}x theirs "
            f"| {verdict} |"
        )
    for s in SCALINGS:
        small, large = (
            statistics.median(results.scaling[s.small]),
            statistics.median(results.scaling[s.large]),
        )
        ratio = large / small
        verdict = "PASS" if ratio <= s.goal else "FAIL"
        lines.append(
            f"| {s.label} | {_ms(large)} vs {_ms(small)} | n/a (ours only) | {ratio:.2f} "
            f"| median latency ratio <= {s.goal:g} | {verdict} |"
        )
    return "\n".join(lines)


def _rounds_line(values: list[float], fmt: Callable[[float], str]) -> str:
    return ", ".join(fmt(v) for v in values)


def report(results: Results, rounds: int) -> str:
    p = PARAMS
    detail = [
        "| Metric | side | every round |",
        "| --- | --- | --- |",
    ]
    for c in COMPARISONS:
        detail.append(f"| {c.label} | ours | {_rounds_line(results.ours[c.key], _rate)} |")
        detail.append(f"| {c.label} | chatflow-agent | {_rounds_line(results.theirs[c.key], _rate)} |")
    for s in SCALINGS:
        for case, label in ((s.small, s.small_label), (s.large, s.large_label)):
            detail.append(f"| {s.label} | ours, {label} | {_rounds_line(results.scaling[case], _ms)} |")
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""# Agent runtime benchmarks: chatflow-gateway vs chatflow-agent {BASELINE_VERSION}

Generated by `{COMMAND}` on {when}: Python {platform.python_version()}, SQLite \
{sqlite3.sqlite_version}, {platform.machine()} with {os.cpu_count()} CPUs, {rounds} rounds, \
{results.seconds:.0f} s. Each figure is the median over the rounds (rates per second; "ratio" is \
ours / theirs for rates, and many / few for latencies).

{table(results)}

## Workload

Both sides use the same agent and texts, `max_turns={p["max_turns"]}` (both libraries' default), SQLite \
files in WAL mode in a temporary directory, and a model that costs nothing: a fixed-reply engine for \
chatflow-agent (it has no offline engine), a fixed-reply `Model` for ours.

- **Persisted messages/s**: {p["persist_turns"]} turns (a USER and a MODEL message each) appended to \
one session after {p["persist_warmup_turns"]} warm-up turns. chatflow-agent: \
`SQLiteSessionContext.add_message` per message, as its runner does (a connection and a commit per \
message, with its pruning). Ours: \
`SQLiteSessionStore.save` once per turn after `_prune_history()`, as our runner does.
- **Dedup marks/s**: {p["dedup_marks"]} distinct keys, after {p["dedup_warmup"]} warm-up keys; \
`record_processed_message` vs `mark_message_processed`; every key must be reported new.
- **Scripted turns/s**: `Runner.run_async` in one event loop on one session already holding \
{p["turns_warmup"]} turns, so every timed turn also prunes one: {p["memory_turns"]} turns on the \
memory store, {p["sqlite_turns"]} on the SQLite file store.
- **Turn latency** (ours only, SQLite file store, fixed-reply model): median latency of \
{p["scaling_turns"]} `run_async` turns per round on a session holding {p["max_turns"]} turns. The \
databases are migrated to head and seeded with bulk inserts: {p["sessions_small"]:,} or \
{p["sessions_large"]:,} sessions ({p["filler_turns"]} turns each besides the measured ones); the \
pruned cases are sessions whose kept positions start at {p["pruned_few"]:,} or {p["pruned_many"]:,} \
turns, as if those had been pruned.

## Every round

{chr(10).join(detail)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every measurement (default 5)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    parser.add_argument(
        "--baseline-venv", type=Path, default=DEFAULT_VENV, help="virtualenv for chatflow-agent"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        import gateway.agents  # noqa: F401 - only checks that the project is importable
    except ImportError:
        parser.error("gateway is not importable: run this with the project's virtualenv python")
    python = ensure_baseline_venv(args.baseline_venv)
    results = measure(args.rounds, python)
    text = report(results, args.rounds)
    args.output.write_text(text, encoding="utf-8")
    print(table(results))
    log(f"done in {results.seconds:.0f} s; report written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
