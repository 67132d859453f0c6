"""End-to-end turns per second: Telegram webhook -> agent turn -> reply received by a fake Bot API.

Run from the repository root, with the project's virtualenv active (or call its python directly):

    python benchmarks/end_to_end.py

It starts, on free loopback ports, a fake Telegram Bot API (``fake_platform`` below: a Starlette app
under uvicorn in a subprocess, answering ``sendMessage`` with ``{"ok": true, "result": {"message_id":
N}}`` and no rate limit of any kind) and the real ``gateway serve`` (``python -m gateway serve`` of
this interpreter, in a fresh temporary directory, so its database is the default SQLite file
``./data/gateway.db``), with Telegram enabled, replies sent to the fake API, the scripted demo agent
(the default GATEWAY_AGENT), every pacing limit off (GATEWAY_TELEGRAM_CHAT_PER_SECOND,
GATEWAY_TELEGRAM_GROUP_PER_MINUTE and GATEWAY_TELEGRAM_GLOBAL_PER_SECOND = 0, which means unlimited)
and logs at warning.

Each round then posts ``--messages`` Telegram text updates ("Where is order <n>?", each with its own
``n`` and update_id) to ``/webhooks/telegram`` from ``--concurrency`` lanes, each a keep-alive
HTTP/1.1 connection (see `Connection` for why not httpx), over ``--conversations`` private chats: a
lane owns some chats and posts their messages in order, each after the previous 200, the way
Telegram delivers a chat's updates. The demo agent answers each with a tool round ("I couldn't find
order <n>. ..."), so the fake platform can tell which message a reply answers. Turns/s is
messages / (time of the last reply received - time of the first post). A round passes its checks
when every message got exactly one reply, in order within its conversation, and, after the gateway
is stopped (SIGTERM, exit code 0), every inbox row is ``done`` and every outbox row ``sent``. A
short warm-up on other chats precedes each round's measurement.

chatflow-agent 0.3.4's runner alone (its Runner on its SQLite file store, fixed-reply engine: the
"Scripted turns/s (SQLite file store)" measurement of benchmarks/run.py, in the same virtualenv,
benchmarks/.venv-baseline) is measured in the same rounds, alternating which side goes first. The
goal: ours >= 900 turns/s and >= 3x chatflow-agent's runner alone.

It prints a markdown table (progress goes to stderr) and writes it, with every round's figures, to
benchmarks/end_to_end_results.md. Options: ``--messages`` (default 10,000), ``--conversations``
(500), ``--rounds`` (3), ``--concurrency`` (64), ``--warmup`` (messages, 300), ``--output``,
``--baseline-venv``, ``--no-baseline`` (ours only), ``--platform-latency`` (seconds the fake Bot API
takes to answer each ``sendMessage``, as a far-away Bot API does: 0 by default). The default run
takes two to three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import run  # the runtime benchmark (same folder): chatflow-agent's virtualenv and worker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from webhooks import (  # the ack benchmark's helpers
    Server,
    clean_env,
    code_version,
    free_port,
    log,
    start_process,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "end_to_end_results.md"
COMMAND = "python benchmarks/end_to_end.py"
GOAL_TURNS_PER_SECOND = 900.0
GOAL_RATIO = 3.0
SECRET = "bench-secret_0123456789"
BOT_TOKEN = "123456:ABCdef"
WEBHOOK_PATH = "/webhooks/telegram"
CHAT_BASE = 700_000_000  # private chat ids (positive)
WARMUP_CHAT_BASE = 800_000_000
PLATFORM_LATENCY_ENV = "BENCH_PLATFORM_LATENCY"  # how the fake Bot API (its own process) is told
ORDER_BASE = 10_000_000  # message i asks for order ORDER_BASE + i, which the reply names
ORDER_IN_REPLY = re.compile(r"order (\d+)")
START_TIMEOUT = 60.0
REPLY_TIMEOUT_FLOOR = 120.0  # seconds to wait for the last reply, at least


# --- the fake Telegram Bot API (runs in its own process, under uvicorn) -----------------------------
class FakeTelegram:
    """Counts what the gateway sends, per chat: the order numbers its replies name, in arrival order."""

    def __init__(self) -> None:
        self.total = 0
        self.per_chat: dict[str, list[int]] = {}
        self.unmatched = 0  # replies naming no order number
        self.other_calls = 0  # Bot API methods other than sendMessage
        self.last_at = 0.0  # time.monotonic() of the latest reply (a system-wide clock on Linux)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def reset(self) -> None:
        self.total = self.unmatched = self.other_calls = 0
        self.per_chat = {}
        self.last_at = 0.0

    def record(self, chat_id: str, text: str) -> int:
        self.total += 1
        self.last_at = time.monotonic()
        found = ORDER_IN_REPLY.search(text)
        if found is None:
            self.unmatched += 1
        self.per_chat.setdefault(chat_id, []).append(int(found.group(1)) if found else -1)
        if self._waiters:
            still = []
            for count, future in self._waiters:
                if self.total >= count and not future.done():
                    future.set_result(None)
                elif not future.done():
                    still.append((count, future))
            self._waiters = still
        return self.total

    async def wait_for(self, count: int, within: float) -> None:
        if self.total >= count:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((count, future))
        try:
            async with asyncio.timeout(within):
                await future
        except TimeoutError:
            pass

    def summary(self) -> dict[str, Any]:
        return {"total": self.total, "last_at": self.last_at, "unmatched": self.unmatched}


def fake_platform() -> Starlette:
    """The uvicorn factory of the fake Bot API (``uvicorn end_to_end:fake_platform --factory``)."""
    state = FakeTelegram()
    latency = float(os.environ.get(PLATFORM_LATENCY_ENV, "0"))

    async def method(request: Request) -> JSONResponse:
        name = request.path_params["method"]
        body = json.loads(await request.body())
        if name != "sendMessage":
            state.other_calls += 1
            return JSONResponse({"ok": True, "result": True})
        if latency:
            await asyncio.sleep(latency)
        message_id = state.record(str(body.get("chat_id")), str(body.get("text") or ""))
        return JSONResponse({"ok": True, "result": {"message_id": message_id}})

    async def wait(request: Request) -> JSONResponse:
        count = int(request.query_params["count"])
        await state.wait_for(count, float(request.query_params.get("timeout", "5")))
        return JSONResponse(state.summary())

    async def replies(request: Request) -> JSONResponse:
        return JSONResponse(state.summary() | {"per_chat": state.per_chat, "other_calls": state.other_calls})

    async def reset(request: Request) -> JSONResponse:
        state.reset()
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/bot{token}/{method}", method, methods=["POST"]),
            Route("/_bench/wait", wait),
            Route("/_bench/replies", replies),
            Route("/_bench/reset", reset, methods=["POST"]),
        ]
    )


# --- the processes ----------------------------------------------------------------------------------
def wait_ready(server: Server, probe_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(probe_url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    server.stop()
    raise SystemExit(f"{server.name} was not ready within {START_TIMEOUT:.0f} s:\n{server.log_tail()}")


def fake_server_argv(factory: str, port: int, *options: str) -> list[str]:
    """uvicorn serving `factory` (module:function in benchmarks/) on loopback, quietly."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        factory,
        "--factory",
        "--app-dir",
        str(HERE),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        *options,
    ]


def start_fake_platform(workdir: Path, latency: float = 0.0) -> Server:
    """`latency`: seconds before each sendMessage is answered."""
    port = free_port()
    argv = fake_server_argv("end_to_end:fake_platform", port, "--loop", "auto", "--http", "auto")
    url = f"http://127.0.0.1:{port}"
    env = clean_env() | {PLATFORM_LATENCY_ENV: str(latency)}
    server = start_process("fake-telegram", argv, workdir, env, url)
    wait_ready(server, f"{url}/_bench/replies")
    return server


def start_gateway(
    workdir: Path,
    api_base: str,
    database_url: str | None = None,
    name: str = "gateway",
    extra: dict[str, str] | None = None,
) -> Server:
    """`gateway serve` in `workdir`: on its default SQLite file there, or on `database_url`; `extra`
    settings (environment variables) on top of the benchmark's."""
    port = free_port()
    database = {} if database_url is None else {"GATEWAY_DATABASE_URL": database_url}
    env = (
        clean_env()
        | database
        | {
            "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
            "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
            "GATEWAY_TELEGRAM_API_BASE": api_base,
            # 0 = unlimited for all three: the fake platform has no limits.
            "GATEWAY_TELEGRAM_CHAT_PER_SECOND": "0",
            "GATEWAY_TELEGRAM_GROUP_PER_MINUTE": "0",
            "GATEWAY_TELEGRAM_GLOBAL_PER_SECOND": "0",
            "GATEWAY_LOG_LEVEL": "warning",
            "GATEWAY_LOG_FORMAT": "json",
        }
    )
    env |= extra or {}
    argv = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(port)]
    server = start_process(name, argv, workdir, env, f"http://127.0.0.1:{port}")
    wait_ready(server, f"http://127.0.0.1:{port}/readyz")
    return server


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# --- the load ------------------------------------------------------------------------------------
def update_body(update_id: int, chat_id: int, message_id: int, text: str) -> bytes:
    return json.dumps(
        {
            "update_id": update_id,
            "message": {
                "message_id": message_id,
                "from": {"id": chat_id, "is_bot": False, "first_name": "Alice", "language_code": "en"},
                "chat": {"id": chat_id, "first_name": "Alice", "type": "private"},
                "date": 1767225600,
                "text": text,
            },
        }
    ).encode()


class Connection:
    """One keep-alive HTTP/1.1 connection for the load: a few syscalls and no framework per request.

    httpx costs about 1 ms of CPU per request on this kind of machine (httpcore, anyio and h11 in
    pure Python, more with many connections in one client), so a load generator built on it would
    need more CPU than the gateway it measures. This one writes a request and reads the status line,
    the headers and a Content-Length or chunked body.
    """

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition("/")[0].partition(":")
        self.host, self.port = host, int(port or 80)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._writer is None or self._reader is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:
            return await self._response(self._reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            await self.close()
            raise

    async def _response(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        if "content-length" in fields:
            data = await reader.readexactly(int(fields["content-length"]))
        elif fields.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")
            data = b"".join(chunks)
        else:
            data = await reader.read()
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return status, data

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        self._reader = self._writer = None


@dataclass
class Posted:
    statuses: dict[int, int] = field(default_factory=dict)
    retries: int = 0
    not_new: int = 0


async def post_updates(
    gateway_url: str | list[str],
    messages: int,
    conversations: int,
    concurrency: int,
    chat_base: int,
    id_base: int,
) -> Posted:
    """Message i goes to chat i % conversations; each lane posts its chats' messages in order. With
    several gateway URLs (replicas), lane n posts to URL n % their number."""
    urls = [gateway_url] if isinstance(gateway_url, str) else gateway_url
    posted = Posted()
    headers = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": SECRET}
    lanes = min(concurrency, conversations)

    async def post(connection: Connection, i: int) -> None:
        chat, seq = i % conversations, i // conversations
        body = update_body(id_base + i, chat_base + chat, seq + 1, f"Where is order {ORDER_BASE + i}?")
        for attempt in range(5):
            try:
                status, data = await asyncio.wait_for(connection.post(WEBHOOK_PATH, body, headers), 60)
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                status, data = 0, b""  # the connection broke: post again, as the platform would
            posted.statuses[status] = posted.statuses.get(status, 0) + 1
            if status == 200:
                if json.loads(data).get("new") != 1:
                    posted.not_new += 1
                return
            posted.retries += 1
            await asyncio.sleep(0.1 * (attempt + 1))
        raise SystemExit(f"update {id_base + i} was refused 5 times: {posted.statuses}")

    async def lane(number: int) -> None:
        connection = Connection(urls[number % len(urls)])
        try:
            for seq in range(-(-messages // conversations)):
                for chat in range(number, conversations, lanes):
                    i = seq * conversations + chat
                    if i < messages:
                        await post(connection, i)
        finally:
            await connection.close()

    await asyncio.gather(*(lane(n) for n in range(lanes)))
    return posted


def wait_for_replies(
    fake_url: str, gateway: Server | list[Server], count: int, timeout: float
) -> dict[str, Any]:
    """Long-poll the fake platform until it received `count` replies (or give up)."""
    gateways = [gateway] if isinstance(gateway, Server) else gateway
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=fake_url, timeout=30) as client:
        while True:
            summary: dict[str, Any] = client.get("/_bench/wait", params={"count": count, "timeout": 2}).json()
            if summary["total"] >= count:
                return summary
            for server in gateways:
                if server.process.poll() is not None:
                    raise SystemExit(f"{server.name} died:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"only {summary['total']} of {count} replies after {timeout:.0f} s:\n"
                    f"{gateways[0].log_tail()}"
                )


# --- one round -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    messages: int
    warmup: int  # warm-up messages before the measurement, in the same database
    elapsed: float  # first post -> last reply received
    ack_elapsed: float  # first post -> last 200 received
    gateway_cpu: float | None  # CPU seconds of gateway serve during the measurement
    replies: int
    duplicates: int  # replies beyond one per message
    missing: int  # messages without a reply
    out_of_order: int  # conversations whose replies came in another order than their messages
    inbox: dict[str, int]  # inbox rows by status, after the gateway stopped
    outbox: dict[str, int]
    exit_code: int
    statuses: dict[int, int]
    retries: int
    not_new: int

    @property
    def turns_per_second(self) -> float:
        return self.messages / self.elapsed

    @property
    def acks_per_second(self) -> float:
        return self.messages / self.ack_elapsed

    @property
    def passed(self) -> bool:
        expected = self.messages + self.warmup
        return (
            self.replies == self.messages
            and self.duplicates == self.missing == self.out_of_order == self.not_new == 0
            and self.exit_code == 0
            and self.inbox == {"done": expected}
            and self.outbox == {"sent": expected}
        )


def check_replies(per_chat: dict[str, list[int]], messages: int, conversations: int) -> tuple[int, int, int]:
    """(duplicates, missing, conversations out of order) against what was posted."""
    duplicates = missing = out_of_order = 0
    for chat in range(min(conversations, messages)):
        expected = [ORDER_BASE + i for i in range(chat, messages, conversations)]
        got = per_chat.get(str(CHAT_BASE + chat), [])
        duplicates += len(got) - len(set(got))
        missing += len(set(expected) - set(got))
        duplicates += len(set(got) - set(expected))  # a reply to nothing we sent counts as extra
        if got != expected:
            out_of_order += 1 if sorted(set(got)) == expected else 0
    return duplicates, missing, out_of_order


def table_counts(database: Path | str, table: str) -> dict[str, int]:
    """Rows of `table` by status, in an SQLite file or a PostgreSQL database (its URL)."""
    query = f"SELECT status, count(*) FROM {table} GROUP BY status"
    if isinstance(database, str):
        import asyncpg  # the postgres extra

        dsn = database.replace("postgresql+asyncpg://", "postgresql://")

        async def read() -> list[Any]:
            connection = await asyncpg.connect(dsn)
            try:
                return list(await connection.fetch(query))
            finally:
                await connection.close()

        rows = asyncio.run(read())
    else:
        connection = sqlite3.connect(database)
        try:
            rows = connection.execute(query).fetchall()
        finally:
            connection.close()
    return {status: count for status, count in rows}


def run_round(
    args: argparse.Namespace, number: int, fake_url: str, database_url: str | None = None, replicas: int = 1
) -> Round:
    """One measured round on a fresh database: the default SQLite file in a temporary folder, or
    `database_url` (an empty PostgreSQL database) shared by `replicas` gateway processes."""
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-e2e-") as tmp:
        workdir = Path(tmp)
        with httpx.Client(base_url=fake_url) as fake:
            fake.post("/_bench/reset")
        # One after the other: the first migrates the database, the others find it at head.
        gateways: list[Server] = []
        try:
            for replica in range(replicas):
                gateways.append(start_gateway(workdir, fake_url, database_url, f"gateway-{replica + 1}"))
            urls = [gateway.url for gateway in gateways]
            id_base = (number + 1) * 100_000_000
            if args.warmup:
                asyncio.run(
                    post_updates(urls, args.warmup, min(args.warmup, 100), 16, WARMUP_CHAT_BASE, id_base // 2)
                )
                wait_for_replies(fake_url, gateways, args.warmup, REPLY_TIMEOUT_FLOOR)
                with httpx.Client(base_url=fake_url) as fake:
                    fake.post("/_bench/reset")
            cpu_before = [cpu_seconds(gateway.process.pid) for gateway in gateways]
            started = time.monotonic()
            posted = asyncio.run(
                post_updates(urls, args.messages, args.conversations, args.concurrency, CHAT_BASE, id_base)
            )
            acked = time.monotonic()
            summary = wait_for_replies(
                fake_url, gateways, args.messages, max(REPLY_TIMEOUT_FLOOR, args.messages / 50)
            )
            cpu_after = [cpu_seconds(gateway.process.pid) for gateway in gateways]
        finally:
            exit_codes = [gateway.stop() for gateway in gateways]
        with httpx.Client(base_url=fake_url) as fake:
            final = fake.get("/_bench/replies").json()  # after the stop: late duplicates count too
        database: Path | str = workdir / "data" / "gateway.db" if database_url is None else database_url
        inbox, outbox = table_counts(database, "chatflow_inbox"), table_counts(database, "chatflow_outbox")
    duplicates, missing, out_of_order = check_replies(final["per_chat"], args.messages, args.conversations)
    cpus = [after - before for before, after in zip(cpu_before, cpu_after, strict=True) if before and after]
    return Round(
        messages=args.messages,
        warmup=args.warmup,
        elapsed=summary["last_at"] - started,
        ack_elapsed=acked - started,
        gateway_cpu=sum(cpus) if len(cpus) == len(gateways) else None,
        replies=final["total"],
        duplicates=duplicates,
        missing=missing,
        out_of_order=out_of_order,
        inbox=inbox,
        outbox=outbox,
        exit_code=next((code for code in exit_codes if code), 0),
        statuses=posted.statuses,
        retries=posted.retries,
        not_new=posted.not_new,
    )


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class Results:
    ours: list[Round]
    theirs: list[float]  # chatflow-agent's runner alone, turns/s per round
    seconds: float


def measure(args: argparse.Namespace) -> Results:
    started = time.perf_counter()
    baseline = None if args.no_baseline else run.Baseline(run.ensure_baseline_venv(args.baseline_venv))
    ours: list[Round] = []
    theirs: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="chatflow-gateway-fake-telegram-") as tmp:
            fake = start_fake_platform(Path(tmp), args.platform_latency)
            try:
                for number in range(args.rounds):
                    # Alternate which side goes first, so neither always follows the other's work.
                    for side in ("ours", "theirs") if number % 2 == 0 else ("theirs", "ours"):
                        if side == "ours":
                            ours.append(_our_round(args, number, fake.url))
                        elif baseline is not None:
                            theirs.append(_their_round(args, number, baseline))
            finally:
                fake.stop()
    finally:
        if baseline is not None:
            baseline.close()
    return Results(ours, theirs, time.perf_counter() - started)


def _our_round(args: argparse.Namespace, number: int, fake_url: str) -> Round:
    log(f"round {number + 1}/{args.rounds}: gateway serve, {args.messages:,} messages ...")
    result = run_round(args, number, fake_url)
    log(
        f"  {result.turns_per_second:,.0f} turns/s (acks done at {result.ack_elapsed:.2f} s, last reply "
        f"at {result.elapsed:.2f} s), checks {'ok' if result.passed else 'FAILED'}"
    )
    return result


def _their_round(args: argparse.Namespace, number: int, baseline: run.Baseline) -> float:
    log(f"round {number + 1}/{args.rounds}: chatflow-agent's runner, SQLite file store ...")
    value = baseline.measure("turns_sqlite")
    log(f"  {value:,.0f} turns/s")
    return value


# --- reporting -----------------------------------------------------------------------------------
def table(results: Results) -> str:
    ours = statistics.median(r.turns_per_second for r in results.ours)
    acks = statistics.median(r.acks_per_second for r in results.ours)
    checks = all(r.passed for r in results.ours)
    lines = [
        f"| Metric | ours (`gateway serve`, end to end) "
        f"| chatflow-agent {run.BASELINE_VERSION} (runner alone) | ratio | goal | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
        f"| Turns/s, webhook to reply received (SQLite file, median of {len(results.ours)} rounds) "
        f"| {ours:,.0f} | n/a | | ours >= {GOAL_TURNS_PER_SECOND:,.0f}/s "
        f"| {'PASS' if ours >= GOAL_TURNS_PER_SECOND else 'FAIL'} |",
    ]
    if results.theirs:
        theirs = statistics.median(results.theirs)
        ratio = ours / theirs
        lines.append(
            f"| Turns/s vs chatflow-agent's Runner alone (SQLite file store, fixed reply) | {ours:,.0f} "
            f"| {theirs:,.0f} | {ratio:.2f}x | ours >= {GOAL_RATIO:g}x theirs "
            f"| {'PASS' if ratio >= GOAL_RATIO else 'FAIL'} |"
        )
    cpu = [r.gateway_cpu / r.messages * 1000 for r in results.ours if r.gateway_cpu is not None]
    lines += [
        f"| Ack phase: all webhooks answered 200 (median) | {acks:,.0f} acks/s | n/a | | reported | |",
        f"| Gateway CPU per turn (ack, turn and delivery; median) "
        f"| {statistics.median(cpu):.2f} ms | n/a | | reported | |"
        if cpu
        else "| Gateway CPU per turn | n/a | n/a | | reported | |",
        f"| Exactly one reply per message, in order per conversation; every inbox row done and outbox "
        f"row sent | {sum(r.replies for r in results.ours):,} replies to "
        f"{sum(r.messages for r in results.ours):,} messages, "
        f"{sum(r.duplicates for r in results.ours)} duplicates, {sum(r.missing for r in results.ours)} "
        f"missing, {sum(r.out_of_order for r in results.ours)} out of order | n/a | | every round "
        f"| {'PASS' if checks else 'FAIL'} |",
    ]
    return "\n".join(lines)


def report(results: Results, args: argparse.Namespace) -> str:
    detail = [
        "| Round | turns/s | last reply | acks done | acks/s | gateway CPU | replies | inbox | outbox "
        "| exit | chatflow-agent turns/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for number, r in enumerate(results.ours):
        cpu = "n/a" if r.gateway_cpu is None else f"{r.gateway_cpu:.1f} s"
        theirs = f"{results.theirs[number]:,.0f}" if number < len(results.theirs) else "-"
        detail.append(
            f"| {number + 1} | {r.turns_per_second:,.0f} | {r.elapsed:.2f} s | {r.ack_elapsed:.2f} s "
            f"| {r.acks_per_second:,.0f} | {cpu} | {r.replies:,} | {r.inbox} | {r.outbox} | {r.exit_code} "
            f"| {theirs} |"
        )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    per_chat = -(-args.messages // args.conversations)
    baseline = (
        f"chatflow-agent {run.BASELINE_VERSION}'s `Runner.run_async` on its `SQLiteSessionStore` (a file) "
        "with a fixed-reply engine, one session already holding 40 turns, "
        f'{run.PARAMS["sqlite_turns"]} turns: the "Scripted turns/s (SQLite file store)" measurement of '
        "`python benchmarks/run.py`, in its virtualenv, once per round, alternating with ours which goes "
        "first. It has no webhooks, no queue and no delivery: the runner alone."
        if results.theirs
        else "not measured (`--no-baseline`)."
    )
    return f"""# End-to-end turns per second: webhook to reply at a fake Telegram Bot API

Generated by `{COMMAND}` on {when}: Python {platform.python_version()}, SQLite \
{sqlite3.sqlite_version}, {platform.machine()} with {os.cpu_count()} CPUs, {args.rounds} rounds, \
{results.seconds:.0f} s, code at {code_version()}. The load generator, the fake platform and \
the gateway share the machine.

{table(results)}

## Workload

- **Ours**: `python -m gateway serve` (one process, defaults: SQLite file `./data/gateway.db` in a \
fresh temporary directory per round, the scripted demo agent), GATEWAY_TELEGRAM_API_BASE pointing at \
the fake platform, GATEWAY_TELEGRAM_CHAT_PER_SECOND, _GROUP_PER_MINUTE and _GLOBAL_PER_SECOND = 0 \
(unlimited), GATEWAY_LOG_LEVEL=warning.
- **Fake platform**: a Starlette app under uvicorn in its own process, answering `sendMessage` with \
`{{"ok": true, "result": {{"message_id": N}}}}` after {args.platform_latency:g} s, without limits, \
and recording each reply's chat and the order number it names.
- **Load**: {args.messages:,} Telegram text updates per round ("Where is order <n>?", a new n and \
update_id each) over {args.conversations:,} private chats ({per_chat} per chat), posted to \
`/webhooks/telegram` with the secret header by {min(args.concurrency, args.conversations)} lanes, each \
a keep-alive HTTP/1.1 connection of a minimal asyncio client (httpx costs about 1 ms of CPU per \
request here: the load generator would use more CPU than the gateway); a lane owns some chats and \
posts their messages in order, each after the previous 200. Each message is a turn of the demo \
agent with a tool round (`check_order_status`, then "I couldn't find order <n>. ..."): four session \
messages per turn. Before each measurement, {args.warmup} messages on other chats warm the gateway up \
(their rows count in the inbox and outbox figures).
- **Turns/s**: messages / (monotonic time of the last reply received by the fake platform - time of \
the first post). **Acks**: the same messages / the time until the last 200. **Gateway CPU**: its \
process's user + system time over the measurement. **Checks**: per chat the replies name exactly the \
messages' order numbers, in posting order; after SIGTERM the inbox holds only `done` rows and the \
outbox only `sent` rows, and no reply arrives late.
- **chatflow-agent**: {baseline}

## Every round

{chr(10).join(detail)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=10_000, help="messages per round (default 10,000)")
    parser.add_argument("--conversations", type=int, default=500, help="distinct chats (default 500)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent posts (default 64)")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up messages per round (default 300)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    parser.add_argument(
        "--baseline-venv", type=Path, default=run.DEFAULT_VENV, help="virtualenv for chatflow-agent"
    )
    parser.add_argument("--no-baseline", action="store_true", help="measure ours only")
    parser.add_argument(
        "--platform-latency", type=float, default=0.0, help="seconds the fake Bot API takes per sendMessage"
    )
    args = parser.parse_args(argv)
    if min(args.messages, args.conversations, args.rounds, args.concurrency) < 1 or args.warmup < 0:
        parser.error("--messages, --conversations, --rounds and --concurrency must be at least 1")
    try:
        import gateway  # noqa: F401 - only checks that the project is importable
    except ImportError:
        parser.error("gateway is not importable: run this with the project's virtualenv python")
    results = measure(args)
    text = report(results, args)
    args.output.write_text(text, encoding="utf-8")
    print(table(results))
    log(f"done in {results.seconds:.0f} s; report written to {args.output}")
    return 0 if all(r.passed for r in results.ours) else 1


if __name__ == "__main__":
    sys.exit(main())
