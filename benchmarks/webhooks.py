"""Webhook acknowledgements per second: the real `gateway serve` vs a bare Starlette endpoint.

Run from the repository root, with the project's virtualenv active (or call its python directly):

    python benchmarks/webhooks.py

It needs wrk (Debian/Ubuntu: ``apt-get install -y wrk``). It starts, on free loopback ports, the
real ``gateway serve`` (the ``gateway`` script next to this python, in a temporary directory, so its
database is ``./data/gateway.db`` there, Telegram enabled by GATEWAY_TELEGRAM_SECRET_TOKEN, replies
sent to a fake Bot API on loopback served by this process, logs at warning) and a bare Starlette app
that only reads the body (benchmarks/webhooks_bare_app.py) under uvicorn with the same server
settings (one worker, ``--loop auto --http auto``, no access log, no server header). wrk drives both
the same way (``wrk -t2 -c64 -d10s --latency --timeout=10s -s benchmarks/webhooks_post.lua URL``):
every request POSTs a Telegram text message update with a new update_id and the secret header. The
gateway's inbox worker (part of ``serve``) runs an agent turn for each meanwhile. After a warm-up
of each, the rounds alternate which server goes first. While the bare app is loaded, the gateway
process is paused (SIGSTOP, then SIGCONT), so the backlog of turns it works off between its own runs
takes no CPU from the bare app.

Then it stops the gateway (SIGTERM) and opens its database: every update answered 200 must have its
inbox row (the ids the gateway acknowledged are checked one by one), and the inbox must hold no row
wrk never sent. It prints a markdown table (acks/s of each, their ratio against the goal of 0.35, p99
ack latency, inbox rows vs 200s, PASS/FAIL; progress goes to stderr) and writes it, with every
round's figures, to benchmarks/webhooks_results.md. Options: ``--duration`` (seconds per run,
default 10), ``--warmup`` (default 3), ``--rounds`` (default 3), ``--connections`` (64),
``--threads`` (2), ``--output``. The default run takes about 70 seconds.

``--model-latency S`` adds a second gateway, measured in the same rounds: its turns call a fake
OpenAI-compatible server (benchmarks/model_latency.py's) that answers after S seconds, instead of the
scripted demo agent. The report then compares its acks/s with the scripted gateway's (goal: at least
0.95 of them): model traffic must not slow acknowledgements. Both run in the same rounds because two
runs of the same code on the shared machine differ by more than that. Its report goes to
benchmarks/webhooks_model_results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import platform
import re
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

HERE = Path(__file__).resolve().parent
LUA_SCRIPT = HERE / "webhooks_post.lua"
BARE_MODULE = "webhooks_bare_app:app"
DEFAULT_OUTPUT = HERE / "webhooks_results.md"
DEFAULT_MODEL_OUTPUT = HERE / "webhooks_model_results.md"
COMMAND = "python benchmarks/webhooks.py"
GOAL_RATIO = 0.35
GOAL_MODEL_RATIO = 0.95  # acks/s with model traffic vs without, measured in the same run
AGENTS = {
    "ours": "the scripted demo agent",
    "ours, model": "benchmarks/model_agent.py on GATEWAY_MODEL=openai:fake-model, a fake OpenAI-compatible "
    "server (benchmarks/model_latency.py's) answering each call after {latency:g} s",
}
SECRET = "bench-secret_0123456789"
BOT_TOKEN = "123456:abc"
WEBHOOK_PATH = "/webhooks/telegram"
ID_SPAN_PER_RUN = 100_000_000  # every wrk run gets its own range of update_ids (webhooks_post.lua)
THREAD_SPAN = 10_000_000  # and each of its threads a range of its own, as in webhooks_post.lua
WRK_TIMEOUT = 10  # seconds; wrk's default of 2 s would drop slow acks from the latency figures
START_TIMEOUT = 60.0
STOP_TIMEOUT = 40.0  # gateway serve drains for up to 25 s


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- the two servers ------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    log_file: IO[bytes]

    def stop(self) -> int:
        """SIGTERM, then wait (bounded); SIGKILL if it does not stop. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log(f"{self.name} did not stop within {STOP_TIMEOUT:.0f} s; killing it")
                self.process.kill()
                self.process.wait(timeout=10)
        self.log_file.close()
        return self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def clean_env() -> dict[str, str]:
    """This environment without GATEWAY_* variables, so only the benchmark's settings apply."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}


def start_process(name: str, argv: list[str], cwd: Path, env: dict[str, str], url: str) -> Server:
    log_path = cwd / f"{name}.log"
    log_file = log_path.open("wb")
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return Server(name, process, url, log_path, log_file)


def _wait_ready(server: Server, probe: urllib.request.Request) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(probe, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    server.stop()
    raise SystemExit(f"{server.name} was not ready within {START_TIMEOUT:.0f} s:\n{server.log_tail()}")


def start_gateway(workdir: Path, api_base: str, model_url: str | None = None) -> Server:
    """`model_url`: a fake OpenAI-compatible server the turns call (model_latency.py's), else the
    scripted demo agent."""
    port = free_port()
    env = clean_env() | {
        "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
        "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
        "GATEWAY_TELEGRAM_API_BASE": api_base,
        "GATEWAY_LOG_LEVEL": "warning",
        "GATEWAY_LOG_FORMAT": "json",
    }
    if model_url is not None:
        env |= {
            "GATEWAY_MODEL": "openai:fake-model",
            "GATEWAY_OPENAI_BASE_URL": f"{model_url}/v1",
            "GATEWAY_AGENT": "model_agent:agent",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        }
    gateway = Path(sys.executable).parent / "gateway"
    server = start_process(
        "gateway",
        [str(gateway), "serve", "--host", "127.0.0.1", "--port", str(port)],
        workdir,
        env,
        f"http://127.0.0.1:{port}{WEBHOOK_PATH}",
    )
    _wait_ready(server, urllib.request.Request(f"http://127.0.0.1:{port}/readyz"))
    return server


def start_bare(workdir: Path) -> Server:
    port = free_port()
    argv = [
        str(Path(sys.executable).parent / "uvicorn"),
        BARE_MODULE,
        "--app-dir",
        str(HERE),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--loop",
        "auto",
        "--http",
        "auto",
        "--log-level",
        "warning",
        "--no-access-log",
        "--no-server-header",
    ]
    url = f"http://127.0.0.1:{port}{WEBHOOK_PATH}"
    server = start_process("bare", argv, workdir, clean_env(), url)
    _wait_ready(server, urllib.request.Request(url, data=b"{}", method="POST"))
    return server


# --- the platform the gateway replies to --------------------------------------------------------
class FakeBotAPI:
    """A stand-in for the Telegram Bot API on loopback, so the gateway's replies go somewhere real.

    Every method succeeds (sendMessage with a new message_id); the calls are counted. It runs on a
    thread of this process, which is idle while wrk runs.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the real API

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                method = self.path.rsplit("/", 1)[-1]
                with api._lock:
                    api.calls[method] = api.calls.get(method, 0) + 1
                    number = sum(api.calls.values())
                result: object = {"message_id": number} if method == "sendMessage" else True
                body = json.dumps({"ok": True, "result": result}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # the gateway hanging up at its stop is no news

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-bot-api", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- wrk ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One wrk run against one server."""

    server: str
    id_base: int
    requests_per_second: float  # wrk's own figure: every response, whatever its status
    p99_seconds: float  # wrk's --latency distribution
    duration_seconds: float
    responses: int
    sent: int
    thread_sent: dict[int, int]  # wrk thread (1-based) -> requests it started
    accepted_new: int
    statuses: dict[int, int]
    errors: dict[str, int]
    acked_ids: list[int] = field(default_factory=list)

    def was_sent(self, update_id: int) -> bool:
        """Whether this run sent `update_id` (webhooks_post.lua numbers each thread's requests)."""
        thread, number = divmod(update_id - self.id_base, THREAD_SPAN)
        return 1 <= number <= self.thread_sent.get(thread, 0)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def acks_per_second(self) -> float:
        return self.ok / self.duration_seconds


_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(output: str, server: str, id_base: int, acked_ids: list[int]) -> Run:
    """Requests/s and p99 from wrk's report, the rest from the lines webhooks_post.lua's done() prints."""
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", output, re.M)
    if rps is None or p99 is None:
        raise SystemExit(f"could not read wrk's report:\n{output}")
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    thread_sent: dict[int, int] = {}
    errors: dict[str, int] = {}
    for line in output.splitlines():
        if not line.startswith("webhooks: "):
            continue
        words = line.split()[1:]
        if words[0] == "status":
            statuses[int(words[1])] = int(words[2])
        elif words[0] == "thread_sent":
            thread_sent[int(words[1])] = int(words[2])
        elif words[0] == "errors":
            errors = {words[i]: int(words[i + 1]) for i in range(1, len(words) - 1, 2)}
        else:
            counts[words[0]] = int(words[1])
    try:
        return Run(
            server=server,
            id_base=id_base,
            requests_per_second=float(rps.group(1)),
            p99_seconds=_seconds(p99.group(1)),
            duration_seconds=counts["duration_us"] / 1e6,
            responses=counts["responses"],
            sent=counts["sent"],
            thread_sent=thread_sent,
            accepted_new=counts["accepted_new"],
            statuses=statuses,
            errors=errors,
            acked_ids=acked_ids,
        )
    except KeyError as exc:
        raise SystemExit(f"webhooks_post.lua printed no {exc}:\n{output}") from None


def run_wrk(server: Server, id_base: int, args: argparse.Namespace, seconds: int, acked_path: Path) -> Run:
    argv = [
        "wrk",
        f"-t{args.threads}",
        f"-c{args.connections}",
        f"-d{seconds}s",
        "--latency",
        f"--timeout={WRK_TIMEOUT}s",
        "-s",
        str(LUA_SCRIPT),
        server.url,
    ]
    env = os.environ | {
        "WEBHOOKS_SECRET": SECRET,
        "WEBHOOKS_ID_BASE": str(id_base),
        "WEBHOOKS_ACKED_FILE": str(acked_path),
    }
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    if server.process.poll() is not None:  # first: a dead server also fails wrk, and its log says why
        raise SystemExit(f"{server.name} died (exit code {server.process.returncode}):\n{server.log_tail()}")
    if done.returncode != 0:
        raise SystemExit(
            f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n"
            f"{server.name}'s log:\n{server.log_tail()}"
        )
    acked = [int(line[1:]) for line in acked_path.read_text().split()]
    return parse_wrk(done.stdout, server.name, id_base, acked)


# --- durability ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Durability:
    ok_responses: int  # 200s wrk received from the gateway in the measured runs
    acked_ids: int  # of which the ids echoed in X-Request-ID
    accepted_new: int  # of which the body said "new": 1
    inbox_rows: int  # inbox rows whose update_id belongs to a measured run
    sent: int  # requests wrk started in the measured runs
    missing: int  # acknowledged ids without an inbox row
    unsent: int  # inbox rows of ids wrk never sent

    @property
    def passed(self) -> bool:
        return (
            self.ok_responses > 0
            and self.missing == 0
            and self.unsent == 0
            and self.acked_ids == self.ok_responses == self.accepted_new
            and self.ok_responses <= self.inbox_rows <= self.sent
        )

    @property
    def in_flight(self) -> int:
        """Rows of updates stored but whose 200 wrk never read (in flight at the end, or timed out)."""
        return self.inbox_rows - self.ok_responses


def inbox_update_ids(database: Path) -> tuple[set[int], dict[str, int]]:
    """The update ids of the inbox rows, and the number of rows by status."""
    connection = sqlite3.connect(database)
    try:
        keys = [row[0] for row in connection.execute("SELECT dedup_key FROM chatflow_inbox")]
        statuses = dict(connection.execute("SELECT status, count(*) FROM chatflow_inbox GROUP BY status"))
    finally:
        connection.close()
    bot_id = BOT_TOKEN.split(":")[0]
    prefix = f"tg:{bot_id}:"
    return {int(key.removeprefix(prefix)) for key in keys if key.startswith(prefix)}, statuses


def check_durability(runs: list[Run], stored: set[int]) -> Durability:
    missing = unsent = rows = 0
    for run in runs:
        in_run = {i for i in stored if run.id_base <= i < run.id_base + ID_SPAN_PER_RUN}
        rows += len(in_run)
        missing += len(set(run.acked_ids) - in_run)
        unsent += sum(1 for i in in_run if not run.was_sent(i))
    return Durability(
        ok_responses=sum(r.ok for r in runs),
        acked_ids=sum(len(r.acked_ids) for r in runs),
        accepted_new=sum(r.accepted_new for r in runs),
        inbox_rows=rows,
        sent=sum(r.sent for r in runs),
        missing=missing,
        unsent=unsent,
    )


# --- measuring -----------------------------------------------------------------------------------
@dataclass
class Ours:
    """One `gateway serve`: its runs, then what its database held after its stop."""

    name: str  # "ours", or "ours, model" for the gateway whose turns call the fake model
    runs: list[Run]
    durability: Durability
    exit_code: int
    inbox_statuses: dict[str, int]  # every inbox row (warm-ups too) by status, after the stop
    api_calls: dict[str, int]  # Bot API calls the gateway made (replies, typing indicators)


@dataclass
class Results:
    ours: list[Ours]  # the scripted gateway, then (with --model-latency) the one calling the model
    bare: list[Run]
    seconds: float


def measure(args: argparse.Namespace) -> Results:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chatflow-gateway-webhooks-") as tmp:
        workdir = Path(tmp)
        log("starting gateway serve and the bare app ...")
        with contextlib.ExitStack() as stack:
            model = None
            if args.model_latency is not None:
                import model_latency  # the fake model server (imports this module: not at the top)

                model = model_latency.start_fake(workdir, "fake-model", "model_latency:fake_model")
                stack.callback(model.stop)
                urllib.request.urlopen(
                    urllib.request.Request(
                        f"{model.url}/_bench/configure",
                        data=json.dumps({"latency": args.model_latency}).encode(),
                        method="POST",
                    ),
                    timeout=10,
                ).close()
            gateways: dict[str, tuple[Server, FakeBotAPI, Path]] = {}
            wanted: dict[str, str | None] = {"ours": None} | ({"ours, model": model.url} if model else {})
            for name, model_url in wanted.items():
                home = workdir / ("model" if model_url else "scripted")
                home.mkdir()
                api = FakeBotAPI()
                stack.callback(api.close)
                gateway = start_gateway(home, api.base, model_url)
                stack.callback(gateway.stop)
                gateways[name] = gateway, api, home
            bare = start_bare(workdir)
            stack.callback(bare.stop)
            servers: dict[str, Server] = {"bare": bare} | {n: g for n, (g, _, _) in gateways.items()}
            runs: dict[str, list[Run]] = {name: [] for name in servers}
            counter = 0

            def one(name: str, seconds: int) -> Run:
                # The other gateways keep working off their backlogs of turns between their runs:
                # frozen while another server is measured, they take no CPU from it (their state is
                # untouched).
                nonlocal counter
                counter += 1
                others = [g for n, (g, _, _) in gateways.items() if n != name]
                for other in others:
                    other.process.send_signal(signal.SIGSTOP)
                try:
                    return run_wrk(
                        servers[name], counter * ID_SPAN_PER_RUN, args, seconds, workdir / f"acked-{counter}"
                    )
                finally:
                    for other in others:
                        other.process.send_signal(signal.SIGCONT)

            names = list(servers)
            for name in names:
                log(f"warm-up: {name}, {args.warmup} s ...")
                one(name, args.warmup)
            for round_number in range(args.rounds):
                shift = round_number % len(names)  # each server goes first in turn
                for name in names[shift:] + names[:shift]:
                    log(f"round {round_number + 1}/{args.rounds}: {name}, {args.duration} s ...")
                    run = one(name, args.duration)
                    runs[name].append(run)
                    log(
                        f"  {run.acks_per_second:,.0f} acks/s, p99 {run.p99_seconds * 1000:.1f} ms, "
                        f"statuses {run.statuses}, errors {run.errors}"
                    )
            bare.stop()
            ours = []
            for name, (gateway, api, home) in gateways.items():
                log(f"stopping {name} (SIGTERM) ...")
                exit_code = gateway.stop()
                stored, statuses = inbox_update_ids(home / "data" / "gateway.db")
                durability = check_durability(runs[name], stored)
                ours.append(Ours(name, runs[name], durability, exit_code, statuses, dict(api.calls)))
    return Results(ours, runs["bare"], time.perf_counter() - started)


# --- reporting -----------------------------------------------------------------------------------
def code_version() -> str:
    """The commit measured, and whether gateway/ had uncommitted changes (read-only git commands)."""
    root = HERE.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return f"{head} with uncommitted changes in gateway/" if dirty else head


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def table(results: Results) -> str:
    bare = statistics.median(r.acks_per_second for r in results.bare)
    rows = [
        "| Metric | ours (`gateway serve`) | bare Starlette | ratio | goal | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for ours in results.ours:
        acks = statistics.median(r.acks_per_second for r in ours.runs)
        ratio = acks / bare
        rows.append(
            f"| Webhook acks/s, {ours.name} (200s per second, median of {len(ours.runs)} runs) | {acks:,.0f} "
            f"| {bare:,.0f} | {ratio:.2f} | ours >= {GOAL_RATIO:g} x bare "
            f"| {'PASS' if ratio >= GOAL_RATIO else 'FAIL'} |"
        )
    if len(results.ours) == 2:
        scripted, model = (statistics.median(r.acks_per_second for r in o.runs) for o in results.ours)
        ratio = model / scripted
        rows.append(
            f"| Acks/s with model traffic vs without (same run) | {model:,.0f} vs {scripted:,.0f} | | "
            f"{ratio:.2f} | >= {GOAL_MODEL_RATIO:g} | {'PASS' if ratio >= GOAL_MODEL_RATIO else 'FAIL'} |"
        )
    for ours in results.ours:
        rows.append(
            f"| p99 ack latency, {ours.name} (median of the runs' p99) "
            f"| {_ms(statistics.median(r.p99_seconds for r in ours.runs))} "
            f"| {_ms(statistics.median(r.p99_seconds for r in results.bare))} | | reported | |"
        )
    for ours in results.ours:
        d = ours.durability
        durable = d.passed and ours.exit_code == 0
        rows.append(
            f"| Inbox rows after SIGTERM vs 200s, {ours.name} (measured runs) | {d.inbox_rows:,} rows vs "
            f"{d.ok_responses:,} 200s ({d.in_flight} stored but not read by wrk; {d.missing} acked ids "
            f"missing) | n/a | | every 200 durable | {'PASS' if durable else 'FAIL'} |"
        )
    return "\n".join(rows)


def _statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{count:,} {name}" for name, count in sorted(counts.items())) or "nothing"


def report(results: Results, args: argparse.Namespace) -> str:
    detail = [
        "| Server | run | acks/s | wrk requests/s | p99 | 200s | other statuses | socket errors | sent |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for name, runs in [(o.name, o.runs) for o in results.ours] + [("bare", results.bare)]:
        for number, r in enumerate(runs, 1):
            others = {k: v for k, v in r.statuses.items() if k != 200} or "-"
            errors = {k: v for k, v in r.errors.items() if v} or "-"
            detail.append(
                f"| {name} | {number} | {r.acks_per_second:,.0f} | {r.requests_per_second:,.0f} "
                f"| {_ms(r.p99_seconds)} | {r.ok:,} | {others} | {errors} | {r.sent:,} |"
            )
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    wrk_line = (
        f"wrk -t{args.threads} -c{args.connections} -d{args.duration}s --latency "
        f"--timeout={WRK_TIMEOUT}s -s benchmarks/webhooks_post.lua URL"
    )
    gateways = "\n".join(
        f"- **{o.name}**: {AGENTS[o.name].format(latency=args.model_latency)}. At the stop (SIGTERM, exit "
        f"code {o.exit_code}) the inbox held {_statuses(o.inbox_statuses)} (warm-ups included: the "
        f"backlog the worker had not reached yet is `pending`); its fake Bot API had answered "
        f"{_statuses(o.api_calls)}. Durability: {o.durability.inbox_rows:,} rows for the measured runs' "
        f"ids, {o.durability.ok_responses:,} 200s received by wrk ({o.durability.accepted_new:,} of them "
        f'`"new": 1`), {o.durability.acked_ids:,} acknowledged ids echoed back, {o.durability.missing} '
        f"of them without a row, {o.durability.unsent} rows of ids never sent, {o.durability.sent:,} "
        "requests sent."
        for o in results.ours
    )
    return f"""# Webhook acknowledgements per second: `gateway serve` vs a bare Starlette endpoint

Generated by `{COMMAND}{"" if args.model_latency is None else f" --model-latency {args.model_latency:g}"}` \
on {when}: Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, {platform.machine()} with \
{os.cpu_count()} CPUs, {args.rounds} rounds, {results.seconds:.0f} s, code at {code_version()}. The load \
generator and the servers share the machine.

{table(results)}

## Workload

- **Load**: `{wrk_line}`, the same for every server, after a {args.warmup} s warm-up of each; each \
round starts with the next server. Every request POSTs a Telegram text message update \
(`tests/payloads/telegram/private_text.json`'s shape, 500 private chats) with a new `update_id`, \
`Content-Type: application/json`, `X-Telegram-Bot-Api-Secret-Token` and `X-Request-ID: u<update_id>`.
- **Ours**: `gateway serve --port P` (one worker, uvicorn's `loop=auto`, `http=auto`), SQLite file \
`./data/gateway.db` in a temporary directory of its own, GATEWAY_LOG_LEVEL=warning, \
GATEWAY_LOG_FORMAT=json. Each 200 means the update's dedup key and inbox row were committed (group \
commit). Every update is a text message, so each is stored `pending` and its in-process inbox worker \
runs an agent turn for it while the load goes on, and replies through a fake Bot API on loopback \
(GATEWAY_TELEGRAM_API_BASE; every call succeeds) at the default pacing. While another server is \
measured, a gateway is paused (SIGSTOP/SIGCONT), so its backlog of turns takes no CPU from it.
{gateways}
- **Bare**: `uvicorn webhooks_bare_app:app --workers 1 --loop auto --http auto --log-level warning \
--no-access-log --no-server-header`: a Starlette route that reads the body and answers 200 JSON.
- **Acks/s**: 200 responses / the run's duration. **Durability**: after the runs each gateway is \
stopped with SIGTERM and its inbox read with sqlite3: every acknowledged id must have its row, and \
no row may be of an id never sent. Rows beyond the 200s are requests wrk had sent when its time ran \
out (or gave up on after {WRK_TIMEOUT} s): stored and answered, but not read.

## Every run

{chr(10).join(detail)}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per measured run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="seconds of warm-up per server (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="measured runs per server (default 3)")
    parser.add_argument("--connections", type=int, default=64, help="wrk connections (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads (default 2, at most 9)")
    parser.add_argument(
        "--output",
        type=Path,
        help="markdown report to write (default benchmarks/webhooks_results.md, with --model-latency "
        "benchmarks/webhooks_model_results.md)",
    )
    parser.add_argument(
        "--model-latency",
        type=float,
        default=None,
        help="seconds: also measure, in the same rounds, a gateway whose turns call a fake "
        "OpenAI-compatible server answering after this long (benchmarks/model_latency.py's)",
    )
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = DEFAULT_OUTPUT if args.model_latency is None else DEFAULT_MODEL_OUTPUT
    if min(args.duration, args.warmup, args.rounds) < 1:
        parser.error("--duration, --warmup and --rounds must be at least 1")
    if not 1 <= args.threads <= 9 or args.connections < args.threads:
        parser.error("--threads must be 1-9 and --connections at least --threads")
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed: apt-get install -y wrk (Debian/Ubuntu)")
    if not (Path(sys.executable).parent / "gateway").exists():
        parser.error("no gateway script next to this python: run this with the project's virtualenv python")
    results = measure(args)
    text = report(results, args)
    args.output.write_text(text, encoding="utf-8")
    print(table(results))
    log(f"done in {results.seconds:.0f} s; report written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
