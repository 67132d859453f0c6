"""Machinery for scale-out and fault runs of the real `gateway serve`, shared by the tests and
`benchmarks/faults.py` (which imports it with the repository root on `sys.path`).

It lives under tests/ because the tests are its first users and tests/ is a package already linted
and formatted with the code (tests/test_quality.py); it imports no pytest, so a plain script can use
it too. Everything here is real: `gateway serve` processes (started, SIGTERMed, SIGKILLed, restarted),
a private PostgreSQL server (initdb in a temporary folder, stopped, frozen with SIGSTOP, killed),
fake platform and model servers on loopback HTTP whose behaviour is switched while they run, and a
load driver that posts signed Telegram webhooks and times every answer.

- `GatewayProcess`: one `gateway serve` on its own port, with the environment given.
- `migrate`: `gateway db upgrade` as a separate step, as docs/deploy.md recommends.
- `PrivatePostgres`: a PostgreSQL server of our own, for faults we cannot inflict on a shared one.
- `FakeBotAPI` / `FakeModel`: a Telegram Bot API and an OpenAI-compatible server, each `ok`, `down`
  (not listening: connection refused), `error` (500), `throttled` (429 with Retry-After) or `hang`
  (takes the request, never answers), switchable at run time; the Bot API records every reply.
- `Driver`: posts messages ("Where is order <n>?", a unique n each) conversation by conversation, in
  order, with duplicates, to random replicas, retrying refused deliveries as a platform does.
- `tally`: deliveries, acked, stored, turns, replies, lost, duplicated, out of order, p99 ack and time
  to recover, from the driver's records, the fake platform's and the database.

Replies are matched to messages by the order number: the demo agent (scripted model) answers "Where
is order n?" with "I couldn't find order n. ...", and `FakeModel` answers the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from sqlalchemy import func, select
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, MessageRow, OutboxRow

REPO_ROOT = Path(__file__).resolve().parents[1]
SECRET = "fault-secret_0123456789"
BOT_TOKEN = "4242:fault-token"
WEBHOOK_PATH = "/webhooks/telegram"
ORDER_IN_TEXT = re.compile(r"order (\d+)")
READY_TIMEOUT = 60.0
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(condition: Callable[[], T], what: str, timeout: float, interval: float = 0.1) -> T:
    """`condition()`'s first truthy value; TimeoutError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def clean_env(**settings: str) -> dict[str, str]:
    """This environment without GATEWAY_* settings, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GATEWAY_")}
    env.update(settings)
    return env


def gateway_settings(database_url: str, bot_api: str, **extra: str) -> dict[str, str]:
    """Telegram enabled and sending to `bot_api` with pacing off, logs at warning as JSON, no local mode."""
    return {
        "GATEWAY_DATABASE_URL": database_url,
        "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
        "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
        "GATEWAY_TELEGRAM_API_BASE": bot_api,
        # Named, so the gateway does not ask getMe: the fake's calls are the replies alone.
        "GATEWAY_TELEGRAM_BOT_USERNAME": "fault_kit_bot",
        # 0 = unlimited: the fake platform has no limits, and pacing would only slow the run down.
        "GATEWAY_TELEGRAM_CHAT_PER_SECOND": "0",
        "GATEWAY_TELEGRAM_GROUP_PER_MINUTE": "0",
        "GATEWAY_TELEGRAM_GLOBAL_PER_SECOND": "0",
        "GATEWAY_LOCAL_KEY_FILE": "",
        "GATEWAY_LOG_LEVEL": "warning",
        "GATEWAY_LOG_FORMAT": "json",
        # Three replicas and their test share one server's 100 connections with whatever else runs.
        "GATEWAY_DATABASE_POOL_SIZE": "10",
        **extra,
    }


# --- gateway processes ---------------------------------------------------------------------------
def migrate(database_url: str, cwd: Path) -> None:
    """`gateway db upgrade`: the schema at head, as a step of its own before any replica starts."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "db", "upgrade"],
        cwd=cwd,
        env=clean_env(GATEWAY_DATABASE_URL=database_url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gateway db upgrade failed ({done.returncode}): {done.stderr[-2000:]}")


class GatewayProcess:
    """One `gateway serve --no-migrate` on a fixed loopback port; its log in `workdir/<name>.log`."""

    def __init__(self, name: str, workdir: Path, env: dict[str, str], *, migrate: bool = False) -> None:
        self.name = name
        self.workdir = workdir
        self.env = env
        self.port = free_port()
        self.migrate = migrate
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{name}.log"
        self.pids: list[int] = []  # every process this replica has been, in order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, *, wait: bool = True) -> GatewayProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if not self.migrate:
            argv.append("--no-migrate")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.pids.append(self.process.pid)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"{self.name} exited ({code}) before ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as answer:
                    return bool(answer.status == 200)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        wait_for(ready, f"{self.name} to be ready", timeout)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM and wait (the gateway drains for up to 25 s); its exit code, None if not started."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: no drain, no release of leases; reaped before this returns."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def restart(self, *, wait: bool = True) -> GatewayProcess:
        self.kill()
        return self.start(wait=wait)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def owner_prefix(self, pid: int) -> str:
        """The start of the lease owner names (host:pid:…) of the process `pid` of this replica."""
        return f"{socket.gethostname()}:{pid}:"


# --- a private PostgreSQL server -------------------------------------------------------------------
def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian's layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PrivatePostgres:
    """A PostgreSQL server of our own: initdb into a temporary folder, the postmaster on a free port.

    `freeze` (SIGSTOP), `thaw` (SIGCONT) and `kill` (SIGKILL) signal the postmaster and each of its
    processes (backends, checkpointer, WAL writer…); `stop` is a fast shutdown. Run as root, the
    server runs as the `postgres` user (PostgreSQL refuses root).
    """

    def __init__(self, bin_dir: Path | None = None, *, durable: bool = False) -> None:
        """`durable`: the server's own fsync settings (benchmarks), else fsync off (fault tests)."""
        self.durable = durable
        found = bin_dir or postgres_bin()
        if found is None:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.bin = found
        self.root = Path(tempfile.mkdtemp(prefix="gateway-faults-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user:
            shutil.chown(self.root, self._user, self._user)
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E",
                   "UTF8", "--no-sync"])  # fmt: skip

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(
            argv, cwd=self.root, capture_output=True, text=True, user=self._user, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {done.stderr[-2000:]}")

    def start(self, timeout: float = 30) -> None:
        argv = [
            str(self.bin / "postgres"),
            "-D", str(self.data),
            "-p", str(self.port),
            "-k", str(self.root),
            "-c", "listen_addresses=127.0.0.1",
            "-c", "max_connections=200",
        ]  # fmt: skip
        if not self.durable:
            # A crash of the server process loses nothing the OS has; only power loss would.
            argv += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        with (self.root / "server.log").open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self._user,
                start_new_session=True,
            )
        wait_for(self.accepting, "the private PostgreSQL to accept connections", timeout)

    def accepting(self) -> bool:
        done = subprocess.run(
            [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)], check=False
        )
        return done.returncode == 0

    def create_database(self, name: str) -> str:
        run_sync(_admin(self.url(), f'CREATE DATABASE "{name}"'))
        return self.url(name)

    def server_pids(self) -> list[int]:
        """The postmaster, then every process it started (each backend calls setsid(), so a signal to
        the postmaster's process group would not reach them)."""
        if self.process is None or self.process.poll() is not None:
            return []
        postmaster = self.process.pid
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == postmaster:
                    children.append(int(stat.split("/")[2]))
        return [postmaster, *children]

    def _signal_all(self, signum: int) -> None:
        pids = self.server_pids()
        if signum == signal.SIGCONT:
            pids.reverse()  # the backends first, then the postmaster
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open, nothing answers."""
        self._signal_all(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal_all(signal.SIGCONT)

    def stop(self, timeout: float = 60) -> None:
        """Fast shutdown (SIGINT): connections are closed, new ones refused."""
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL to the postmaster and every backend: a crash; the next start runs crash recovery."""
        if self.process is not None and self.process.poll() is None:
            pids = self.server_pids()
            self._signal_all(signal.SIGKILL)
            self.process.wait()
            wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), "the backends' end", 30)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


async def _admin(url: str, statement: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.exec_driver_sql(statement)
    finally:
        await engine.dispose()


def run_sync(coro: Awaitable[T]) -> T:
    """Run a coroutine to its end on a fresh loop in another thread (callers may be inside a loop)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, asyncio.run(_as_coroutine(coro))))
        except BaseException as exc:
            box.append((False, exc))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    result: T = value
    return result


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


# --- switchable fake servers ----------------------------------------------------------------------
class Mode(enum.StrEnum):
    OK = "ok"
    DOWN = "down"  # not listening: connection refused
    ERROR = "error"  # 500
    THROTTLED = "throttled"  # 429 with Retry-After
    HANG = "hang"  # reads the request, never answers (until the client gives up)


class LoopbackServer:
    """A Starlette app under uvicorn on a fixed loopback port, in a thread of its own; `down()` stops
    listening (new connections are refused, open ones closed) and `up()` listens again on the same
    port."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-server")
        self._thread.start()
        self._server: uvicorn.Server | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self._socket: socket.socket | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def listening(self) -> bool:
        return self._server is not None

    def up(self) -> None:
        if self._server is not None:
            return
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(512)
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        self._server, self._socket = server, sock
        self._task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self._loop)
        wait_for(lambda: server.started, "the fake server to start", 10, 0.01)

    def down(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        assert self._task is not None
        assert self._socket is not None
        with contextlib.suppress(Exception):
            self._task.result(timeout=15)
        self._socket.close()
        self._server = self._task = self._socket = None

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


async def _until_disconnect(request: Request) -> None:
    # Once the body is read, receive() only returns when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class Reply:
    """One message the Bot API accepted: its chat, the order number it names (-1: none), when."""

    chat_id: str
    order: int
    at: float  # time.monotonic()
    mode: str  # the fake's mode when it came


class Switchable:
    """The mode a fake answers with; `down` also stops its server listening."""

    def __init__(self, retry_after: int = 5) -> None:
        self.mode = Mode.OK
        self.retry_after = retry_after
        self.server: LoopbackServer | None = None

    def set_mode(self, mode: Mode | str) -> None:
        self.mode = Mode(mode)
        if self.server is not None:
            if self.mode is Mode.DOWN:
                self.server.down()
            else:
                self.server.up()

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class FakeBotAPI(Switchable):
    """The Telegram Bot API: `sendMessage` answered per the mode; every accepted message recorded.

    In `hang` mode a message is recorded as accepted (the platform took it: the user sees it) and the
    answer never comes, so the gateway's retry after its timeout is a duplicate the user sees twice:
    the duplicate inherent to any at-least-once sender when the platform's answer is lost.
    """

    def __init__(self, retry_after: int = 5) -> None:
        super().__init__(retry_after)
        self.replies: list[Reply] = []
        self.calls: dict[str, int] = {}  # every call by mode, accepted or not
        self._next_id = 0
        self.server = LoopbackServer(
            Starlette(routes=[Route("/bot{token}/{method}", self._handle, methods=["POST"])])
        )

    @property
    def api_base(self) -> str:
        return self.url

    async def _handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        mode = self.mode
        self.calls[mode.value] = self.calls.get(mode.value, 0) + 1
        if request.path_params["method"] != "sendMessage":
            return JSONResponse({"ok": True, "result": True})
        if mode is Mode.ERROR:
            return JSONResponse(
                {"ok": False, "error_code": 500, "description": "Internal Server Error"}, status_code=500
            )
        if mode is Mode.THROTTLED:
            return JSONResponse(
                {
                    "ok": False,
                    "error_code": 429,
                    "description": f"Too Many Requests: retry after {self.retry_after}",
                    "parameters": {"retry_after": self.retry_after},
                },
                status_code=429,
                headers={"Retry-After": str(self.retry_after)},
            )
        found = ORDER_IN_TEXT.search(str(body.get("text") or ""))
        order = int(found.group(1)) if found else -1
        self.replies.append(Reply(str(body.get("chat_id")), order, time.monotonic(), mode.value))
        if mode is Mode.HANG:
            await _until_disconnect(request)
            return Response(status_code=499)
        self._next_id += 1
        return JSONResponse({"ok": True, "result": {"message_id": self._next_id}})

    def per_chat(self) -> dict[str, list[int]]:
        chats: dict[str, list[int]] = {}
        for reply in list(self.replies):
            chats.setdefault(reply.chat_id, []).append(reply.order)
        return chats


class FakeModel(Switchable):
    """An OpenAI-compatible Chat Completions server answering "I couldn't find order <n>." to the last
    user message "Where is order <n>?" (GATEWAY_MODEL=openai:fake, GATEWAY_OPENAI_BASE_URL=`base_url`)."""

    def __init__(self, retry_after: int = 5) -> None:
        super().__init__(retry_after)
        self.calls: dict[str, int] = {}
        self.server = LoopbackServer(
            Starlette(routes=[Route("/v1/chat/completions", self._handle, methods=["POST"])])
        )

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    async def _handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        mode = self.mode
        self.calls[mode.value] = self.calls.get(mode.value, 0) + 1
        if mode is Mode.ERROR:
            return JSONResponse({"error": {"message": "fake outage", "type": "server_error"}}, 500)
        if mode is Mode.THROTTLED:
            return JSONResponse(
                {"error": {"message": "rate limited", "type": "rate_limit_error"}},
                429,
                headers={"Retry-After": str(self.retry_after)},
            )
        if mode is Mode.HANG:
            await _until_disconnect(request)
            return Response(status_code=499)
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        found = ORDER_IN_TEXT.search(str(users[-1].get("content") or "")) if users else None
        content = f"I couldn't find order {found.group(1)}." if found else "How can I help?"
        return JSONResponse(
            {
                "id": "chatcmpl-fault",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "fake"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


# An agent without a model of its own: it runs on GATEWAY_MODEL (FakeModel as openai:fake).
FAKE_MODEL_AGENT = "tests.faultkit_agent:agent"


def fake_model_settings(model: FakeModel) -> dict[str, str]:
    return {
        "GATEWAY_MODEL": "openai:fake",
        "GATEWAY_OPENAI_BASE_URL": model.base_url,
        "GATEWAY_OPENAI_API_KEY": "fake-key",
        "GATEWAY_AGENT": FAKE_MODEL_AGENT,
        "PYTHONPATH": str(REPO_ROOT),
    }


# --- the load ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One distinct message: its order number (unique), chat, update id and place in its chat."""

    order: int
    chat_id: int
    update_id: int
    seq: int

    @property
    def text(self) -> str:
        return f"Where is order {self.order}?"

    def body(self) -> bytes:
        return update_body(self.update_id, self.chat_id, self.seq, self.text)


def update_body(update_id: int, chat_id: int, message_id: int, text: str) -> bytes:
    return json.dumps(
        {
            "update_id": update_id,
            "message": {
                "message_id": message_id,
                "from": {"id": chat_id, "is_bot": False, "first_name": "Fault"},
                "chat": {"id": chat_id, "first_name": "Fault", "type": "private"},
                "date": 1767225600,
                "text": text,
            },
        }
    ).encode()


def conversations(count: int, per_chat: int, *, chat_base: int, order_base: int) -> list[list[Message]]:
    """`count` chats of `per_chat` messages; message i of the run asks for order `order_base + i`."""
    chats: list[list[Message]] = [[] for _ in range(count)]
    for i in range(count * per_chat):
        chat, seq = i % count, i // count
        chats[chat].append(Message(order_base + i, chat_base + chat, order_base + i, seq + 1))
    return chats


@dataclass(frozen=True)
class Delivery:
    """One POST of a message: which replica, when, how long, what came back (0: no answer)."""

    order: int
    replica: int
    started: float
    seconds: float
    status: int
    new: int | None  # the answer's "new" count on a 200
    kind: str  # first, retry, duplicate


WEBHOOK_HEADERS = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": SECRET}


class _Connection:
    """One keep-alive HTTP/1.1 connection: a request written, the status line, headers and a
    Content-Length or chunked body read. (httpx's pool costs milliseconds of CPU per request with
    hundreds of connections open, on a machine the gateways under test need.)"""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, host: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        if "content-length" in fields:
            data = await self.reader.readexactly(int(fields["content-length"]))
        elif fields.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunks.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")
            data = b"".join(chunks)
        else:
            data = await self.reader.read()
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, data

    @property
    def closed(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """Keep-alive connections to one server, one request at a time on each."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        while self._idle:
            connection = self._idle.pop()
            if connection.closed:
                connection.close()
                continue
            try:
                result = await connection.post(f"{self.host}:{self.port}", path, body, headers)
            except (ConnectionError, asyncio.IncompleteReadError):
                # The server closed this idle connection (keep-alive timeout) as we reused it; a
                # client sends again on a new one, so this is not a delivery of its own.
                connection.close()
                continue
            except BaseException:
                connection.close()
                raise
            self._release(connection)
            return result
        reader, writer = await asyncio.open_connection(self.host, self.port)
        connection = _Connection(reader, writer)
        try:
            result = await connection.post(f"{self.host}:{self.port}", path, body, headers)
        except BaseException:
            connection.close()
            raise
        self._release(connection)
        return result

    def _release(self, connection: _Connection) -> None:
        if connection.closed:
            connection.close()
        else:
            self._idle.append(connection)

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


@dataclass
class Driver:
    """Posts messages to replicas as a platform would: a conversation's messages in order, each after
    the previous one's 200; different conversations at once.

    A delivery that is refused (non-200, connection error, timeout) is posted again, to a random
    replica, after a short backoff, until acked or `give_up_at`. With `duplicate_rate`, a message is
    also delivered a second time: at the same moment to another replica ("concurrent"), or after its
    200 to another replica or to the same one.
    """

    replicas: Sequence[str]
    duplicate_rate: float = 0.0  # the share of messages delivered twice
    request_timeout: float = 10.0
    seed: int = 12
    deliveries: list[Delivery] = field(default_factory=list)
    acked_at: dict[int, float] = field(default_factory=dict)  # order -> its first 200
    first_post: dict[int, float] = field(default_factory=dict)  # order -> its first delivery
    give_up_at: float = float("inf")
    duplicated: frozenset[int] | None = None  # exactly these orders twice (instead of duplicate_rate)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._progress = asyncio.Event()
        self._pools = [ConnectionPool(url) for url in self.replicas]

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def post(self, message: Message, replica: int, kind: str) -> int:
        started = time.monotonic()
        self.first_post.setdefault(message.order, started)
        status, new = 0, None
        try:
            async with asyncio.timeout(self.request_timeout):
                status, data = await self._pools[replica].post(WEBHOOK_PATH, message.body(), WEBHOOK_HEADERS)
            if status == 200:
                new = json.loads(data).get("new")
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            status = 0
        done = time.monotonic()
        self.deliveries.append(Delivery(message.order, replica, started, done - started, status, new, kind))
        if status == 200:
            self.acked_at.setdefault(message.order, done)
            self._progress.set()
        return status

    async def until_acked(self, count: int) -> None:
        """Return once `count` distinct messages are acknowledged."""
        while len(self.acked_at) < count:
            self._progress.clear()
            await self._progress.wait()

    async def deliver(self, message: Message, replica: int | None = None, kind: str = "first") -> bool:
        """Post until a 200 (retrying on other replicas) or `give_up_at`; whether it was acked."""
        target = self._rng.randrange(len(self.replicas)) if replica is None else replica
        backoff = 0.2
        while True:
            if await self.post(message, target, kind) == 200:
                return True
            if time.monotonic() + backoff >= self.give_up_at:
                return False
            await asyncio.sleep(backoff)  # a platform's retry delay, not a synchronization
            backoff = min(backoff * 2, 5.0)
            kind = "retry"
            target = self._rng.randrange(len(self.replicas))

    async def deliver_with_duplicates(self, message: Message) -> bool:
        first = self._rng.randrange(len(self.replicas))
        other = (first + 1 + self._rng.randrange(max(1, len(self.replicas) - 1))) % len(self.replicas)
        twice = (
            message.order in self.duplicated
            if self.duplicated is not None
            else self._rng.random() < self.duplicate_rate
        )
        if not twice:
            return await self.deliver(message, first)
        way = self._rng.choice(("concurrent", "later-other", "later-same"))
        if way == "concurrent":
            results = await asyncio.gather(
                self.deliver(message, first), self.deliver(message, other, "duplicate")
            )
            return any(results)
        acked = await self.deliver(message, first)
        await self.deliver(message, other if way == "later-other" else first, "duplicate")
        return acked

    async def run_chat(
        self, chat: Sequence[Message], *, interval: float = 0.0, stop_at: float = float("inf")
    ) -> None:
        """Post a chat's messages in order; `interval` seconds between them (a user's pace)."""
        for message in chat:
            if time.monotonic() >= stop_at:
                return
            if not await self.deliver_with_duplicates(message) and time.monotonic() >= self.give_up_at:
                return
            if interval:
                await asyncio.sleep(interval * self._rng.uniform(0.5, 1.5))  # pacing of the load

    async def run(
        self, chats: Iterable[Sequence[Message]], *, interval: float = 0.0, stop_at: float = float("inf")
    ) -> None:
        await asyncio.gather(*(self.run_chat(chat, interval=interval, stop_at=stop_at) for chat in chats))

    def posted(self) -> set[int]:
        return set(self.first_post)

    def statuses(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for delivery in self.deliveries:
            counts[delivery.status] = counts.get(delivery.status, 0) + 1
        return counts


# --- accounting ----------------------------------------------------------------------------------
@dataclass
class DatabaseCounts:
    inbox: dict[str, int]  # our inbox rows by status
    outbox: dict[str, int]
    stored: set[int]  # orders with an inbox row
    turns: dict[int, int]  # order -> user messages in its session naming it (committed turns)
    session_orders: dict[str, list[int]]  # session -> orders of its user messages, in order
    # Pending inbox rows by why they wait: "leased to <pid>", "held back" (an older row of the
    # conversation waits), "retry later" (a failed turn's backoff) or "due".
    pending: dict[str, int] = field(default_factory=dict)


async def database_counts(database_url: str, chat_ids: Iterable[int]) -> DatabaseCounts:
    """What the database holds for the chats of the run."""
    sessions = [f"telegram:{chat}" for chat in chat_ids]
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            inbox_rows = (
                await conn.execute(
                    select(
                        InboxRow.status,
                        InboxRow.text,
                        InboxRow.session_id,
                        InboxRow.lease_owner,
                        InboxRow.lease_until,
                        InboxRow.next_attempt_at,
                    )
                    .where(InboxRow.session_id.in_(sessions))
                    .order_by(InboxRow.id)
                )
            ).all()
            outbox = (
                await conn.execute(
                    select(OutboxRow.status, func.count())
                    .where(OutboxRow.session_id.in_(sessions))
                    .group_by(OutboxRow.status)
                )
            ).all()
            messages = (
                await conn.execute(
                    select(MessageRow.session_id, MessageRow.message_json)
                    .where(MessageRow.session_id.in_(sessions), MessageRow.role == "user")
                    .order_by(MessageRow.session_id, MessageRow.position)
                )
            ).all()
    finally:
        await engine.dispose()
    inbox: dict[str, int] = {}
    stored: set[int] = set()
    pending: dict[str, int] = {}
    waiting_sessions: set[str] = set()
    now = datetime.now(UTC)
    for status, text, session_id, owner, lease_until, next_attempt_at in inbox_rows:
        inbox[status] = inbox.get(status, 0) + 1
        if status == "pending":
            why = _why_pending(session_id in waiting_sessions, owner, lease_until, next_attempt_at, now)
            pending[why] = pending.get(why, 0) + 1
            waiting_sessions.add(session_id)
        if found := ORDER_IN_TEXT.search(text or ""):
            stored.add(int(found.group(1)))
    turns: dict[int, int] = {}
    session_orders: dict[str, list[int]] = {}
    for session_id, message_json in messages:
        data = message_json if isinstance(message_json, dict) else json.loads(message_json)
        found = ORDER_IN_TEXT.search(str(data.get("content") or ""))
        if found:
            order = int(found.group(1))
            turns[order] = turns.get(order, 0) + 1
            session_orders.setdefault(session_id, []).append(order)
    outbox_counts = {str(status): int(count) for status, count in outbox}
    return DatabaseCounts(inbox, outbox_counts, stored, turns, session_orders, pending)


async def leased_rows(database_url: str, owner_prefix: str) -> tuple[int, int]:
    """Pending inbox and outbox rows leased to owners whose names start with `owner_prefix`."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            counts = []
            for table in (InboxRow, OutboxRow):
                statement = select(func.count()).where(
                    table.status == "pending", table.lease_owner.startswith(owner_prefix)
                )
                counts.append(int((await conn.execute(statement)).scalar_one()))
            return counts[0], counts[1]
    finally:
        await engine.dispose()


def _why_pending(
    held_back: bool,
    owner: str | None,
    lease_until: datetime | None,
    next_attempt_at: datetime | None,
    now: datetime,
) -> str:
    def utc(value: datetime) -> datetime:  # naive values are UTC
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    if owner and lease_until is not None and utc(lease_until) > now:
        return f"leased to pid {owner.split(':')[1]}"
    if held_back:
        return "held back"
    if next_attempt_at is not None and utc(next_attempt_at) > now:
        return "retry later"
    return "due"


@dataclass
class Tally:
    """The figures of one run, per the reliability issue's columns."""

    deliveries: int  # POSTs made: first deliveries, retries and duplicates
    acked: int  # distinct messages that got a 200
    stored: int  # distinct messages with an inbox row
    turns: int  # committed turns (user messages in the sessions) for those messages
    replies: int  # messages the platform accepted (duplicates included)
    lost: int  # acked messages with no reply at the end
    duplicated: int  # messages with more than one reply
    extra_turns: int  # turns beyond one per message
    out_of_order: int  # chats whose replies came in another order than their messages
    p99_ack: float  # seconds from a message's first delivery to its 200, 99th percentile
    recover: float | None  # fault end -> last reply to a message posted before it; None: never
    unanswered: list[int] = field(default_factory=list)  # the lost orders (a sample)

    def row(self) -> list[str]:
        recover = "not recovered" if self.recover is None else f"{self.recover:.1f} s"
        return [
            str(self.deliveries),
            str(self.acked),
            str(self.stored),
            str(self.turns),
            str(self.replies),
            str(self.lost),
            str(self.duplicated),
            f"{self.p99_ack * 1000:.0f} ms",
            recover,
        ]


def percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def tally(
    driver: Driver,
    platform: FakeBotAPI,
    chats: Sequence[Sequence[Message]],
    counts: DatabaseCounts,
    *,
    fault_end: float | None = None,
) -> Tally:
    posted = driver.posted()
    acked = set(driver.acked_at)
    replies_by_order: dict[int, list[Reply]] = {}
    for reply in list(platform.replies):
        replies_by_order.setdefault(reply.order, []).append(reply)
    ours = {reply.order for reply in platform.replies} & posted
    lost = sorted(acked - ours)
    duplicated = sum(1 for order in posted if len(replies_by_order.get(order, [])) > 1)
    per_chat = platform.per_chat()
    out_of_order = 0
    for chat in chats:
        expected = [m.order for m in chat if m.order in ours]
        got = _first_seen([o for o in per_chat.get(str(chat[0].chat_id), []) if o in ours])
        out_of_order += got != expected
    ack_times = [driver.acked_at[o] - driver.first_post[o] for o in acked]
    recover: float | None = None
    if fault_end is not None:
        before = {o for o in acked if driver.first_post[o] <= fault_end}
        if before - ours:
            recover = None
        else:
            last = max((min(r.at for r in replies_by_order[o]) for o in before), default=fault_end)
            recover = max(0.0, last - fault_end)
    return Tally(
        deliveries=len(driver.deliveries),
        acked=len(acked),
        stored=len(counts.stored & posted),
        turns=sum(n for order, n in counts.turns.items() if order in posted),
        replies=sum(len(replies_by_order.get(order, [])) for order in posted),
        lost=len(lost),
        duplicated=duplicated,
        extra_turns=sum(n - 1 for order, n in counts.turns.items() if order in posted and n > 1),
        out_of_order=out_of_order,
        p99_ack=percentile(ack_times, 0.99),
        recover=recover,
        unanswered=lost[:20],
    )


def _first_seen(orders: Iterable[int]) -> list[int]:
    seen: set[int] = set()
    kept = []
    for order in orders:
        if order not in seen:
            seen.add(order)
            kept.append(order)
    return kept


def answered(platform: FakeBotAPI, orders: Iterable[int]) -> bool:
    """Whether every one of `orders` has a reply at the platform."""
    got = {reply.order for reply in list(platform.replies)}
    return all(order in got for order in orders)


def wait_answered(platform: FakeBotAPI, orders: Iterable[int], timeout: float) -> bool:
    """Wait until every one of `orders` has a reply, at most `timeout` seconds; whether they all do."""
    wanted = set(orders)
    try:
        wait_for(lambda: answered(platform, wanted), "the replies", timeout)
    except TimeoutError:
        return False
    return True


@contextlib.contextmanager
def stopping(*closers: Callable[[], Any]) -> Iterator[None]:
    """Run every closer at the end, in reverse, even when one fails."""
    try:
        yield
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()


# --- hostile clients -------------------------------------------------------------------------------
async def slow_client(url: str, stop: asyncio.Event, byte_every: float = 1.0) -> None:
    """A client that opens a connection and sends a webhook's headers one byte at a time until `stop`."""
    host, _, port = url.removeprefix("http://").partition(":")
    head = (
        f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-Telegram-Bot-Api-Secret-Token: {SECRET}\r\nContent-Length: 100000\r\n"
    ).encode()
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return
    try:
        for index in range(len(head)):
            writer.write(head[index : index + 1])
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(byte_every):
                    await stop.wait()  # the client's pace, cut short by the end of the fault
            if stop.is_set():
                return
    except OSError:
        return
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def poison_bodies(chat_base: int, update_base: int) -> list[tuple[str, bytes]]:
    """Webhook bodies that are valid JSON with hostile values, each in a chat of its own."""

    def update(n: int, text: Any, **message: Any) -> dict[str, Any]:
        chat = chat_base + n
        body = {
            "message_id": 1,
            "from": {"id": chat, "is_bot": False, "first_name": "Poison"},
            "chat": {"id": chat, "type": "private"},
            "date": 1767225600,
            "text": text,
        }
        body.update(message)
        return {"update_id": update_base + n, "message": body}

    cases: list[tuple[str, Any]] = [
        ("NUL character in the text", update(0, "hello\u0000world")),
        ("lone surrogate in the text", update(1, "half \ud83d of an emoji")),
        ("NUL in the sender's name", update(2, "hi", **{"from": {"id": 1, "first_name": "a\u0000b"}})),
        ("update_id beyond 64 bits", {**update(3, "big id"), "update_id": 2**70}),
        ("chat id beyond 64 bits", update(4, "big chat", chat={"id": 2**70, "type": "private"})),
        ("text is a number", update(5, 12345)),
        ("text is an object", update(6, {"nested": [1, 2, {"deep": None}]})),
        ("100,000-character text", update(7, "x" * 100_000)),
        ("negative date", update(8, "old", date=-1)),
        ("control characters", update(9, "\u0001\u0002\u001b[31mred\u007f")),
    ]
    return [(name, json.dumps(body).encode()) for name, body in cases]
