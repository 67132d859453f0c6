"""The fault machinery itself (tests/faultkit.py), checked against the real thing: the fakes' modes as
a client sees them, a frozen and a stopped private PostgreSQL, and the accounting of a small real run
of `gateway serve`, with one fault, counted exactly."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from gateway.store.engine import create_engine
from tests import faultkit as fk

pytestmark = pytest.mark.e2e


def send_message(api_base: str, order: int, timeout: float = 5) -> httpx.Response:
    return httpx.post(
        f"{api_base}/bot{fk.BOT_TOKEN}/sendMessage",
        json={"chat_id": 7, "text": f"I couldn't find order {order}."},
        timeout=timeout,
    )


def test_the_fake_bot_api_answers_as_its_mode_says_and_records_what_it_took() -> None:
    platform = fk.FakeBotAPI(retry_after=3)
    try:
        assert send_message(platform.api_base, 1).json()["ok"] is True
        platform.set_mode(fk.Mode.ERROR)
        assert send_message(platform.api_base, 2).status_code == 500
        platform.set_mode(fk.Mode.THROTTLED)
        throttled = send_message(platform.api_base, 3)
        assert throttled.status_code == 429
        assert throttled.headers["retry-after"] == "3"
        assert throttled.json()["parameters"] == {"retry_after": 3}
        platform.set_mode(fk.Mode.HANG)
        with pytest.raises(httpx.ReadTimeout):
            send_message(platform.api_base, 4, timeout=0.5)
        platform.set_mode(fk.Mode.DOWN)
        with pytest.raises(httpx.ConnectError):
            send_message(platform.api_base, 5)
        platform.set_mode(fk.Mode.OK)  # listening again, on the same port
        assert send_message(platform.api_base, 6).status_code == 200
        # Taken: the accepted ones and the one that hung (the platform had it); not the refused ones.
        assert [(r.order, r.mode) for r in platform.replies] == [(1, "ok"), (4, "hang"), (6, "ok")]
    finally:
        platform.close()


def test_the_fake_model_answers_like_the_demo_agent_and_fails_as_told() -> None:
    model = fk.FakeModel()
    body = {"model": "fake", "messages": [{"role": "user", "content": "Where is order 1234?"}]}
    try:
        answer = httpx.post(f"{model.base_url}/chat/completions", json=body)
        assert answer.json()["choices"][0]["message"]["content"] == "I couldn't find order 1234."
        model.set_mode(fk.Mode.ERROR)
        assert httpx.post(f"{model.base_url}/chat/completions", json=body).status_code == 500
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.skipif(fk.postgres_bin() is None, reason="no PostgreSQL binaries under /usr/lib/postgresql")
def test_a_private_postgres_can_be_frozen_thawed_stopped_and_started() -> None:
    server = fk.PrivatePostgres()

    async def select_one(url: str, seconds: float) -> int:
        engine = create_engine(url)
        try:
            async with asyncio.timeout(seconds), engine.connect() as conn:
                return int((await conn.execute(text("SELECT 1"))).scalar_one())
        finally:
            await engine.dispose()

    async def frozen_while_connected(url: str) -> None:
        engine = create_engine(url, pool_size=2)
        try:
            async with engine.connect() as first, engine.connect() as second:
                await first.execute(text("SELECT 1"))
                await second.execute(text("SELECT 1"))
                server.freeze()
                try:
                    with pytest.raises(TimeoutError):  # an open connection's backend is frozen too
                        async with asyncio.timeout(1):
                            await first.execute(text("SELECT 1"))
                finally:
                    server.thaw()
                assert (await second.execute(text("SELECT 2"))).scalar_one() == 2
                await first.invalidate()
        finally:
            await engine.dispose()

    try:
        server.start()
        url = server.create_database("faultkit")
        fk.run_sync(frozen_while_connected(url))
        server.freeze()
        try:
            with pytest.raises(TimeoutError):  # and no new connection is accepted
                fk.run_sync(select_one(url, 1))
        finally:
            server.thaw()
        assert fk.run_sync(select_one(url, 10)) == 1
        server.stop()
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", server.port)) != 0, "a stopped server refuses connections"
        server.start()
        assert fk.run_sync(select_one(url, 10)) == 1
        server.kill()
        assert server.server_pids() == []
        server.start()  # crash recovery
        assert fk.run_sync(select_one(url, 10)) == 1
    finally:
        server.close()
    assert not os.path.exists(server.root)


@pytest.mark.slow
def test_a_real_run_is_counted_exactly_through_a_platform_outage(tmp_path: Path) -> None:
    """20 messages in 4 chats, 5 of them delivered twice, the Bot API answering 500 for a while:
    every figure of the tally is known in advance."""
    platform = fk.FakeBotAPI()
    url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    fk.migrate(url, tmp_path)
    gateway = fk.GatewayProcess(
        "gateway", tmp_path, fk.clean_env(**fk.gateway_settings(url, platform.api_base))
    )
    chats = fk.conversations(4, 5, chat_base=800_000, order_base=9_000)
    duplicated = frozenset({9_000, 9_005, 9_010, 9_015, 9_019})
    with fk.stopping(platform.close, gateway.kill):
        gateway.start()
        driver = fk.Driver([gateway.url], duplicated=duplicated)
        platform.set_mode(fk.Mode.ERROR)

        async def post() -> None:
            try:
                await driver.run(chats)
            finally:
                await driver.aclose()

        asyncio.run(post())
        fk.wait_for(lambda: platform.calls.get("error", 0) >= 1, "a refused send", 30)
        platform.set_mode(fk.Mode.OK)
        fault_end = time.monotonic()
        assert fk.wait_answered(platform, driver.acked_at, 60)
        assert gateway.stop() == 0
    counts = fk.run_sync(fk.database_counts(url, [chat[0].chat_id for chat in chats]))
    tally = fk.tally(driver, platform, chats, counts, fault_end=fault_end)
    assert (tally.deliveries, tally.acked, tally.stored, tally.turns, tally.replies) == (25, 20, 20, 20, 20)
    assert (tally.lost, tally.duplicated, tally.extra_turns, tally.out_of_order) == (0, 0, 0, 0)
    assert tally.recover is not None
    assert counts.inbox == {"done": 20}
    assert counts.outbox == {"sent": 20}
