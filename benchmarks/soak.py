"""Soak on PostgreSQL: a steady rate for half an hour, then a held xmin horizon under full load.

Run from the repository root, with the project's virtualenv active and a PostgreSQL server reachable:

    python benchmarks/soak.py [--postgres-url URL] [--minutes 30] [--rate 100] [--hold-seconds 180]

Both parts use end_to_end.py's fake Telegram Bot API, its keep-alive client and one real
`gateway serve` (scripted demo agent, pacing off) on a fresh PostgreSQL database: by default on a
private server started for the run with PostgreSQL's default settings (a shared test server may run
with autovacuum off, which no production server should; the report names the settings it ran with).

1. **Soak**: `--rate` messages per second from `--conversations` chats for `--minutes`. Per minute:
   the webhooks' ack p99, the replies received, the claim's lookup time (the heads query a claim runs,
   read-only: median of 5, in ms), and the size and dead rows of every table. The goal: flat ack p99
   and claim time (the second half's median of the minutes at most 1.5x the first half's plus a floor
   of noise, 1 ms and 0.5 ms) while the tables grow (done rows are kept: they are the record), with
   dead rows bounded (autovacuum keeps up).
2. **Held xmin**: as fast as the gateway answers (at most `--backlog` messages waiting for their
   reply), first `--hold-seconds` as the baseline, then as long again while another connection holds
   a REPEATABLE READ snapshot open (what a long report, `pg_dump` or an idle replication slot does):
   VACUUM can then reclaim none of the rows updated meanwhile. The goal: turns/s while held within 20 %
   of the baseline (a generic SKIP LOCKED queue lost 35 % in a public torture test). `--control` runs
   the same two parts without taking the snapshot: what the run's own drift does to the ratio. Each
   part also reports the database's page reads per turn, for the rows every turn rewrites (queue
   heads, sessions) the row updates per turn and the share of them that were HOT updates, and, on the
   private server, the CPU per turn of the database server and of the gateway (from /proc).

It prints markdown tables and writes them to benchmarks/soak_results.md.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import end_to_end as e2e
import httpx
import postgres as pg
from webhooks import code_version, log

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests import faultkit as fk  # noqa: E402 - after the repository root is on the path

DEFAULT_OUTPUT = HERE / "soak_results.md"
COMMAND = "python benchmarks/soak.py"
GOAL_HELD_RATIO = 0.8
# Flat: the second half's median at most FLAT_FACTOR x the first half's plus a floor below which one
# minute's figure on a shared 2-core machine is noise (ack p99, claim lookup; ms).
FLAT_FACTOR = 1.5
FLAT_FLOOR_MS = {"ack p99": 1.0, "claim lookup": 0.5}
TABLES = (
    "chatflow_inbox",
    "chatflow_outbox",
    "chatflow_queue_heads",
    "chatflow_processed_messages",
    "chatflow_sessions",
    "chatflow_messages",
)
CLAIM_LOOKUP = (
    "SELECT session_id FROM chatflow_queue_heads WHERE queue = 'chatflow_inbox' AND next_id IS NOT NULL "
    "AND due_at <= now() ORDER BY due_at LIMIT 32"
)
HEADERS = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": e2e.SECRET}
LANES = 64


def dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def replies_so_far(client: httpx.AsyncClient) -> int:
    summary = (await client.get("/_bench/wait", params={"count": 10**12, "timeout": 0.01})).json()
    return int(summary["total"])


async def table_figures(conn: asyncpg.Connection) -> dict[str, tuple[int, int, int]]:
    """Per table: (live rows, dead rows, bytes with indexes)."""
    rows = await conn.fetch(
        "SELECT relname, n_live_tup, n_dead_tup, pg_total_relation_size(relid) AS bytes "
        "FROM pg_stat_user_tables WHERE relname = ANY($1::text[])",
        list(TABLES),
    )
    return {r["relname"]: (r["n_live_tup"], r["n_dead_tup"], r["bytes"]) for r in rows}


async def claim_lookup_ms(conn: asyncpg.Connection) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        await conn.fetch(CLAIM_LOOKUP)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


class Poster:
    """Lanes of keep-alive connections posting numbered messages; ack latency per message."""

    def __init__(self, url: str, conversations: int) -> None:
        self.url = url
        self.conversations = conversations
        self.next = 0
        self.acks: list[tuple[float, float]] = []  # (when answered, seconds)
        self.refused = 0

    def body(self, number: int) -> bytes:
        chat = number % self.conversations
        return e2e.update_body(
            500_000_000 + number,
            e2e.CHAT_BASE + chat,
            number // self.conversations + 1,
            f"Where is order {e2e.ORDER_BASE + number}?",
        )

    async def post(self, connection: e2e.Connection, number: int) -> None:
        body = self.body(number)
        while True:
            started = time.monotonic()
            try:
                status, _ = await connection.post(e2e.WEBHOOK_PATH, body, HEADERS)
            except (OSError, asyncio.IncompleteReadError):
                status = 0
            if status == 200:
                now = time.monotonic()
                self.acks.append((now, now - started))
                return
            self.refused += 1
            await asyncio.sleep(0.1)


@dataclass
class Minute:
    at: float
    ack_p99_ms: float
    acks: int
    replies: int
    claim_ms: float
    tables: dict[str, tuple[int, int, int]] = field(default_factory=dict)


async def soak(url: str, database_url: str, fake_url: str, args: argparse.Namespace) -> list[Minute]:
    poster = Poster(url, args.conversations)
    queue: asyncio.Queue[int] = asyncio.Queue()
    minutes: list[Minute] = []

    async def lane() -> None:
        connection = e2e.Connection(url)
        while True:
            number = await queue.get()
            await poster.post(connection, number)

    lanes = [asyncio.create_task(lane()) for _ in range(LANES)]
    conn = await asyncpg.connect(dsn(database_url))
    started = time.monotonic()
    end = started + args.minutes * 60
    interval = 1 / args.rate
    async with httpx.AsyncClient(base_url=fake_url, timeout=30) as client:
        replied = await replies_so_far(client)
        next_minute = started + 60
        sent = 0
        while len(minutes) < int(args.minutes):
            now = time.monotonic()
            due = int((min(now, end) - started) / interval) - sent  # messages behind schedule
            for _ in range(max(0, due)):
                queue.put_nowait(poster.next)
                poster.next += 1
                sent += 1
            if now >= next_minute:
                window = [s for at, s in poster.acks if next_minute - 60 <= at < next_minute]
                total = await replies_so_far(client)
                minutes.append(
                    Minute(
                        at=next_minute - started,
                        ack_p99_ms=(statistics.quantiles(window, n=100)[98] * 1000) if len(window) > 1 else 0,
                        acks=len(window),
                        replies=total - replied,
                        claim_ms=await claim_lookup_ms(conn),
                        tables=await table_figures(conn),
                    )
                )
                replied = total
                m = minutes[-1]
                log(
                    f"minute {len(minutes)}: ack p99 {m.ack_p99_ms:.1f} ms, {m.acks} acks, "
                    f"{m.replies} replies, claim lookup {m.claim_ms:.2f} ms"
                )
                next_minute += 60
            await asyncio.sleep(min(interval, 0.01))
    for task in lanes:
        task.cancel()
    await asyncio.gather(*lanes, return_exceptions=True)
    await conn.close()
    return minutes


@dataclass
class Held:
    baseline: list[float]  # turns/s per 30 s window
    held: list[float]
    dead_before: dict[str, int]
    dead_after: dict[str, int]
    pages_per_turn: tuple[float, float]  # baseline, held: the database's page reads per reply
    # baseline, held: per table of UPDATED, (row updates per reply, the share of them that were HOT)
    updates: tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]
    # baseline, held: CPU ms per reply of the database server and of the gateway; None with a server
    # of --postgres-url (its processes are not known)
    cpu_per_turn: tuple[tuple[float, float], tuple[float, float]] | None = None


UPDATED = ("chatflow_queue_heads", "chatflow_sessions")


async def updates_so_far(conn: asyncpg.Connection) -> dict[str, tuple[int, int]]:
    """Row updates so far of the rows rewritten every turn, and how many were HOT (no new index
    entries): a non-HOT version adds a key entry that a held snapshot keeps for every look-up to walk."""
    rows = await conn.fetch(
        "SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = ANY($1::text[])",
        list(UPDATED),
    )
    return {r["relname"]: (r["n_tup_upd"], r["n_tup_hot_upd"]) for r in rows}


def cpu_seconds(pids: list[int], reaped_of: int | None = None) -> float:
    """User + system CPU of the live processes `pids`, plus what the reaped children of `reaped_of`
    (the postmaster) used: a backend or autovacuum worker that ends keeps counting."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
        if pid == reaped_of:
            total += int(fields[13]) + int(fields[14])
    return total / os.sysconf("SC_CLK_TCK")


CpuProbe = Callable[[], tuple[float, float]]


def cpu_probe(server: fk.PrivatePostgres, gateway_pid: int) -> CpuProbe:
    """The CPU seconds so far of `server` (the postmaster is its first pid) and of the gateway."""

    def probe() -> tuple[float, float]:
        pids = server.server_pids()
        return cpu_seconds(pids, pids[0] if pids else None), cpu_seconds([gateway_pid])

    return probe


async def pages_read(conn: asyncpg.Connection) -> int:
    """Pages the database has read so far (its statements and autovacuum), from shared buffers or not:
    what a held snapshot multiplies (each look-up walks the versions it keeps), whatever the machine's
    speed."""
    return int(
        await conn.fetchval(
            "SELECT blks_hit + blks_read FROM pg_stat_database WHERE datname = current_database()"
        )
    )


async def held_xmin(
    url: str,
    database_url: str,
    fake_url: str,
    args: argparse.Namespace,
    cpu_probe: CpuProbe | None = None,
) -> Held:
    """`cpu_probe`: the CPU seconds so far of the database server and of the gateway, when known."""
    poster = Poster(url, args.conversations)
    poster.next = 10_000_000  # other update ids than the soak's
    async with httpx.AsyncClient(base_url=fake_url, timeout=30) as client:
        first = await replies_so_far(client)
        replies = first
        posted = 0

        room = asyncio.Event()  # set while fewer than --backlog messages wait for their reply

        async def poll() -> None:
            nonlocal replies
            while True:
                replies = await replies_so_far(client)
                if posted - (replies - first) < args.backlog:
                    room.set()
                else:
                    room.clear()
                await asyncio.sleep(0.2)

        async def lane() -> None:
            nonlocal posted
            connection = e2e.Connection(url)
            while True:
                await room.wait()
                number = poster.next
                poster.next += 1
                posted += 1
                await poster.post(connection, number)

        lanes = [asyncio.create_task(lane()) for _ in range(LANES)] + [asyncio.create_task(poll())]
        stats = await asyncpg.connect(dsn(database_url))
        holder = await asyncpg.connect(dsn(database_url))

        async def measure(
            seconds: float,
        ) -> tuple[list[float], float, dict[str, tuple[float, float]], tuple[float, float] | None]:
            """Turns/s per 30 s window, the database's page reads per reply, per table of UPDATED its
            updates per reply and their HOT share, and the CPU ms per reply of the database server and
            of the gateway (None when the server's processes are not known)."""
            rates = []
            pages, first_reply = await pages_read(stats), replies
            updated = await updates_so_far(stats)
            cpu_first = cpu_probe() if cpu_probe else None
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                before, at = replies, time.monotonic()
                await asyncio.sleep(30)
                rates.append((replies - before) / (time.monotonic() - at))
                log(f"  {rates[-1]:,.0f} turns/s")
            turns = max(1, replies - first_reply)
            now_updated = await updates_so_far(stats)
            shares = {}
            for table, (total, hot) in now_updated.items():
                done, done_hot = total - updated[table][0], hot - updated[table][1]
                shares[table] = (done / turns, done_hot / max(1, done))
            cpu = None
            if cpu_probe is not None and cpu_first is not None:
                cpu_last = cpu_probe()
                cpu = (
                    (cpu_last[0] - cpu_first[0]) * 1000 / turns,
                    (cpu_last[1] - cpu_first[1]) * 1000 / turns,
                )
            return rates, (await pages_read(stats) - pages) / turns, shares, cpu

        log(f"held xmin: warm-up 30 s, baseline {args.hold_seconds:.0f} s ...")
        await measure(30)
        baseline, baseline_pages, baseline_updates, baseline_cpu = await measure(args.hold_seconds)
        dead_before = {t: f[1] for t, f in (await table_figures(stats)).items()}
        log(
            f"held xmin: {'no snapshot (control)' if args.control else 'a REPEATABLE READ snapshot held'} "
            f"for {args.hold_seconds:.0f} s ..."
        )
        transaction = holder.transaction(isolation="repeatable_read")
        await transaction.start()
        if not args.control:
            await holder.fetchval("SELECT count(*) FROM chatflow_queue_heads")  # takes the snapshot
        try:
            held, held_pages, held_updates, held_cpu = await measure(args.hold_seconds)
            dead_after = {t: f[1] for t, f in (await table_figures(stats)).items()}
        finally:
            await transaction.rollback()
        for task in lanes:
            task.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)
        await stats.close()
        await holder.close()
    return Held(
        baseline,
        held,
        dead_before,
        dead_after,
        (baseline_pages, held_pages),
        (baseline_updates, held_updates),
        None if baseline_cpu is None or held_cpu is None else (baseline_cpu, held_cpu),
    )


def report(minutes: list[Minute], held: Held | None, args: argparse.Namespace, seconds: float) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"# Soak on PostgreSQL\n\nGenerated by `{COMMAND}` on {when}: Python {platform.python_version()}, "
        f"{platform.machine()} with {os.cpu_count()} CPUs, {seconds:.0f} s, code at {code_version()}. One "
        f"`gateway serve` on a fresh database ({args.server_settings}); the load generator, the fake "
        "platform and PostgreSQL share the machine.\n"
    ]
    if minutes:
        first, last = minutes[0], minutes[-1]
        parts.append(
            f"## {args.minutes:g} minutes at {args.rate:g} messages/s from {args.conversations} chats\n\n"
            "| minute | ack p99 | acks | replies | claim lookup | "
            + " | ".join(f"{t.removeprefix('chatflow_')} rows / dead / MB" for t in TABLES)
            + " |\n| ---: | ---: | ---: | ---: | ---: | "
            + " | ".join("---:" for _ in TABLES)
            + " |"
        )
        for number, m in enumerate(minutes, 1):
            cells = " | ".join(
                f"{m.tables.get(t, (0, 0, 0))[0]:,} / {m.tables.get(t, (0, 0, 0))[1]:,} / "
                f"{m.tables.get(t, (0, 0, 0))[2] / 2**20:.1f}"
                for t in TABLES
            )
            parts.append(
                f"| {number} | {m.ack_p99_ms:.1f} ms | {m.acks:,} | {m.replies:,} | {m.claim_ms:.2f} ms "
                f"| {cells} |"
            )
        half = len(minutes) // 2
        early, late = (minutes[:half], minutes[half:]) if half else (minutes, minutes)
        early_p99 = statistics.median(m.ack_p99_ms for m in early)
        late_p99 = statistics.median(m.ack_p99_ms for m in late)
        early_claim = statistics.median(m.claim_ms for m in early)
        late_claim = statistics.median(m.claim_ms for m in late)
        flat = {
            name: "PASS" if late <= FLAT_FACTOR * early + FLAT_FLOOR_MS[name] else "FAIL"
            for name, early, late in (
                ("ack p99", early_p99, late_p99),
                ("claim lookup", early_claim, late_claim),
            )
        }
        parts.append(
            f"\nAck p99, median of the first half {early_p99:.1f} ms, of the second {late_p99:.1f} ms "
            f"(flat: {flat['ack p99']}); claim lookup {early_claim:.2f} ms then {late_claim:.2f} ms (flat: "
            f"{flat['claim lookup']}); flat means at most {FLAT_FACTOR}x the first half's plus "
            f"{FLAT_FLOOR_MS['ack p99']:g} ms and {FLAT_FLOOR_MS['claim lookup']:g} ms. Replies kept pace: "
            f"{sum(m.replies for m in minutes):,} replies to {sum(m.acks for m in minutes):,} acks "
            f"(first minute {first.replies:,}, last {last.replies:,}).\n"
        )
    if held is not None:
        base, hold = statistics.mean(held.baseline), statistics.mean(held.held)
        ratio = hold / base
        verdict = "PASS" if ratio >= GOAL_HELD_RATIO else "FAIL"
        if args.control:
            verdict = "not judged: a control run, no snapshot was held"
        dead = " ".join(
            f"`{t.removeprefix('chatflow_')}` {held.dead_before.get(t, 0):,} → {held.dead_after.get(t, 0):,};"
            for t in TABLES
        )
        windows = {
            name: ", ".join(f"{r:.0f}" for r in rates)
            for name, rates in vars(held).items()
            if name in ("baseline", "held")
        }
        parts.append(
            f"## A held xmin horizon under full load ({args.backlog} messages at most waiting)\n\n"
            "| phase | turns/s (mean of 30 s windows) | windows |\n| --- | ---: | --- |\n"
            f"| baseline, {args.hold_seconds:.0f} s | {base:,.0f} | {windows['baseline']} |\n"
            f"| {'no snapshot (control)' if args.control else 'snapshot held'}, {args.hold_seconds:.0f} s "
            f"| {hold:,.0f} | {windows['held']} |\n\n"
            f"Held / baseline: **{ratio:.2f}x** (goal >= {GOAL_HELD_RATIO}x: {verdict}). Dead rows before → "
            f"after the hold: {dead}\n\nThe database's page reads per turn (`pg_stat_database`: shared "
            "buffers hit or read, a figure that does not move with the machine's speed): baseline "
            f"{held.pages_per_turn[0]:,.0f}, {'second part' if args.control else 'held'} "
            f"{held.pages_per_turn[1]:,.0f}.\n\nRow updates per turn (the share of them that were HOT "
            "updates, which add no index entries): "
            + "; ".join(
                f"`{t.removeprefix('chatflow_')}` baseline {held.updates[0][t][0]:.2f} "
                f"({held.updates[0][t][1]:.0%}), {'second part' if args.control else 'held'} "
                f"{held.updates[1][t][0]:.2f} ({held.updates[1][t][1]:.0%})"
                for t in UPDATED
                if t in held.updates[0] and t in held.updates[1]
            )
            + ".\n"
        )
        if held.cpu_per_turn is not None:
            (base_db, base_gateway), (held_db, held_gateway) = held.cpu_per_turn
            second = "second part" if args.control else "held"
            parts.append(
                "CPU per turn (user + system, from /proc; the machine's cores are shared, so the two "
                f"compete): the database server {base_db:.2f} ms in the baseline, {held_db:.2f} ms "
                f"{second}; the gateway {base_gateway:.2f} ms, then {held_gateway:.2f} ms.\n"
            )
    return "\n".join(parts)


async def _server_settings(url: str) -> str:
    """The server settings that decide how a queue ages, for the report."""
    conn = await asyncpg.connect(dsn(url))
    try:
        names = ("server_version", "autovacuum", "autovacuum_naptime", "synchronous_commit", "fsync")
        values = [f"{name} {await conn.fetchval(f'SHOW {name}')}" for name in names]
        return ", ".join(values)
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--postgres-url",
        help="a server to use (default: a private one started from /usr/lib/postgresql/*/bin with its "
        "default settings, autovacuum on)",
    )
    parser.add_argument("--minutes", type=float, default=30, help="soak length (default 30; 0 skips it)")
    parser.add_argument("--rate", type=float, default=100, help="soak messages per second (default 100)")
    parser.add_argument("--conversations", type=int, default=500, help="chats (default 500)")
    parser.add_argument(
        "--hold-seconds", type=float, default=180, help="baseline and hold (default 180; 0 skips)"
    )
    parser.add_argument("--backlog", type=int, default=1000, help="held-xmin part: most messages waiting")
    parser.add_argument(
        "--control",
        action="store_true",
        help="held-xmin part without the snapshot: the run's own drift, to compare the held ratio with",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    private = None
    if not args.postgres_url:
        if fk.postgres_bin() is None:
            parser.error("no PostgreSQL binaries under /usr/lib/postgresql/*/bin: give --postgres-url")
        private = fk.PrivatePostgres(durable=True)
        private.start()
        args.postgres_url = private.url()
    try:
        return _run(args, private)
    finally:
        if private is not None:
            private.close()


def _run(args: argparse.Namespace, private: fk.PrivatePostgres | None) -> int:
    started = time.perf_counter()
    args.server_settings = asyncio.run(_server_settings(args.postgres_url))
    minutes: list[Minute] = []
    held: Held | None = None
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-soak-") as tmp:
        workdir = Path(tmp)
        fake = e2e.start_fake_platform(workdir)
        try:
            with pg.FreshDatabase(args.postgres_url) as url:
                gateway = e2e.start_gateway(workdir, fake.url, url)
                probe = None if private is None else cpu_probe(private, gateway.process.pid)
                try:
                    if args.minutes > 0:
                        log(f"soak: {args.minutes:g} min at {args.rate:g}/s ...")
                        minutes = asyncio.run(soak(gateway.url, url, fake.url, args))
                    if args.hold_seconds > 0:
                        held = asyncio.run(held_xmin(gateway.url, url, fake.url, args, probe))
                finally:
                    gateway.stop()
        finally:
            fake.stop()
    text = report(minutes, held, args, time.perf_counter() - started)
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
