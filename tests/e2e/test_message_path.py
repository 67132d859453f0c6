"""The whole message path through the real `gateway serve`: a webhook in, the reply out at the platform.

One deployment per backend (an SQLite file, PostgreSQL), shared by this module's tests: two `gateway
serve` processes on one database (the first migrates it, the second joins with `--no-migrate`), with
WhatsApp and Telegram pointed at fake platform servers on loopback (tests/fakes.py). Tests post signed
webhooks over real HTTP, wait with a deadline until the fakes received the replies, and read the
database. Each test uses conversations and message ids of its own, so the tests do not see each
other's messages. The agent is the default demo desk (gateway/demo.py): it answers "order <number>"
naming the number, so a reply shows which message it answers.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
import signal
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from gateway.agents import Runner, SessionStore
from gateway.demo import ORDERS
from gateway.demo import agent as demo_agent
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, MessageRow, OutboxRow, ProcessedMessageRow
from tests.conftest import POSTGRES_ENV, POSTGRES_SKIP_REASON
from tests.fakes import FakeTelegram, FakeWhatsApp, RecordedRequest
from tests.helpers import GATEWAY, free_port, gateway_env, postgres_database, serve_in_thread, wait_until

pytestmark = pytest.mark.e2e

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
APP_SECRET = "wa-app-secret-e2e"
ACCESS_TOKEN = "wa-access-token-e2e"
TG_SECRET = "tg-secret_token-e2e"
BOT_ID = "5550001"
BOT_TOKEN = f"{BOT_ID}:fake-bot-token_e2e"
PHONE_NUMBER_ID = "106540352242922"  # the business number of tests/payloads/whatsapp
OTHER_PHONE_NUMBER_ID = "220099887766554"
TG_MESSAGE_ID = 9001  # what the fake Bot API answers to sendMessage
DEADLINE_SECONDS = 90  # generous: the machine may be busy; conditions, not sleeps, decide
ACCEPTED_ONE = {"status": "accepted", "new": 1, "duplicates": 0}
DUPLICATE_ONE = {"status": "accepted", "new": 0, "duplicates": 1}


# --- the fake platforms ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Platforms:
    telegram: FakeTelegram
    whatsapp: FakeWhatsApp
    telegram_url: str
    whatsapp_url: str

    def whatsapp_reply_requests(self) -> list[tuple[int, RecordedRequest]]:
        """Text sends, with their index among all requests (mark-as-read or typing bodies are no replies)."""
        return [(i, r) for i, r in enumerate(list(self.whatsapp.requests)) if r.json.get("type") == "text"]

    def replies(self) -> dict[str, list[str]]:
        """Reply texts by address, each in the order the platform received them.

        Addresses: `telegram:<chat id>`, `whatsapp:<phone number id>:<phone, or else user id>`.
        """
        by_address: dict[str, list[str]] = defaultdict(list)
        for call in self.telegram.calls("sendMessage"):
            by_address[f"telegram:{call['chat_id']}"].append(call["text"])
        for _, request in self.whatsapp_reply_requests():
            scope = request.path.split("/")[1]
            recipient = request.json.get("to") or request.json.get("recipient")
            by_address[f"whatsapp:{scope}:{recipient}"].append(request.json["text"]["body"])
        return dict(by_address)

    def replies_to(self, addresses: Iterable[str]) -> dict[str, list[str]]:
        replies = self.replies()
        return {address: replies.get(address, []) for address in addresses}

    def wait_for_replies(self, addresses: Iterable[str], count: int) -> dict[str, list[str]]:
        """Wait until `count` replies in all reached these addresses; the replies to each."""
        addresses = list(addresses)

        def arrived() -> dict[str, list[str]] | None:
            replies = self.replies_to(addresses)
            return replies if sum(map(len, replies.values())) >= count else None

        return wait_until(arrived, f"{count} replies at the fake platforms", DEADLINE_SECONDS)


@contextmanager
def fake_platforms() -> Iterator[Platforms]:
    telegram = FakeTelegram(BOT_TOKEN)
    telegram.results["sendMessage"] = {
        "message_id": TG_MESSAGE_ID,
        "date": 1767225600,
        "chat": {"id": 0, "type": "private"},
    }
    whatsapp = FakeWhatsApp()
    with serve_in_thread(telegram.app) as telegram_url, serve_in_thread(whatsapp.app) as whatsapp_url:
        yield Platforms(telegram, whatsapp, telegram_url, whatsapp_url)


# --- the gateway processes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Gateway:
    base: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def settings_env(database_url: str, platforms: Platforms) -> dict[str, str]:
    return gateway_env(
        GATEWAY_DATABASE_URL=database_url,
        GATEWAY_LOG_FORMAT="json",
        GATEWAY_WHATSAPP_APP_SECRET=APP_SECRET,
        GATEWAY_WHATSAPP_ACCESS_TOKEN=ACCESS_TOKEN,
        GATEWAY_WHATSAPP_API_BASE=platforms.whatsapp_url,
        GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET,
        GATEWAY_TELEGRAM_BOT_TOKEN=BOT_TOKEN,
        GATEWAY_TELEGRAM_API_BASE=platforms.telegram_url,
        # No pacing: these tests are about correctness, and the fakes take any rate.
        GATEWAY_TELEGRAM_CHAT_PER_SECOND="0",
        GATEWAY_TELEGRAM_GROUP_PER_MINUTE="0",
        GATEWAY_TELEGRAM_GLOBAL_PER_SECOND="0",
        GATEWAY_WHATSAPP_GLOBAL_PER_SECOND="0",
    )


def start_gateway(cwd: Path, env: dict[str, str], name: str, *args: str) -> Gateway:
    port = free_port()
    log = cwd / f"{name}.log"
    with log.open("wb") as out:  # a file, not a pipe: nobody has to drain it while the tests run
        process = subprocess.Popen(
            [GATEWAY, "serve", "--port", str(port), *args],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Gateway(f"http://127.0.0.1:{port}", process, log)


def wait_ready(gateway: Gateway) -> None:
    def ready() -> bool:
        if gateway.process.poll() is not None:
            pytest.fail(f"gateway serve exited with {gateway.process.returncode}:\n{gateway.log_tail()}")
        try:
            return httpx.get(f"{gateway.base}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, f"{gateway.base}/readyz", timeout=DEADLINE_SECONDS)


def stop_gateway(gateway: Gateway) -> int:
    if gateway.process.poll() is None:
        gateway.process.send_signal(signal.SIGTERM)
    try:
        return gateway.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        gateway.process.kill()
        gateway.process.wait()
        return -9


@contextmanager
def running_gateways(cwd: Path, env: dict[str, str], count: int) -> Iterator[list[Gateway]]:
    """`count` `gateway serve` processes on one database: the first migrates it, the others only join."""
    started: list[Gateway] = []
    try:
        for index in range(count):
            args = ("--no-migrate",) if index else ()
            started.append(start_gateway(cwd, env, f"gateway-{index}", *args))
            wait_ready(started[-1])
        yield started
    finally:
        codes = [stop_gateway(gateway) for gateway in started]
    for gateway, code in zip(started, codes, strict=True):
        assert code == 0, f"gateway serve exited with {code} on SIGTERM:\n{gateway.log_tail()}"


@dataclass(frozen=True)
class Deployment:
    database_url: str
    platforms: Platforms
    gateways: list[Gateway]
    cwd: Path


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """Two `gateway serve` replicas on one database and the fake platforms, for this module's tests."""
    cwd = tmp_path_factory.mktemp(f"deployment-{request.param}")
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite+aiosqlite:///{cwd / 'db' / 'gateway.db'}"
        else:
            admin_url = os.environ.get(POSTGRES_ENV)
            if not admin_url:
                pytest.skip(reason=POSTGRES_SKIP_REASON)
            url = stack.enter_context(postgres_database(admin_url))
        platforms = stack.enter_context(fake_platforms())
        gateways = stack.enter_context(running_gateways(cwd, settings_env(url, platforms), count=2))
        yield Deployment(url, platforms, gateways, cwd)


# --- webhooks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Post:
    url: str
    body: bytes
    headers: dict[str, str]


def whatsapp_post(base: str, payload: dict[str, Any]) -> Post:
    body = json.dumps(payload).encode()  # signed byte for byte, as Meta does
    headers = {
        "X-Hub-Signature-256": WhatsAppAdapter.sign(APP_SECRET, body),
        "Content-Type": "application/json",
    }
    return Post(f"{base}/webhooks/whatsapp", body, headers)


def telegram_post(base: str, update: dict[str, Any]) -> Post:
    headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET, "Content-Type": "application/json"}
    return Post(f"{base}/webhooks/telegram", json.dumps(update).encode(), headers)


async def _send(client: httpx.AsyncClient, post: Post) -> httpx.Response:
    return await client.post(post.url, content=post.body, headers=post.headers)


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=200, max_keepalive_connections=0)
    )


def fire(posts: Sequence[Post]) -> list[httpx.Response]:
    """Send all `posts` at once (concurrently); their responses in the same order."""

    async def run() -> list[httpx.Response]:
        async with _client() as client:
            return list(await asyncio.gather(*(_send(client, post) for post in posts)))

    return asyncio.run(run())


def fire_in_order(conversations: Sequence[Sequence[Sequence[Post]]]) -> list[list[list[httpx.Response]]]:
    """Conversations concurrently; within one, each step's posts at once, the next step after they answer.

    A message is sent only once the previous one of its conversation was acknowledged, so the order
    of each conversation is defined, as a platform defines it (one update at a time per chat).
    """

    async def conversation(client: httpx.AsyncClient, steps: Sequence[Sequence[Post]]) -> list[Any]:
        return [list(await asyncio.gather(*(_send(client, post) for post in step))) for step in steps]

    async def run() -> list[list[list[httpx.Response]]]:
        async with _client() as client:
            return list(await asyncio.gather(*(conversation(client, steps) for steps in conversations)))

    return asyncio.run(run())


def assert_ok(responses: Sequence[httpx.Response]) -> None:
    failed = [(r.status_code, r.text) for r in responses if r.status_code != 200]
    assert not failed, f"{len(failed)} of {len(responses)} webhooks not acknowledged: {failed[:5]}"


# --- payloads (shapes of tests/payloads) -------------------------------------------------------------


@dataclass(frozen=True)
class WhatsAppUser:
    phone: str | None
    bsuid: str | None = None
    scope: str = PHONE_NUMBER_ID

    @property
    def session_id(self) -> str:
        """Users are keyed by their business-scoped user id when WhatsApp sends one, else by phone."""
        return f"whatsapp:{self.scope}:{self.bsuid or self.phone}"

    @property
    def address(self) -> str:
        """Where replies go (see Platforms.replies): to the phone when known, else to the user id."""
        return f"whatsapp:{self.scope}:{self.phone or self.bsuid}"


def whatsapp_message(user: WhatsAppUser, wamid: str, text: str) -> dict[str, Any]:
    message: dict[str, Any] = {"id": wamid, "timestamp": "1776160800", "type": "text", "text": {"body": text}}
    if user.phone:
        message["from"] = user.phone
    if user.bsuid:
        message["from_user_id"] = user.bsuid
    return message


def whatsapp_change(scope: str, users: Sequence[WhatsAppUser], messages: Sequence[dict[str, Any]]) -> Any:
    contacts = []
    for user in users:
        contact: dict[str, Any] = {"profile": {"name": f"User {user.phone or user.bsuid}"}}
        if user.phone:
            contact["wa_id"] = user.phone
        if user.bsuid:
            contact["user_id"] = user.bsuid
        contacts.append(contact)
    return {
        "value": {
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": "15550783881", "phone_number_id": scope},
            "contacts": contacts,
            "messages": list(messages),
        },
        "field": "messages",
    }


def whatsapp_webhook(*changes: Any) -> dict[str, Any]:
    return {
        "object": "whatsapp_business_account",
        "entry": [{"id": "102290129340398", "changes": list(changes)}],
    }


def whatsapp_text(user: WhatsAppUser, wamid: str, text: str) -> dict[str, Any]:
    """A webhook with one text message, as tests/payloads/whatsapp/text.json."""
    return whatsapp_webhook(whatsapp_change(user.scope, [user], [whatsapp_message(user, wamid, text)]))


def whatsapp_status(name: str, wamid: str) -> dict[str, Any]:
    """tests/payloads/whatsapp/status_<name>.json about our message `wamid`."""
    payload: dict[str, Any] = json.loads((PAYLOADS / "whatsapp" / f"status_{name}.json").read_text())
    payload["entry"][0]["changes"][0]["value"]["statuses"][0]["id"] = wamid
    return payload


@functools.cache
def _telegram_template() -> dict[str, Any]:
    template: dict[str, Any] = json.loads((PAYLOADS / "telegram" / "private_text.json").read_text())
    return template


def telegram_text(update_id: int, chat_id: int, message_id: int, text: str) -> dict[str, Any]:
    """A private-chat text update, as tests/payloads/telegram/private_text.json."""
    update = copy.deepcopy(_telegram_template())
    update["update_id"] = update_id
    message = update["message"]
    message.update(message_id=message_id, text=text)
    message["chat"]["id"] = chat_id
    message["from"]["id"] = chat_id
    return update


@functools.cache
def demo_answer(text: str) -> str:
    """What the demo agent answers to `text` as the first message of a conversation."""
    content = Runner(demo_agent, SessionStore()).run("expected", text).content
    assert content
    return content


def order_message(number: int) -> str:
    assert number not in ORDERS  # unknown orders: the answer names the number
    return f"order {number}"


# --- the database ------------------------------------------------------------------------------------


def sql(url: str, *statements: Any) -> list[list[Any]]:
    """The rows of each statement, read in a fresh engine (the gateways hold their own)."""

    async def run() -> list[list[Any]]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return [list(await conn.execute(statement)) for statement in statements]
        finally:
            await engine.dispose()

    return asyncio.run(run())


def pending_work(url: str) -> tuple[int, int]:
    """(pending inbox rows, pending outbox rows): (0, 0) once every turn ran and every reply went out."""
    inbox, outbox = sql(
        url,
        select(func.count()).select_from(InboxRow).where(InboxRow.status == "pending"),
        select(func.count()).select_from(OutboxRow).where(OutboxRow.status == "pending"),
    )
    return inbox[0][0], outbox[0][0]


def wait_drained(url: str) -> None:
    wait_until(lambda: pending_work(url) == (0, 0), "no pending inbox or outbox rows", DEADLINE_SECONDS, 0.1)


def transcript(url: str, session_id: str) -> list[tuple[str, str | None]]:
    """(role, content) of a session's messages, in order."""
    [rows] = sql(
        url,
        select(MessageRow.role, MessageRow.message_json)
        .where(MessageRow.session_id == session_id)
        .order_by(MessageRow.position),
    )
    return [(role, data.get("content")) for role, data in rows]


# --- the tests ---------------------------------------------------------------------------------------


def test_a_message_on_each_platform_is_answered_and_statuses_move_the_reply_on(
    deployment: Deployment,
) -> None:
    url, platforms = deployment.database_url, deployment.platforms
    alice = WhatsAppUser(phone="16505550101")
    chat_id, tg_session = 123456789, "telegram:123456789"
    wa_text, tg_text = "where is order 1001?", "order 1003"
    posted = fire(
        [
            whatsapp_post(deployment.gateways[0].base, whatsapp_text(alice, "wamid.in-path-1", wa_text)),
            telegram_post(deployment.gateways[1].base, telegram_text(830000001, chat_id, 101, tg_text)),
        ]
    )
    assert [r.status_code for r in posted] == [200, 200]
    assert [r.json() for r in posted] == [ACCEPTED_ONE, ACCEPTED_ONE]

    replies = platforms.wait_for_replies([alice.address, tg_session], 2)
    assert replies == {
        alice.address: [f"Order 1001 is shipped: {ORDERS[1001]['detail']}"],
        tg_session: [f"Order 1003 is delivered: {ORDERS[1003]['detail']}"],
    }
    assert replies[alice.address] == [demo_answer(wa_text)]
    # WhatsApp: one text to the user's phone, from the business number the message came to.
    [(index, reply)] = [
        (i, r) for i, r in platforms.whatsapp_reply_requests() if r.json.get("to") == alice.phone
    ]
    assert reply.path == f"/{PHONE_NUMBER_ID}/messages"
    assert reply.headers["authorization"] == f"Bearer {ACCESS_TOKEN}"
    assert reply.json == {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        "type": "text",
        "text": {"preview_url": False, "body": demo_answer(wa_text)},
        "to": alice.phone,
    }
    # Telegram: one sendMessage to the private chat, quoting nothing (only group replies quote).
    [call] = [c for c in platforms.telegram.calls("sendMessage") if str(c["chat_id"]) == str(chat_id)]
    assert call["text"] == demo_answer(tg_text)
    assert "reply_parameters" not in call

    # Both rows are marked sent with the platform's message id (the fake numbers its answers).
    wamid = f"wamid.out{index + 1}"
    outbox = (
        select(OutboxRow.session_id, OutboxRow.status, OutboxRow.platform_message_id)
        .where(OutboxRow.session_id.in_([alice.session_id, tg_session]))
        .order_by(OutboxRow.session_id)
    )
    sent = [(tg_session, "sent", str(TG_MESSAGE_ID)), (alice.session_id, "sent", wamid)]
    wait_until(lambda: sql(url, outbox)[0] == sent, "both replies marked sent", DEADLINE_SECONDS)

    # Status webhooks move the row on, never back, and are applied before the 200 (to either replica).
    wa_row = outbox.where(OutboxRow.session_id == alice.session_id)
    for gateway, status, expected in [
        (deployment.gateways[1], "delivered", "delivered"),
        (deployment.gateways[0], "read", "read"),
        (deployment.gateways[1], "sent", "read"),  # late, and it does not undo "read"
    ]:
        [response] = fire([whatsapp_post(gateway.base, whatsapp_status(status, wamid))])
        assert (response.status_code, response.json()) == (200, ACCEPTED_ONE)
        assert sql(url, wa_row)[0] == [(alice.session_id, expected, wamid)]
    [again] = fire([whatsapp_post(deployment.gateways[0].base, whatsapp_status("delivered", wamid))])
    assert again.json() == DUPLICATE_ONE
    assert sql(url, wa_row)[0] == [(alice.session_id, "read", wamid)]

    assert transcript(url, tg_session)[0] == ("user", tg_text)
    assert transcript(url, tg_session)[-1] == ("model", demo_answer(tg_text))
    assert platforms.replies_to([alice.address, tg_session]) == replies  # nothing more was sent

    # The operator's view of the same database.
    listing = subprocess.run(
        [GATEWAY, "inbox", "list", "--limit", "1000"],
        cwd=deployment.cwd,
        env=gateway_env(GATEWAY_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    [wa_line] = [line for line in listing.stdout.splitlines() if f" {alice.session_id} " in line]
    [tg_line] = [line for line in listing.stdout.splitlines() if f" {tg_session} " in line]
    assert "  done  " in wa_line
    assert wa_line.endswith(f"[text] {wa_text}")
    assert "  done  " in tg_line
    assert tg_line.endswith(f"[text] {tg_text}")


def test_a_whatsapp_batch_from_several_users_gets_one_reply_each(deployment: Deployment) -> None:
    url, platforms = deployment.database_url, deployment.platforms
    al = WhatsAppUser(phone="16505550201", bsuid="US.13491208655302741918")
    bea = WhatsAppUser(phone="447700900202")
    cem = WhatsAppUser(phone="4915123450203", bsuid="DE.Qm3Vb7Hn2Jx8Tc5", scope=OTHER_PHONE_NUMBER_ID)
    dee = WhatsAppUser(phone=None, bsuid="GB.8YtR2mWq0Zc4Lp9Ks", scope=OTHER_PHONE_NUMBER_ID)  # no phone
    sent = {al: [2101, 2102, 2103], bea: [2201], cem: [2301, 2302], dee: [2401]}
    batch = whatsapp_webhook(
        whatsapp_change(
            PHONE_NUMBER_ID,
            [al, bea],
            [
                whatsapp_message(al, "wamid.batch-a1", order_message(2101)),
                whatsapp_message(bea, "wamid.batch-b1", order_message(2201)),
                whatsapp_message(al, "wamid.batch-a2", order_message(2102)),
                whatsapp_message(al, "wamid.batch-a3", order_message(2103)),
            ],
        ),
        whatsapp_change(
            OTHER_PHONE_NUMBER_ID,
            [cem, dee],
            [
                whatsapp_message(cem, "wamid.batch-c1", order_message(2301)),
                whatsapp_message(dee, "wamid.batch-d1", order_message(2401)),
                whatsapp_message(cem, "wamid.batch-c2", order_message(2302)),
            ],
        ),
    )
    [response] = fire([whatsapp_post(deployment.gateways[0].base, batch)])
    assert response.status_code == 200
    assert response.json() == {"status": "accepted", "new": 7, "duplicates": 0}

    addresses = [user.address for user in sent]
    platforms.wait_for_replies(addresses, 7)
    wait_drained(url)
    # One reply per message, in each user's order; to the phone when known, else to the user id.
    assert platforms.replies_to(addresses) == {
        user.address: [demo_answer(order_message(n)) for n in numbers] for user, numbers in sent.items()
    }
    [dee_reply] = [
        r.json for _, r in platforms.whatsapp_reply_requests() if r.json.get("recipient") == dee.bsuid
    ]
    assert "to" not in dee_reply
    assert dee_reply["text"]["body"] == demo_answer(order_message(2401))
    for user, numbers in sent.items():
        asked = [content for role, content in transcript(url, user.session_id) if role == "user"]
        assert asked == [order_message(n) for n in numbers]


def test_duplicates_sent_concurrently_and_again_to_two_processes_are_answered_once(
    deployment: Deployment,
) -> None:
    url, platforms = deployment.database_url, deployment.platforms
    user = WhatsAppUser(phone="15550300001")
    tg_session = "telegram:555001"
    updates = [
        (whatsapp_post, whatsapp_text(user, "wamid.dup-1", "hello")),
        (telegram_post, telegram_text(840000001, 555001, 7, "hello")),
    ]
    bases = [g.base for g in deployment.gateways]
    # 20 copies of each update, alternating between the two processes, all in flight together.
    burst = [post(bases[i % 2], update) for i in range(20) for post, update in updates]
    responses = fire(burst)
    assert_ok(responses)
    for platform in ("whatsapp", "telegram"):
        answers = [r.json() for r, p in zip(responses, burst, strict=True) if p.url.endswith(platform)]
        assert len(answers) == 20
        assert sorted(a["new"] for a in answers) == [0] * 19 + [1], answers  # one process stored it
        assert all(a["new"] + a["duplicates"] == 1 for a in answers), answers

    platforms.wait_for_replies([user.address, tg_session], 2)
    # Re-deliveries once the turn is done (a platform that missed the 200 sends again), one by one.
    for base in [*bases, *reversed(bases)]:
        for post, update in updates:
            [again] = fire([post(base, update)])
            assert (again.status_code, again.json()) == (200, DUPLICATE_ONE)
    wait_drained(url)

    assert platforms.replies_to([user.address, tg_session]) == {
        user.address: [demo_answer("hello")],
        tg_session: [demo_answer("hello")],
    }
    for session_id, key in [
        (user.session_id, "wa:msg:wamid.dup-1"),
        (tg_session, f"tg:{BOT_ID}:840000001"),
    ]:
        inbox, keys, outbox = sql(
            url,
            select(InboxRow.session_id, InboxRow.status).where(InboxRow.dedup_key == key),
            select(ProcessedMessageRow.message_key).where(ProcessedMessageRow.message_key == key),
            select(OutboxRow.status).where(OutboxRow.session_id == session_id),
        )
        assert inbox == [(session_id, "done")]
        assert keys == [(key,)]
        assert outbox == [("sent",)]
        # Exactly one committed turn: the user's message and the answer.
        assert transcript(url, session_id) == [("user", "hello"), ("model", demo_answer("hello"))]


def test_distinct_messages_each_sent_to_two_processes_are_answered_once_in_order(
    deployment: Deployment,
) -> None:
    """30 messages in 6 conversations, each message posted to both processes at once."""
    url, platforms = deployment.database_url, deployment.platforms
    bases = [g.base for g in deployment.gateways]
    # address, session, order numbers, and per message the same update to each process
    conversations: list[tuple[str, str, list[int], list[list[Post]]]] = []
    for c in range(3):
        chat_id = 600100 + c
        numbers = [3000 + 100 * c + i for i in range(5)]
        steps = [
            [
                telegram_post(base, telegram_text(850000000 + 10 * c + i, chat_id, 20 + i, order_message(n)))
                for base in bases
            ]
            for i, n in enumerate(numbers)
        ]
        conversations.append((f"telegram:{chat_id}", f"telegram:{chat_id}", numbers, steps))
    for c in range(3):
        user = WhatsAppUser(phone=f"155504000{c:02d}")
        numbers = [4000 + 100 * c + i for i in range(5)]
        steps = [
            [
                whatsapp_post(base, whatsapp_text(user, f"wamid.both-{c}-{i}", order_message(n)))
                for base in bases
            ]
            for i, n in enumerate(numbers)
        ]
        conversations.append((user.address, user.session_id, numbers, steps))

    # The next message of a conversation is sent once both processes answered the previous one.
    for answered in fire_in_order([steps for _, _, _, steps in conversations]):
        for pair in answered:
            assert_ok(pair)
            assert sorted(r.json()["new"] for r in pair) == [0, 1]  # one process stored it

    addresses = [address for address, _, _, _ in conversations]
    platforms.wait_for_replies(addresses, 30)
    wait_drained(url)
    replies = platforms.replies_to(addresses)
    for address, session_id, numbers, _ in conversations:
        assert replies[address] == [demo_answer(order_message(n)) for n in numbers], address
        asked = [content for role, content in transcript(url, session_id) if role == "user"]
        assert asked == [order_message(n) for n in numbers], session_id
    sessions = [session_id for _, session_id, _, _ in conversations]
    [[(inbox_rows,)]] = sql(
        url, select(func.count()).select_from(InboxRow).where(InboxRow.session_id.in_(sessions))
    )
    assert inbox_rows == 30


def test_each_conversation_is_answered_in_order_under_load(deployment: Deployment) -> None:
    """8 conversations of 12 messages, each sent once acknowledged, alternating between the replicas."""
    url, platforms = deployment.database_url, deployment.platforms
    per_conversation = 12
    bases = [g.base for g in deployment.gateways]
    conversations: list[tuple[str, list[int], list[Post]]] = []  # address, numbers, posts
    for c in range(4):
        chat_id = 700100 + c
        numbers = [5000 + 100 * c + i for i in range(per_conversation)]
        posts = [
            telegram_post(
                bases[i % 2], telegram_text(860000000 + 100 * c + i, chat_id, 1 + i, order_message(n))
            )
            for i, n in enumerate(numbers)
        ]
        conversations.append((f"telegram:{chat_id}", numbers, posts))
    for c in range(4):
        user = WhatsAppUser(phone=f"155505000{c:02d}")
        numbers = [6000 + 100 * c + i for i in range(per_conversation)]
        posts = [
            whatsapp_post(bases[i % 2], whatsapp_text(user, f"wamid.load-{c}-{i}", order_message(n)))
            for i, n in enumerate(numbers)
        ]
        conversations.append((user.address, numbers, posts))

    results = fire_in_order([[[post] for post in posts] for _, _, posts in conversations])
    assert [step[0].json() for steps in results for step in steps] == [ACCEPTED_ONE] * 8 * per_conversation

    addresses = [address for address, _, _ in conversations]
    platforms.wait_for_replies(addresses, 8 * per_conversation)
    wait_drained(url)
    replies = platforms.replies_to(addresses)
    for address, numbers, _ in conversations:
        assert replies[address] == [demo_answer(order_message(n)) for n in numbers], address
