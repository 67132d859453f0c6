"""Claim latency against the backlog: does finding the next message cost the same whatever waits?

Run from the repository root, with the project's virtualenv active:

    python benchmarks/claim_cost.py [--postgres-url URL] [--backlogs 1000,10000,100000]

For each backlog size and backend (a fresh SQLite file, and a fresh PostgreSQL database when
`--postgres-url` is given or GATEWAY_TEST_POSTGRES_URL is set), it stores that many pending messages
over `--conversations` chats through the webhooks' own ingest path (gateway.store.ingest), then leases
the oldest message of every conversation to another worker, the normal state under load: every
conversation has a turn running and a backlog waiting behind it. It then times, in-process:

- **empty claim**: `inbox.claim(limit=32)` when nothing is claimable (every conversation is held):
  the claim a busy worker makes most often;
- **claim 32**: the same claim when 32 conversations have just been handed back (their leases
  released), which takes their next messages.

The goal (issue 13): the 100,000-row figure at most 2x the 1,000-row figure, on each backend. It
prints a markdown table and writes it to benchmarks/claim_cost_results.md.
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
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from gateway.domain.inbound import ConversationKey, InboundMessage, MessageKind, ParsedUpdate  # noqa: E402
from gateway.store import inbox, migrations  # noqa: E402
from gateway.store.database import Database  # noqa: E402
from gateway.store.engine import create_engine  # noqa: E402
from gateway.store.ingest import Ingest  # noqa: E402

DEFAULT_OUTPUT = HERE / "claim_cost_results.md"
COMMAND = "python benchmarks/claim_cost.py"
GOAL_RATIO = 2.0
LEASE = timedelta(minutes=10)
PER_UPDATE = 500  # messages per ingest write while filling the backlog
SAMPLES = 30


def message(number: int, conversations: int) -> InboundMessage:
    chat = str(900_000_000 + number % conversations)
    return InboundMessage(
        platform="telegram",
        message_id=str(number),
        dedup_key=f"telegram:bench:{number}",
        conversation=ConversationKey("telegram", chat),
        kind=MessageKind.TEXT,
        timestamp=datetime.now(UTC),
        user_id=chat,
        text=f"Where is order {number}?",
    )


async def fill(db: Database, rows: int, conversations: int) -> None:
    ingest = Ingest(db, timedelta(hours=192), timeout=600)
    for start in range(0, rows, PER_UPDATE):
        batch = [message(n, conversations) for n in range(start, min(rows, start + PER_UPDATE))]
        await ingest.write(ParsedUpdate(messages=batch), [True] * len(batch))


async def timed(action: object) -> float:
    started = time.perf_counter()
    await action  # type: ignore[misc]
    return (time.perf_counter() - started) * 1000


async def measure(url: str, rows: int, conversations: int) -> tuple[float, float]:
    """(median empty-claim ms, median claim-32 ms) on a fresh database at `url`."""
    db = Database.open(url)
    try:
        await migrations.upgrade(db)
        await fill(db, rows, conversations)
        held = await inbox.claim(db, "holder", LEASE, conversations)  # every conversation's head
        if len(held) != conversations:
            raise SystemExit(f"expected {conversations} heads leased, got {len(held)}")
        for _ in range(3):  # warm the caches and the statement cache
            await inbox.claim(db, "bench", LEASE, 32)
        empty = [await timed(inbox.claim(db, "bench", LEASE, 32)) for _ in range(SAMPLES)]
        full = []
        for sample in range(SAMPLES // 3):
            handed_back = held[sample * 32 : (sample + 1) * 32]
            await inbox.release_many(db, [m.id for m in handed_back], "holder")
            started = time.perf_counter()
            got = await inbox.claim(db, "bench", LEASE, 32)
            full.append((time.perf_counter() - started) * 1000)
            if len(got) != len(handed_back):
                raise SystemExit(f"claim 32 took {len(got)} messages")
        return statistics.median(empty), statistics.median(full)
    finally:
        await db.aclose()


async def with_postgres_database(admin_url: str, rows: int, conversations: int) -> tuple[float, float]:
    name = f"bench_claims_{uuid.uuid4().hex[:8]}"
    admin = create_engine(make_url(admin_url), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
            return await measure(url, rows, conversations)
        finally:
            async with admin.connect() as conn:
                await conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


async def with_sqlite_file(rows: int, conversations: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-claims-") as tmp:
        return await measure(f"sqlite+aiosqlite:///{tmp}/gateway.db", rows, conversations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--postgres-url", default=os.environ.get("GATEWAY_TEST_POSTGRES_URL"))
    parser.add_argument("--backlogs", default="1000,10000,100000", help="pending rows, comma-separated")
    parser.add_argument("--conversations", type=int, default=500, help="chats the backlog is spread over")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    backlogs = [int(n) for n in args.backlogs.split(",")]
    backends = ["sqlite"] + (["postgres"] if args.postgres_url else [])
    figures: dict[tuple[str, int], tuple[float, float]] = {}
    for backend in backends:
        for rows in backlogs:
            print(f"{backend}: {rows:,} pending rows ...", file=sys.stderr, flush=True)
            if backend == "sqlite":
                result = asyncio.run(with_sqlite_file(rows, args.conversations))
            else:
                result = asyncio.run(with_postgres_database(args.postgres_url, rows, args.conversations))
            figures[backend, rows] = result
            print(f"  empty claim {result[0]:.2f} ms, claim 32 {result[1]:.2f} ms", file=sys.stderr)
    lines = [
        "| backend | pending rows | empty claim (median) | claim 32 (median) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for (backend, rows), (empty, full) in figures.items():
        lines.append(f"| {backend} | {rows:,} | {empty:.2f} ms | {full:.2f} ms |")
    low, high = min(backlogs), max(backlogs)
    verdicts = []
    for backend in backends:
        for which, index in (("empty claim", 0), ("claim 32", 1)):
            ratio = figures[backend, high][index] / figures[backend, low][index]
            verdict = "PASS" if ratio <= GOAL_RATIO else "FAIL"
            verdicts.append(f"| {backend} | {which} | {ratio:.2f}x | <= {GOAL_RATIO:g}x | {verdict} |")
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    report = f"""# Claim latency against the backlog

Generated by `{COMMAND}` on {when}: Python {platform.python_version()}, {platform.machine()} with \
{os.cpu_count()} CPUs, {args.conversations} conversations, every conversation's oldest message leased \
to another worker; medians of {SAMPLES} empty claims and {SAMPLES // 3} claims of 32.

{chr(10).join(lines)}

| backend | claim | {high:,} rows / {low:,} rows | goal | result |
| --- | --- | ---: | --- | --- |
{chr(10).join(verdicts)}
"""
    print(report)
    args.output.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
