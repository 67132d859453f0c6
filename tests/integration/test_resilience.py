"""What a slow model and a failing platform must not do: slow the ack, lose a reply, or send it twice."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select
from starlette.types import ASGIApp

from gateway.agents import Agent
from gateway.app import create_app
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, OutboxRow
from tests.fakes import FakeOpenAI, FakeWhatsApp
from tests.helpers import free_port, gateway_settings, serve_in_thread, wait_until

PAYLOADS = Path(__file__).resolve().parents[1] / "payloads"
APP_SECRET = "wa-secret-resilience"
TG_SECRET = "tg-secret-resilience"
# An agent on the service's default model (GATEWAY_MODEL), which the first test points at a slow server.
DEFAULT_MODEL_AGENT = Agent("assistant", "Answer briefly.")


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


def query(url: str, statement: Any) -> list[Any]:
    async def run() -> list[Any]:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return list(await conn.execute(statement))
        finally:
            await engine.dispose()

    return asyncio.run(run())


def telegram_update(update_id: int, chat_id: int, text: str) -> dict[str, Any]:
    person = {"id": chat_id, "is_bot": False, "first_name": "T"}
    message = {"message_id": update_id, "date": int(time.time()), "chat": {**person, "type": "private"}}
    return {"update_id": update_id, "message": {**message, "from": person, "text": text}}


def test_a_model_that_never_answers_does_not_slow_the_ack(url: str) -> None:
    model = FakeOpenAI()
    model.enqueue_hang()  # the first turn's model call never returns
    with serve_in_thread(model.app) as model_base:
        settings = gateway_settings(
            database_url=url,
            telegram_secret_token=TG_SECRET,
            agent=f"{__name__}:DEFAULT_MODEL_AGENT",
            model="openai:slow",
            openai_base_url=f"{model_base}/v1",
        )
        with serve_in_thread(create_app(settings)) as gateway, httpx.Client(timeout=10) as client:
            headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET}
            first = client.post(
                f"{gateway}/webhooks/telegram", json=telegram_update(1, 11, "hi"), headers=headers
            )
            assert first.json()["new"] == 1
            wait_until(lambda: len(model.requests) == 1, "the worker to call the model")
            # A turn is now stuck inside the model; new messages are still stored and acknowledged.
            acks = [
                client.post(
                    f"{gateway}/webhooks/telegram", json=telegram_update(n, 10 + n, "hello"), headers=headers
                )
                for n in range(2, 12)
            ]
            assert [ack.json()["new"] for ack in acks] == [1] * 10
            statuses = query(url, select(InboxRow.status))
            assert len(statuses) == 11
            assert {status for (status,) in statuses} == {"pending"}  # none answered: the model is stuck


@contextmanager
def serve_on(app: ASGIApp, port: int) -> Iterator[None]:
    """Serve `app` on a given loopback port (a platform coming back where it was)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def sent_rows(url: str) -> list[Any]:
    return query(
        url,
        select(OutboxRow.status, OutboxRow.attempts, OutboxRow.error_code, OutboxRow.platform_message_id),
    )


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        ((500, {"code": 1, "message": "An unknown error occurred"}), "1"),
        ((429, {"code": 130429, "message": "Rate limit hit"}), "130429"),
        ((400, {"code": 131056, "message": "Pair rate limit hit"}), "131056"),
        (None, None),  # the Graph API unreachable: nothing listens on its port yet
    ],
)
def test_a_failing_platform_gets_the_reply_later_and_once(
    url: str, failure: tuple[int, dict[str, Any]] | None, code: str | None
) -> None:
    fake = FakeWhatsApp()
    if failure is not None:
        fake.errors.append(failure)
    port = free_port()
    settings = gateway_settings(
        database_url=url,
        whatsapp_app_secret=APP_SECRET,
        whatsapp_access_token="wa-token",
        whatsapp_api_base=f"http://127.0.0.1:{port}",
    )
    body = (PAYLOADS / "whatsapp" / "text.json").read_bytes().strip()
    headers = {"X-Hub-Signature-256": WhatsAppAdapter.sign(APP_SECRET, body)}
    with serve_in_thread(create_app(settings)) as gateway:
        if failure is None:
            assert (
                httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=headers).status_code == 200
            )
            wait_until(lambda: [r[1] for r in sent_rows(url)] == [1], "a first failed attempt")
            ((status, _, error_code, _),) = sent_rows(url)
            assert (status, error_code) == ("pending", None)
        with serve_on(fake.app, port):
            if failure is not None:
                assert (
                    httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=headers).status_code
                    == 200
                )
                wait_until(lambda: [r[1] for r in sent_rows(url)] == [1], "a first failed attempt")
                assert sent_rows(url)[0][:3] == ("pending", 1, code)  # recorded with the platform's code
            wait_until(lambda: sent_rows(url)[0][0] == "sent", "the retried send")
            # A re-delivery of the same webhook after the reply changes nothing.
            again = httpx.post(f"{gateway}/webhooks/whatsapp", content=body, headers=headers)
            assert again.json()["duplicates"] == 1
    ((status, attempts, _, message_id),) = sent_rows(url)
    assert (status, attempts) == ("sent", 1)  # one failed attempt on record, then sent
    assert message_id is not None
    replies = [r for r in fake.requests if r.json.get("type") == "text"]
    assert len(replies) == (2 if failure is not None else 1)  # the refused attempt, then one delivery
    assert len(query(url, select(InboxRow.id))) == 1
