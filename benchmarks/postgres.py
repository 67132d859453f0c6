"""PostgreSQL beside the embedded SQLite file, end to end: turns/s, acks/s, and three replicas vs one.

Run from the repository root, with the project's virtualenv active and a PostgreSQL server reachable:

    python benchmarks/postgres.py [--postgres-url URL]

The load is end_to_end.py's (its fake Telegram Bot API, its minimal keep-alive client, the real
`gateway serve` with the scripted demo agent and pacing off): `--messages` (3,000) updates from
`--conversations` (500) chats, `--concurrency` (64) in flight, after a warm-up. Each round runs, in a
rotating order so none always goes first:

- **sqlite**: one `gateway serve` on its default SQLite file;
- **postgres**: one `gateway serve` on a fresh PostgreSQL database (created and dropped per round,
  next to `--postgres-url`'s, which defaults to GATEWAY_TEST_POSTGRES_URL);
- **postgres x3**: three `gateway serve` processes on one fresh database, the lanes spread over them.

Goals (issue 13): PostgreSQL >= 0.5x SQLite's turns/s and acks/s; three replicas' total turns/s >= one
replica's. Every round must also pass end_to_end.py's checks (one reply per message, in order per
conversation, every inbox row done and outbox row sent). It prints a markdown table and writes it to
benchmarks/postgres_results.md. All processes share this machine, so three replicas share its cores:
the figure shows that contention does not collapse throughput, not that replicas add capacity here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import end_to_end as e2e
from webhooks import code_version, log

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "postgres_results.md"
COMMAND = "python benchmarks/postgres.py"
GOAL_POSTGRES_RATIO = 0.5
SIDES = ("sqlite", "postgres", "postgres x3")


async def _admin(url: str, statement: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


class FreshDatabase:
    """An empty database next to `admin_url`'s, dropped on exit."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"bench_pg_{uuid.uuid4().hex[:8]}"
        base, _, _ = admin_url.rpartition("/")
        self.url = f"{base}/{self.name}"

    def __enter__(self) -> str:
        asyncio.run(_admin(self.admin_url, f'CREATE DATABASE "{self.name}"'))
        return self.url

    def __exit__(self, *exc: object) -> None:
        asyncio.run(_admin(self.admin_url, f'DROP DATABASE "{self.name}" WITH (FORCE)'))


@dataclass
class Results:
    rounds: dict[str, list[e2e.Round]]
    seconds: float


def measure(args: argparse.Namespace) -> Results:
    started = time.perf_counter()
    rounds: dict[str, list[e2e.Round]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-fake-telegram-") as tmp:
        fake = e2e.start_fake_platform(Path(tmp))
        try:
            for number in range(args.rounds):
                order = SIDES[number % 3 :] + SIDES[: number % 3]
                for side in order:
                    log(f"round {number + 1}/{args.rounds}: {side}, {args.messages:,} messages ...")
                    if side == "sqlite":
                        result = e2e.run_round(args, number, fake.url)
                    else:
                        with FreshDatabase(args.postgres_url) as url:
                            result = e2e.run_round(
                                args, number, fake.url, url, 3 if side.endswith("x3") else 1
                            )
                    log(
                        f"  {result.turns_per_second:,.0f} turns/s, {result.acks_per_second:,.0f} acks/s, "
                        f"checks {'ok' if result.passed else 'FAILED'}"
                    )
                    rounds[side].append(result)
        finally:
            fake.stop()
    return Results(rounds, time.perf_counter() - started)


def _median(rounds: list[e2e.Round], attribute: str) -> float:
    return statistics.median(getattr(r, attribute) for r in rounds)


def report(results: Results, args: argparse.Namespace) -> str:
    turns = {side: _median(rs, "turns_per_second") for side, rs in results.rounds.items()}
    acks = {side: _median(rs, "acks_per_second") for side, rs in results.rounds.items()}
    checks = {side: all(r.passed for r in rs) for side, rs in results.rounds.items()}

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    pg_turns = turns["postgres"] / turns["sqlite"]
    pg_acks = acks["postgres"] / acks["sqlite"]
    scale = turns["postgres x3"] / turns["postgres"]
    summary = [
        "| Metric | sqlite | postgres | postgres x3 | ratio | goal | result |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
        f"| Turns/s, webhook to reply (median) | {turns['sqlite']:,.0f} | {turns['postgres']:,.0f} "
        f"| {turns['postgres x3']:,.0f} ({turns['postgres x3'] / 3:,.0f} per replica) | {pg_turns:.2f}x "
        f"| postgres >= {GOAL_POSTGRES_RATIO}x sqlite | {verdict(pg_turns >= GOAL_POSTGRES_RATIO)} |",
        f"| Acks/s, all webhooks answered (median) | {acks['sqlite']:,.0f} | {acks['postgres']:,.0f} "
        f"| {acks['postgres x3']:,.0f} | {pg_acks:.2f}x | postgres >= {GOAL_POSTGRES_RATIO}x sqlite "
        f"| {verdict(pg_acks >= GOAL_POSTGRES_RATIO)} |",
        f"| Three replicas vs one (turns/s) | | {turns['postgres']:,.0f} | {turns['postgres x3']:,.0f} "
        f"| {scale:.2f}x | x3 >= one | {verdict(scale >= 1.0)} |",
        f"| Exactly one reply per message, in order; inbox done, outbox sent | {verdict(checks['sqlite'])} "
        f"| {verdict(checks['postgres'])} | {verdict(checks['postgres x3'])} | | every round "
        f"| {verdict(all(checks.values()))} |",
    ]
    detail = [
        "| Round | side | turns/s | acks/s | last reply | gateway CPU | replies | duplicates | missing "
        "| out of order | inbox | outbox |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for side, rounds in results.rounds.items():
        for number, r in enumerate(rounds):
            cpu = "n/a" if r.gateway_cpu is None else f"{r.gateway_cpu:.1f} s"
            detail.append(
                f"| {number + 1} | {side} | {r.turns_per_second:,.0f} | {r.acks_per_second:,.0f} "
                f"| {r.elapsed:.2f} s | {cpu} | {r.replies:,} | {r.duplicates} | {r.missing} "
                f"| {r.out_of_order} | {r.inbox} | {r.outbox} |"
            )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""# PostgreSQL beside SQLite, end to end

Generated by `{COMMAND}` on {when}: Python {platform.python_version()}, {platform.machine()} with \
{os.cpu_count()} CPUs, {args.rounds} rounds, {results.seconds:.0f} s, code at {code_version()}. The \
load generator, the fake platform, PostgreSQL and every gateway process share the machine.

{chr(10).join(summary)}

Load: {args.messages:,} Telegram updates per round from {args.conversations:,} chats, \
{args.concurrency} lanes (keep-alive connections, spread over the replicas), {args.warmup} warm-up \
messages first; the scripted demo agent, pacing off (see benchmarks/end_to_end.py for the client, \
the fake platform and the checks). PostgreSQL: the server on this machine, with its own settings; \
a fresh database per round.

## Every round

{chr(10).join(detail)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--postgres-url", default=os.environ.get("GATEWAY_TEST_POSTGRES_URL"))
    parser.add_argument("--messages", type=int, default=3000, help="messages per round (default 3,000)")
    parser.add_argument("--conversations", type=int, default=500, help="distinct chats (default 500)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent posts (default 64)")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up messages per round (default 300)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    args = parser.parse_args(argv)
    if not args.postgres_url:
        parser.error("no PostgreSQL server: give --postgres-url or set GATEWAY_TEST_POSTGRES_URL")
    results = measure(args)
    text = report(results, args)
    print(text)
    args.output.write_text(text)
    passed = all(r.passed for rs in results.rounds.values() for r in rs)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
