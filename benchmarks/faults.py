"""The fault suite's report: each fault inflicted on the real `gateway serve` under a steady load, and
what became of every message. Run from the repository root with the project's virtualenv active:

    python benchmarks/faults.py                      # every scenario, then docs/reliability.md
    python benchmarks/faults.py --only platform-down --outage 600   # the issue's 10-minute outage

Each scenario starts what it needs on loopback (tests/faultkit.py): a fake Telegram Bot API, a fake
OpenAI-compatible model where the scenario needs one, a private PostgreSQL server (initdb in a
temporary folder) or an SQLite file, the schema migrated with `gateway db upgrade`, and one or two
`gateway serve --no-migrate` replicas with pacing off. Then `--conversations` chats each post "Where is
order <n>?" messages (a new n each), one every `--interval` seconds on average, in order, each after
the previous 200, 10 % of them delivered twice; a refused delivery is posted again after a backoff, as
the platform would, until the load's end plus 30 s. After `--warmup` seconds the fault starts; it
lasts `--outage` seconds (a restart, for SIGKILL); the load goes on `--after` seconds more; then the
run waits up to `--drain` seconds for every acknowledged message to be answered, stops the replicas
(SIGTERM) and counts:

- deliveries: POSTs made (first deliveries, retries and duplicates); acked: distinct messages that got
  a 200; stored: distinct messages with an inbox row; turns: committed turns (user messages in the
  sessions) for them; replies: messages the fake platform accepted for them, duplicates included;
- lost: acknowledged messages with no reply at the end; duplicated: messages with more than one reply;
- p99 ack: 99th percentile, over acknowledged messages, of the time from the first delivery to the 200
  (retries included); time to recover: from the end of the fault to the last reply to a message first
  posted before that end ("not recovered" when one of them still had none at the end).

The scenarios are short so the whole run takes a few minutes; a long fault (the issue's 10-minute
platform outage, within delivery's 24-hour retry budget) needs `--outage 600` and the matching `--drain`.

The report replaces the generated part of `--output` only: the sections written by hand below it (from
its first `## ` heading on: long runs, earlier results) are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform as platform_module
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests import faultkit as fk  # noqa: E402 - after the repository root is on the path

DEFAULT_OUTPUT = REPO_ROOT / "docs" / "reliability.md"
COMMAND = "python benchmarks/faults.py"
CHAT_BASE = 900_000_000
ORDER_BASE = 50_000_000


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Env:
    """What one scenario runs on."""

    args: argparse.Namespace
    workdir: Path
    backend: str
    platform: fk.FakeBotAPI
    model: fk.FakeModel | None = None
    postgres: fk.PrivatePostgres | None = None
    database_url: str = ""
    replicas: list[fk.GatewayProcess] = field(default_factory=list)
    driver: fk.Driver | None = None
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


Action = Callable[[Env], Any]


@dataclass(frozen=True)
class Scenario:
    name: str
    backend: str  # sqlite or postgres
    fault: str  # what is done, for the table
    inflict: Action
    end: Action
    replicas: int = 1
    model: bool = False  # the agent runs on the fake model server instead of the scripted one
    disk: bool = False  # the SQLite file on a small tmpfs of its own

    @property
    def key(self) -> str:
        return f"{self.name}/{self.backend}"


def nothing(env: Env) -> None:
    return None


def platform_mode(mode: fk.Mode) -> Action:
    return lambda env: env.platform.set_mode(mode)


def model_mode(mode: fk.Mode) -> Action:
    def switch(env: Env) -> None:
        assert env.model is not None
        env.model.set_mode(mode)

    return switch


def pg(method: str) -> Action:
    return lambda env: getattr(env.postgres, method)()


async def kill_replica(env: Env) -> None:
    """SIGKILL replica 0 as soon as it holds a lease (within 5 s), so the kill strands work."""
    victim = env.replicas[0]
    assert victim.process is not None
    pid = victim.process.pid
    deadline = time.monotonic() + 5
    held = await fk.leased_rows(env.database_url, victim.owner_prefix(pid))
    while held == (0, 0) and time.monotonic() < deadline:
        held = await fk.leased_rows(env.database_url, victim.owner_prefix(pid))
    victim.kill()
    env.notes.append(f"killed holding {held[0]} inbox and {held[1]} outbox leases")


def stop_replica(env: Env) -> None:
    victim = env.replicas[0]
    assert victim.process is not None
    env.state["stopped_pid"] = victim.process.pid
    code = victim.stop()
    env.notes.append(f"SIGTERMed replica exited {code}")


def restart_replica(env: Env) -> None:
    env.replicas[0].start(wait=False)
    env.notes.append("the replica restarted at the fault's end")


def fill_disk(env: Env) -> None:
    filler = env.workdir / "disk" / "filler"
    with filler.open("wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * (1 << 20))
            out.flush()
    env.state["filler"] = filler


def free_disk(env: Env) -> None:
    env.state["filler"].unlink()


def start_slow_clients(env: Env) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    env.state["slow_stop"] = stop
    env.state["slow_tasks"] = [
        loop.create_task(fk.slow_client(env.replicas[0].url, stop)) for _ in range(env.args.slow_clients)
    ]
    env.notes.append(f"{env.args.slow_clients} clients sending headers at 1 byte/s")


def stop_slow_clients(env: Env) -> None:
    env.state["slow_stop"].set()


def start_poison(env: Env) -> None:
    async def post_poison() -> None:
        assert env.driver is not None
        statuses: dict[str, int] = {}
        bodies = fk.poison_bodies(CHAT_BASE + 500_000, ORDER_BASE + 5_000_000)
        async with httpx.AsyncClient(
            timeout=10, headers={"X-Telegram-Bot-Api-Secret-Token": fk.SECRET}
        ) as http:
            for name, body in bodies:
                try:
                    answer = await http.post(env.replicas[0].url + fk.WEBHOOK_PATH, content=body)
                    statuses[name] = answer.status_code
                except httpx.HTTPError:
                    statuses[name] = 0
        env.state["poison"] = statuses

    env.state["poison_task"] = asyncio.get_running_loop().create_task(post_poison())


async def end_poison(env: Env) -> None:
    await env.state["poison_task"]
    failing = {name: status for name, status in env.state["poison"].items() if status != 200}
    env.notes.append(f"{len(env.state['poison'])} poison webhooks posted once; not 200: {failing or 'none'}")


SCENARIOS = [
    Scenario("no fault", "sqlite", "none (the baseline)", nothing, nothing),
    Scenario("no fault", "postgres", "none (the baseline), 2 replicas", nothing, nothing, replicas=2),
    Scenario("database stopped", "postgres", "fast shutdown, started again", pg("stop"), pg("start"), 2),
    Scenario("database frozen", "postgres", "SIGSTOP on every server process", pg("freeze"), pg("thaw"), 2),
    Scenario(
        "database crashed", "postgres", "SIGKILL on every server process, restart", pg("kill"), pg("start"), 2
    ),
    Scenario(
        "disk full", "sqlite", "the database's filesystem filled, then freed", fill_disk, free_disk, disk=True
    ),
    Scenario(
        "platform down",
        "sqlite",
        "Bot API not listening",
        platform_mode(fk.Mode.DOWN),
        platform_mode(fk.Mode.OK),
    ),
    Scenario(
        "platform 500s",
        "sqlite",
        "Bot API answers 500",
        platform_mode(fk.Mode.ERROR),
        platform_mode(fk.Mode.OK),
    ),
    Scenario(
        "platform 429",
        "sqlite",
        "Bot API answers 429, retry_after 5",
        platform_mode(fk.Mode.THROTTLED),
        platform_mode(fk.Mode.OK),
    ),
    Scenario(
        "platform hangs",
        "sqlite",
        "Bot API takes each message, never answers",
        platform_mode(fk.Mode.HANG),
        platform_mode(fk.Mode.OK),
    ),
    Scenario(
        "model down",
        "sqlite",
        "model server not listening",
        model_mode(fk.Mode.DOWN),
        model_mode(fk.Mode.OK),
        model=True,
    ),
    Scenario(
        "model 500s",
        "sqlite",
        "model server answers 500",
        model_mode(fk.Mode.ERROR),
        model_mode(fk.Mode.OK),
        model=True,
    ),
    Scenario(
        "SIGKILL mid-burst", "sqlite", "the replica SIGKILLed, restarted", kill_replica, restart_replica
    ),
    Scenario(
        "SIGKILL mid-burst",
        "postgres",
        "1 of 2 replicas SIGKILLed, restarted",
        kill_replica,
        restart_replica,
        2,
    ),
    Scenario(
        "SIGTERM mid-burst",
        "postgres",
        "1 of 2 replicas SIGTERMed (a rolling restart), restarted",
        stop_replica,
        restart_replica,
        2,
    ),
    Scenario(
        "slow clients", "sqlite", "slow-header clients on the replica", start_slow_clients, stop_slow_clients
    ),
    Scenario("poison values", "sqlite", "hostile JSON values among the load", start_poison, end_poison),
    Scenario("poison values", "postgres", "hostile JSON values among the load", start_poison, end_poison),
]


@dataclass
class Result:
    scenario: Scenario
    tally: fk.Tally | None
    seconds: float
    notes: list[str]
    skipped: str | None = None


# --- one scenario --------------------------------------------------------------------------------
def mount_tmpfs(path: Path, megabytes: int) -> str | None:
    """Mount a small tmpfs at `path`; None, or why not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "needs root to mount a small filesystem"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def run_scenario(scenario: Scenario, args: argparse.Namespace, number: int, pg_server: Any) -> Result:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-fault-"))
    env = Env(args, workdir, scenario.backend, fk.FakeBotAPI(retry_after=5))
    closers: list[Callable[[], Any]] = [env.platform.close]
    mounted = False
    try:
        if scenario.backend == "postgres":
            if pg_server is None:
                return Result(scenario, None, 0, [], skipped="no PostgreSQL binaries")
            env.postgres = pg_server
            if not pg_server.accepting():
                pg_server.start()
            env.database_url = pg_server.create_database(f"faults_{uuid.uuid4().hex[:8]}")
        elif scenario.disk:
            why = mount_tmpfs(workdir / "disk", args.disk_mb)
            if why:
                return Result(scenario, None, 0, [], skipped=why)
            mounted = True
            env.database_url = f"sqlite+aiosqlite:///{workdir / 'disk' / 'gateway.db'}"
        else:
            env.database_url = f"sqlite+aiosqlite:///{workdir / 'gateway.db'}"
        extra: dict[str, str] = {}
        if scenario.model:
            env.model = fk.FakeModel(retry_after=5)
            closers.append(env.model.close)
            extra = fk.fake_model_settings(env.model)
        fk.migrate(env.database_url, workdir)
        settings = fk.clean_env(**fk.gateway_settings(env.database_url, env.platform.api_base, **extra))
        env.replicas = [
            fk.GatewayProcess(f"replica{i}", workdir / f"replica{i}", settings)
            for i in range(scenario.replicas)
        ]
        for replica in env.replicas:
            closers.append(replica.kill)
            replica.start(wait=False)
        for replica in env.replicas:
            replica.wait_ready()
        tally = asyncio.run(load_and_fault(env, scenario, number))
        return Result(scenario, tally, time.monotonic() - started, env.notes)
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        if env.postgres is not None and not env.postgres.accepting():
            with contextlib.suppress(Exception):
                env.postgres.thaw()
                env.postgres.start()
        if mounted:
            subprocess.run(["umount", "-l", str(workdir / "disk")], check=False)
        if args.keep:
            log(f"  kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


async def load_and_fault(env: Env, scenario: Scenario, number: int) -> fk.Tally:
    args = env.args
    chats = fk.conversations(
        args.conversations,
        args.max_per_conversation,
        chat_base=CHAT_BASE + number * 10_000,
        order_base=ORDER_BASE + number * 100_000,
    )
    driver = fk.Driver([r.url for r in env.replicas], duplicate_rate=0.1, seed=number)
    env.driver = driver
    t0 = time.monotonic()
    load_end = t0 + args.warmup + args.outage + args.after
    driver.give_up_at = load_end + 30
    fault_end = 0.0

    async def fault() -> None:
        nonlocal fault_end
        await asyncio.sleep(args.warmup)  # the schedule of the fault, not a synchronization
        log(f"  fault: {scenario.fault}")
        await maybe_await(scenario.inflict(env))
        await asyncio.sleep(args.outage)
        await maybe_await(scenario.end(env))
        fault_end = time.monotonic()
        log("  fault over")

    try:
        await asyncio.gather(driver.run(chats, interval=args.interval, stop_at=load_end), fault())
    finally:
        await driver.aclose()
    acked = set(driver.acked_at)
    await asyncio.to_thread(fk.wait_answered, env.platform, acked, args.drain)
    exit_codes = await asyncio.to_thread(lambda: [r.stop() for r in env.replicas])
    if any(code != 0 for code in exit_codes):
        env.notes.append(f"exit codes after SIGTERM: {exit_codes}")
    counts = await fk.database_counts(env.database_url, [chat[0].chat_id for chat in chats])
    result = fk.tally(driver, env.platform, chats, counts, fault_end=fault_end)
    refused = {status: n for status, n in driver.statuses().items() if status != 200}
    if refused:
        env.notes.append(f"refused deliveries by status (0: no answer): {refused}")
    if result.out_of_order:
        env.notes.append(f"{result.out_of_order} chats answered out of order")
    if result.extra_turns:
        env.notes.append(f"{result.extra_turns} turns beyond one per message")
    if result.acked < len(driver.posted()):
        env.notes.append(f"{len(driver.posted()) - result.acked} messages never acknowledged")
    inbox = {k: v for k, v in counts.inbox.items() if k != "done"}
    outbox = {k: v for k, v in counts.outbox.items() if k != "sent"}
    if inbox or outbox:
        env.notes.append(f"left: inbox {inbox}, outbox {outbox}")
    if counts.pending:
        names = {str(pid): f"{r.name} process {n + 1}" for r in env.replicas for n, pid in enumerate(r.pids)}
        why = {}
        for reason, count in counts.pending.items():
            pid = reason.removeprefix("leased to pid ")
            why[f"leased to {names.get(pid, 'pid ' + pid)}" if pid != reason else reason] = count
        env.notes.append(f"pending rows: {why}")
    return result


async def maybe_await(value: Any) -> None:
    if asyncio.iscoroutine(value):
        await value


# --- the report ----------------------------------------------------------------------------------
HEADER = [
    "Fault",
    "Backend",
    "What is done",
    "Deliveries",
    "Acked",
    "Stored",
    "Turns",
    "Replies",
    "Lost",
    "Duplicated",
    "p99 ack",
    "Time to recover",
    "Notes",
]


def table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * 3 + "---:|" * 9 + "---|"]
    for r in results:
        s = r.scenario
        if r.tally is None:
            cells = ["skipped"] * 9
            notes = r.skipped or ""
        else:
            cells = r.tally.row()
            notes = "; ".join(r.notes)
        lines.append("| " + " | ".join([s.name, s.backend, s.fault, *cells, notes.replace("|", "/")]) + " |")
    return "\n".join(lines)


def code_version() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "gateway"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    version = done.stdout.strip() or "unknown"
    return version + (" (gateway/ modified)" if dirty.stdout.strip() else "")


def report(results: list[Result], args: argparse.Namespace, seconds: float) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""# Reliability: what each fault does to the messages

Generated by `{COMMAND}` on {when} at commit {code_version()}: Python \
{platform_module.python_version()}, {platform_module.machine()} with {os.cpu_count()} CPUs (shared), \
{seconds:.0f} s in all. Each scenario: {args.conversations} conversations, a message every \
{args.interval:g} s on average in each (in order, each after the previous 200, 10 % delivered twice), \
the fault after {args.warmup:g} s for {args.outage:g} s, load {args.after:g} s more, then up to \
{args.drain:g} s for the replies.
{f"{chr(10)}**{args.label}**{chr(10)}" if args.label else ""}
{table(results)}

- **Deliveries**: POSTs made (first deliveries, retries of refused ones, duplicates). **Acked**: \
distinct messages that got a 200. **Stored**: distinct messages with an inbox row. **Turns**: \
committed turns for them (user messages in their sessions). **Replies**: messages the fake platform \
accepted for them, duplicates included.
- **Lost**: acknowledged messages with no reply at the end of the run. **Duplicated**: messages \
with more than one reply. **p99 ack**: from a message's first delivery to its 200, retries included. \
**Time to recover**: from the fault's end to the last reply to a message first posted before it; \
"not recovered" when one of them had none at the end.
- **Inherent duplicates**: when the platform accepts a message and its answer never reaches us \
("platform hangs": the fake records each message as delivered, then never answers), the gateway \
cannot know the message arrived and sends it again after its timeout: at-least-once delivery makes \
that duplicate unavoidable, and the table counts it. The same holds for a crash between a \
platform's 200 and our commit of `sent` (SIGKILL), a window of milliseconds, and for a database \
that fails while a reply's `sent` is being recorded ("database crashed": the row is sent again when \
its lease expires).
- Each row is one run: how many messages a fault catches in flight (a turn running, a reply being \
sent) varies from run to run, so losses and duplicates are the figures to read, not their exact size.
- The outages here are short (`--outage`, {args.outage:g} s) so the whole run takes minutes. The \
issue's 10-minute platform outage is `--only "platform down" --outage 600 --drain 900`: delivery \
retries transient failures for GATEWAY_DELIVERY_RETRY_HOURS (24 h) from the first, at most 10 minutes \
apart, so the drain must cover the last backoff.
- How it runs: `tests/faultkit.py` (real `gateway serve` processes, a private PostgreSQL server, \
fake Bot API and model servers switched at run time, the load driver and the accounting); this \
file's scenarios are in `benchmarks/faults.py`. The database faults on PostgreSQL (stopped, \
frozen, crashed) are also asserted, not only counted, by `tests/e2e/test_postgres_faults.py`.
"""


def kept_sections(path: Path) -> str:
    """What `path` holds from its first `## ` heading on: the hand-written sections the generated
    report (which has none) must not overwrite. Empty when the file is new."""
    if not path.exists():
        return ""
    old = path.read_text(encoding="utf-8")
    start = old.find("\n## ")
    return "" if start < 0 else old[start:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", action="append", help="run this scenario (its name; repeatable)")
    parser.add_argument("--backend", choices=["sqlite", "postgres"], help="only this backend's scenarios")
    parser.add_argument("--outage", type=float, default=8.0, help="seconds each fault lasts (default 8)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before it (default 3)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of load after it (default 3)")
    parser.add_argument("--drain", type=float, default=45.0, help="seconds to wait for replies (default 45)")
    parser.add_argument("--conversations", type=int, default=20, help="chats (default 20)")
    parser.add_argument(
        "--interval", type=float, default=1.5, help="seconds between a chat's messages (default 1.5)"
    )
    parser.add_argument("--slow-clients", type=int, default=300, help="slow clients (default 300)")
    parser.add_argument("--disk-mb", type=int, default=48, help="size of the disk-full filesystem")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--keep", action="store_true", help="keep each scenario's folder (logs)")
    parser.add_argument("--label", default="", help="a sentence printed in bold above the table")
    args = parser.parse_args(argv)
    duration = args.warmup + args.outage + args.after
    # A chat posts about duration / interval messages: stay under max_turns (40) so none is pruned.
    args.max_per_conversation = min(35, int(duration / args.interval * 1.6) + 2)
    chosen = [
        s
        for s in SCENARIOS
        if (not args.only or s.name in args.only) and (not args.backend or s.backend == args.backend)
    ]
    if not chosen:
        parser.error(f"no scenario matches; names: {sorted({s.name for s in SCENARIOS})}")
    started = time.monotonic()
    pg_server = None
    if any(s.backend == "postgres" for s in chosen) and fk.postgres_bin() is not None:
        pg_server = fk.PrivatePostgres()
        pg_server.start()
    results = []
    try:
        for number, scenario in enumerate(chosen):
            log(f"{scenario.key} ...")
            result = run_scenario(scenario, args, number, pg_server)
            results.append(result)
            log(f"  {result.tally.row() if result.tally else result.skipped}  ({result.seconds:.0f} s)")
    finally:
        if pg_server is not None:
            pg_server.close()
    text = report(results, args, time.monotonic() - started)
    print(table(results))
    if not args.no_write:
        args.output.write_text(text + kept_sections(args.output), encoding="utf-8")
        log(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
