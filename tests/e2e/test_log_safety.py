"""Everything the real `gateway serve` writes during a faulty run: no message text, phone number, name
or secret in it, and no line over the bound (issue 12, item 7).

The run goes through the failure paths on purpose: a tool that raises with the user's phone in its
message and the user's text and a 300-level structure in its locals, a model that answers 400 quoting the
user (the turn is dead at once; the test retries it as an operator would, through the admin API), a
platform that answers 500, then 400 naming the phone, and hangs, signed webhooks that are 990 levels
deep or hold NUL characters, NaN and a 3 MB string, bad signatures, bad JSON, and admin requests
naming a user's session. The process logs JSON at debug level; the test reads all of its stdout and stderr
and looks for every distinctive value it sent, in the forms it could take.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.log_safety import MAX_LINE_BYTES
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from tests.conftest import POSTGRES_ENV, POSTGRES_SKIP_REASON
from tests.fakes import FakeTelegram, chat_completion, openai_error, tool_call
from tests.helpers import GATEWAY, free_port, gateway_env, postgres_database, serve_in_thread, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEADLINE_SECONDS = 90
# Secrets: each must never appear.
APP_SECRET = "wa-app-secret-Hx81Qz"
ACCESS_TOKEN = "wa-access-token-Pm42Vn"
TG_SECRET = "tg-secret-token-Lr07Ks"
BOT_TOKEN = "7700112233:tg-bot-token-Wq55Jd"
ADMIN_TOKEN = "admin-token-Zt93Bc-long-enough"
OPENAI_KEY = "sk-openai-key-Yv26Gf"
SECRETS = (APP_SECRET, ACCESS_TOKEN, TG_SECRET, BOT_TOKEN, "tg-bot-token-Wq55Jd", ADMIN_TOKEN, OPENAI_KEY)

PHONE_NUMBER_ID = "106540352242922"  # the business number
# Users' phone numbers (wa_ids), a Telegram user's chat id and a shared contact's phone.
TOOL_USER = "447700900123"  # its turn calls a tool that fails, then the model refuses, then delivery fails
HANG_USER = "16505550187"  # its reply meets a platform that never answers
NUL_USER = "5511987654321"  # its message holds NUL characters, NaN and a 3 MB string
DEEP_USER = "33612349876"  # its update is 990 levels deep
REJECTED_USER = "4915112345678"  # in webhooks refused for their signature or their JSON
ADMIN_USER = "12025550143"  # named in admin requests only
CONTACT_PHONE = "+34612987654"
TG_CHAT = 7301234567
PHONES = (TOOL_USER, HANG_USER, NUL_USER, DEEP_USER, REJECTED_USER, ADMIN_USER, CONTACT_PHONE.lstrip("+"))
USER_IDS = (*PHONES, str(TG_CHAT))
# A message id as WhatsApp makes them: base64 that spells the sender's phone.
NUL_WAMID_BODY = base64.b64encode(
    b"\x1c\x18\x0d" + NUL_USER.encode() + b"\x15\x02\x00\x11\x18\x129A3CA5B3D4"
).decode()
NAMES = ("Zebulon Quixmore", "Ottoline Brackwater", "Perpetua Vandersnoot")
# Message texts (and the bot's replies): each must never appear, whole or in part.
TOOL_TEXT = "please-look-up-kumquat-zephyr"
HANG_TEXT = "hanging-marmalade-quasar"
NUL_TEXT = "nul-and-nan-damson-nova"
DEEP_TEXT = "deep-nesting-gazpacho-nebula"
REJECTED_TEXT = "unsigned-tangerine-pulsar"
TG_TEXT = "telegram-rhubarb-comet"
TITLE_TEXT = "admin-title-persimmon-aurora"
HUGE_MARKER = "megabytes-of-quince-"
REPLY_TEXT = "bot-reply-clementine-galaxy"
TEXTS = (
    TOOL_TEXT,
    HANG_TEXT,
    NUL_TEXT,
    DEEP_TEXT,
    REJECTED_TEXT,
    TG_TEXT,
    TITLE_TEXT,
    HUGE_MARKER,
    REPLY_TEXT,
)

AGENT_MODULE = '''
from gateway.agents import Agent, tool


@tool
def find_customer(phone: str, note: str, details: dict | None = None) -> str:
    """Find a customer by phone number."""
    record = {"phone": phone, "note": note, "details": details}
    raise LookupError(f"no customer with phone {record['phone']}")


agent = Agent("desk", "Answer briefly.", tools=[find_customer])
'''


# --- the fakes: a model and WhatsApp that answer by conversation, Telegram refusing every send -------


@dataclass
class FakeModel:
    """An OpenAI-compatible model: the tool user's turn asks for the failing tool (the first time with
    arguments 300 levels deep), and its first answer after the tool's error is a 400 quoting the user;
    every other request gets the reply."""

    tool_calls: int = 0
    refused: int = 0

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])])

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        messages = body["messages"]
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        if TOOL_TEXT in first_user:
            if not any(m["role"] == "tool" for m in messages):
                self.tool_calls += 1
                arguments = json.dumps({"phone": f"+{TOOL_USER}", "note": TOOL_TEXT, "details": None})
                if self.tool_calls == 1:  # deep, so each local holding it renders to hundreds of KB
                    arguments = arguments.replace("null", deep(300, f"{TOOL_TEXT} +{TOOL_USER}"))
                call = tool_call("call_1", "find_customer", arguments)
                return JSONResponse(chat_completion(tool_calls=[call]))
            if not self.refused:
                self.refused += 1
                quoted = f"Invalid prompt from +{TOOL_USER}: {first_user[:80]}"
                return JSONResponse(openai_error(quoted), status_code=400)
        return JSONResponse(chat_completion(REPLY_TEXT))


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class FakeGraph:
    """The Graph API's send endpoint: per recipient, scripted answers first ("hang" never answers)."""

    script: dict[str, deque[Any]] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{scope}/messages", self._send, methods=["POST"])])

    async def _send(self, request: Request) -> Response:
        body = await request.json()
        recipient = str(body.get("to"))
        self.received.append(recipient)
        answers = self.script.get(recipient)
        answer = answers.popleft() if answers else None
        if answer == "hang":
            await _until_disconnect(request)
            return Response(status_code=499)
        if answer is not None:
            status, error = answer
            return JSONResponse({"error": error}, status_code=status)
        return JSONResponse({"messaging_product": "whatsapp", "messages": [{"id": "wamid.out1"}]})


@dataclass(frozen=True)
class Fakes:
    model: FakeModel
    graph: FakeGraph
    telegram: FakeTelegram
    urls: dict[str, str]


@contextmanager
def fakes() -> Iterator[Fakes]:
    graph = FakeGraph()
    graph.script[TOOL_USER] = deque(
        [
            (500, {"message": "Service temporarily unavailable", "code": 131000}),
            (400, {"message": f"Recipient phone number {TOOL_USER} not in allowed list", "code": 131030}),
        ]
    )
    graph.script[HANG_USER] = deque(["hang"])
    telegram = FakeTelegram(BOT_TOKEN)
    telegram.errors["sendMessage"] = (
        400,
        {"error_code": 400, "description": f"Bad Request: can't parse entities in {REPLY_TEXT}"},
    )
    model = FakeModel()
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(serve_in_thread(app))
            for name, app in (("model", model.app), ("graph", graph.app), ("telegram", telegram.app))
        }
        yield Fakes(model, graph, telegram, urls)


# --- webhooks -------------------------------------------------------------------------------------------


def whatsapp_body(phone: str, name: str, wamid: str, text: str, **extra: Any) -> dict[str, Any]:
    message = {"from": phone, "id": wamid, "timestamp": "1776160800", "type": "text", "text": {"body": text}}
    value = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550783881", "phone_number_id": PHONE_NUMBER_ID},
        "contacts": [{"profile": {"name": name}, "wa_id": phone}],
        "messages": [{**message, **extra}],
    }
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "102290129340398", "changes": [{"value": value, "field": "messages"}]}],
    }


def deep(levels: int, leaf: str) -> str:
    """JSON text nested `levels` deep (built as text: json.dumps itself would hit the recursion limit)."""
    return '{"k":' * levels + json.dumps(leaf) + "}" * levels


def post_whatsapp(base: str, body: bytes, *, signature: str | None = None) -> httpx.Response:
    headers = {
        "X-Hub-Signature-256": signature or WhatsAppAdapter.sign(APP_SECRET, body),
        "Content-Type": "application/json",
    }
    return httpx.post(f"{base}/webhooks/whatsapp", content=body, headers=headers, timeout=60)


def post_telegram(base: str, update: dict[str, Any], secret: str = TG_SECRET) -> httpx.Response:
    headers = {"X-Telegram-Bot-Api-Secret-Token": secret, "Content-Type": "application/json"}
    return httpx.post(f"{base}/webhooks/telegram", content=json.dumps(update), headers=headers, timeout=60)


def telegram_update(update_id: int, **content: Any) -> dict[str, Any]:
    person = {
        "id": TG_CHAT,
        "is_bot": False,
        "first_name": NAMES[2].split()[0],
        "last_name": NAMES[2].split()[1],
    }
    message = {"message_id": update_id, "date": 1767225600, "chat": {**person, "type": "private"}}
    return {"update_id": update_id, "message": {**message, "from": person, **content}}


def drive_faulty_run(base: str) -> None:
    """Every request of the run, with the answers the gateway must give."""
    tool_body = json.dumps(whatsapp_body(TOOL_USER, NAMES[0], "wamid.log-safety-1", TOOL_TEXT))
    assert post_whatsapp(base, tool_body.encode()).status_code == 200

    hang = json.dumps(whatsapp_body(HANG_USER, NAMES[1], "wamid.log-safety-2", HANG_TEXT))
    assert post_whatsapp(base, hang.encode()).status_code == 200

    # NUL characters, NaN (as the timestamp: logged as invalid, with the message id) and a 3 MB string
    # (the body stays under the 4 MiB limit). PostgreSQL cannot store NUL, so there the update is refused
    # with 503 (and the platform retries it).
    text = f"{NUL_TEXT}\x00\x00 {HUGE_MARKER * 150_000}"
    nul = whatsapp_body(NUL_USER, NAMES[1], f"wamid.{NUL_WAMID_BODY}", text, timestamp=float("nan"))
    assert post_whatsapp(base, json.dumps(nul).encode()).status_code in (200, 503)

    # 990 levels deep, in a field the adapter does not read (the update is kept raw).
    deep_body = json.dumps(
        whatsapp_body(DEEP_USER, NAMES[1], "wamid.log-safety-3", DEEP_TEXT, x_deep="@DEEP@")
    )
    deep_body = deep_body.replace('"@DEEP@"', deep(990, f"{DEEP_TEXT} +{DEEP_USER}"))
    assert post_whatsapp(base, deep_body.encode()).status_code in (200, 400, 500, 503)

    rejected = json.dumps(
        whatsapp_body(REJECTED_USER, NAMES[0], "wamid.log-safety-4", REJECTED_TEXT)
    ).encode()
    assert post_whatsapp(base, rejected, signature="sha256=" + "0" * 64).status_code == 401
    broken = rejected[:-7] + b"\x00 {{" + REJECTED_TEXT.encode()
    assert post_whatsapp(base, broken).status_code == 400

    assert post_telegram(base, telegram_update(830000101, text=TG_TEXT)).status_code == 200
    contact = {"phone_number": CONTACT_PHONE, "first_name": NAMES[2], "vcard": f"TEL:{CONTACT_PHONE}"}
    assert post_telegram(base, telegram_update(830000102, contact=contact)).status_code == 200
    assert post_telegram(base, telegram_update(830000103, text=TG_TEXT), secret="wrong").status_code == 401

    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    session = f"whatsapp:{PHONE_NUMBER_ID}:{ADMIN_USER}"
    created = httpx.post(
        f"{base}/api/sessions", json={"session_id": session, "title": TITLE_TEXT}, headers=admin, timeout=60
    )
    assert created.status_code == 201, created.text
    assert httpx.get(f"{base}/api/sessions/{session}", headers=admin, timeout=60).status_code == 200
    wrong = {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}x"}
    assert httpx.get(f"{base}/api/sessions/{session}", headers=wrong, timeout=60).status_code == 401


# --- the process ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    stdout: bytes
    stderr: bytes

    @property
    def lines(self) -> list[bytes]:
        return self.stdout.splitlines() + self.stderr.splitlines()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line.strip()]


def events_so_far(cwd: Path) -> list[str]:
    """The names of the events logged so far (a line being written is skipped)."""
    names = []
    for line in (cwd / "stderr.log").read_bytes().splitlines():
        try:
            names.append(str(json.loads(line).get("event")))
        except ValueError:
            continue
    return names


def faulty_run(cwd: Path, database_url: str, redact_users: bool) -> Output:
    (cwd / "log_safety_agent.py").write_text(AGENT_MODULE)
    with fakes() as fake:
        env = gateway_env(
            GATEWAY_DATABASE_URL=database_url,
            GATEWAY_LOG_FORMAT="json",
            GATEWAY_LOG_LEVEL="debug",
            GATEWAY_LOG_REDACT_USERS=str(redact_users).lower(),
            GATEWAY_AGENT="log_safety_agent:agent",
            GATEWAY_MODEL="openai:fake-model",
            GATEWAY_OPENAI_BASE_URL=f"{fake.urls['model']}/v1",
            GATEWAY_OPENAI_API_KEY=OPENAI_KEY,
            GATEWAY_ADMIN_TOKEN=ADMIN_TOKEN,
            GATEWAY_WHATSAPP_APP_SECRET=APP_SECRET,
            GATEWAY_WHATSAPP_ACCESS_TOKEN=ACCESS_TOKEN,
            GATEWAY_WHATSAPP_API_BASE=fake.urls["graph"],
            GATEWAY_WHATSAPP_GLOBAL_PER_SECOND="0",
            GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET,
            GATEWAY_TELEGRAM_BOT_TOKEN=BOT_TOKEN,
            GATEWAY_TELEGRAM_API_BASE=fake.urls["telegram"],
            GATEWAY_TELEGRAM_CHAT_PER_SECOND="0",
            GATEWAY_TELEGRAM_GROUP_PER_MINUTE="0",
            GATEWAY_TELEGRAM_GLOBAL_PER_SECOND="0",
            PYTHONPATH=str(cwd),
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with (cwd / "stdout.log").open("wb") as out, (cwd / "stderr.log").open("wb") as err:
            process = subprocess.Popen(
                [GATEWAY, "serve", "--port", str(port)], cwd=cwd, env=env, stdout=out, stderr=err
            )
        try:
            wait_until(lambda: _ready(process, base), "the gateway to be ready", DEADLINE_SECONDS)
            drive_faulty_run(base)
            retry_the_dead_turn(cwd, base)
            # Done when the tool user's reply failed for good, the hanging send is in flight and both
            # Telegram replies were refused.
            wait_until(
                lambda: events_so_far(cwd).count("reply_failed") >= 3 and HANG_USER in fake.graph.received,
                "the failures of the run",
                DEADLINE_SECONDS,
            )
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
        assert code == 0, (cwd / "stderr.log").read_text(errors="replace")[-4000:]
    return Output((cwd / "stdout.log").read_bytes(), (cwd / "stderr.log").read_bytes())


def retry_the_dead_turn(cwd: Path, base: str) -> None:
    """The model's 400 made the tool user's turn dead at once (a permanent error); an operator's retry
    runs it again, and the model answers this time."""
    wait_until(
        lambda: "turn_dead_lettered" in events_so_far(cwd), "the turn refused by the model", DEADLINE_SECONDS
    )
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    (dead,) = httpx.get(f"{base}/api/inbox", params={"status": "dead"}, headers=admin, timeout=60).json()[
        "items"
    ]
    assert httpx.post(f"{base}/api/inbox/{dead['id']}/retry", headers=admin, timeout=60).status_code == 200


def _ready(process: subprocess.Popen[bytes], base: str) -> bool:
    assert process.poll() is None, f"gateway serve exited with {process.returncode}"
    try:
        return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def forms_of_phone(digits: str) -> list[str]:
    """The ways a phone number can be written in a log: its digits, with +, JSON-escaped + (\\u002b)."""
    return [digits, f"+{digits}", f"\\u002b{digits}"]


# --- the test -------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'db' / 'gateway.db'}"
        return
    admin_url = os.environ.get(POSTGRES_ENV)
    if not admin_url:
        pytest.skip(reason=POSTGRES_SKIP_REASON)
    with postgres_database(admin_url) as url:
        yield url


@pytest.mark.parametrize("redact_users", [False, True], ids=["default", "redact-users"])
def test_a_faulty_run_logs_no_text_phone_name_or_secret_and_no_long_line(
    tmp_path: Path, database_url: str, redact_users: bool
) -> None:
    output = faulty_run(tmp_path, database_url, redact_users)
    everything = output.stdout + output.stderr
    text = everything.decode("utf-8", "replace")

    # The run went through the failure paths (so the checks below look at what they logged).
    events = output.events()  # every line is one JSON object
    names = [e.get("event") for e in events]
    for expected in ("tool_failed", "turn_dead_lettered", "reply_retry", "reply_failed", "webhook_rejected"):
        assert expected in names, f"no {expected} event: the run did not take that path"
    tracebacks = [e for e in events if e.get("event") == "tool_traceback"]
    assert tracebacks, "the tool's traceback was not logged"
    assert tracebacks[0]["exception"][0]["exc_type"] == "LookupError"
    (invalid_time,) = [e for e in events if e.get("event") == "whatsapp_timestamp_invalid"]

    longest = max(len(line) for line in output.lines)
    assert longest <= MAX_LINE_BYTES, f"a line of {longest} bytes"

    found = [value for value in TEXTS + NAMES + SECRETS if value in text]
    found += [form for user in USER_IDS for form in forms_of_phone(user) if form in text]
    found += [NUL_WAMID_BODY[:20]] if NUL_WAMID_BODY[:20] in text else []  # the phone, in base64
    assert not found, f"in the logs: {found}"
    # Nor a plain (unkeyed) hash of a phone, which anyone could match against all phone numbers.
    assert not [p for p in PHONES if hashlib.sha256(p.encode()).hexdigest()[:10] in text]

    turn_lines = [e for e in events if e.get("event") in ("tool_failed", "turn_dead_lettered")]
    sessions = {e.get("session_id") for e in turn_lines}
    assert len(sessions) == 1, sessions  # both lines of that turn name the same conversation
    (session,) = sessions
    admin_paths = {e["path"] for e in events if str(e.get("path")).startswith("/api/sessions/")}
    if redact_users:
        assert re.fullmatch(r"whatsapp:id_[0-9a-f]{10}:id_[0-9a-f]{10}", str(session)), session
        assert re.fullmatch(r"wamid\.id_[0-9a-f]{10}", invalid_time["message_id"])
        (path,) = admin_paths
        assert re.fullmatch(r"/api/sessions/whatsapp:id_[0-9a-f]{10}:id_[0-9a-f]{10}", path)
        assert path.split(":")[1] == str(session).split(":")[1]  # the business number, hashed alike
    else:
        assert session == f"whatsapp:***2922:***{TOOL_USER[-4:]}"
        assert invalid_time["message_id"] == f"wamid.***{NUL_WAMID_BODY[-6:]}"
        assert admin_paths == {f"/api/sessions/whatsapp:***2922:***{ADMIN_USER[-4:]}"}
