"""The local mode over real loopback HTTP: a platform without its secret takes only webhooks signed
with the local key, only from a loopback client; everything else still sees a disabled platform."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from gateway.app import create_app
from gateway.platforms import local_key
from gateway.platforms.registry import by_name
from gateway.platforms.spec import SimulatedWebhook
from gateway.settings import Settings
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow
from tests.helpers import gateway_settings, serve_in_thread

KEY_FILE = "data/local.key"


async def _count(url: str) -> int:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return int((await conn.execute(select(func.count()).select_from(InboxRow))).scalar_one())
    finally:
        await engine.dispose()


def started(base: str) -> str:
    """`base` once the app's start-up (which writes the key) is over: requests wait in the backlog."""
    assert httpx.get(f"{base}/healthz").status_code == 200
    return base


def build(platform: str, text: str, user: str | None, secret: str) -> SimulatedWebhook:
    """What `gateway simulate` posts: the platform's simulated webhook (from its default user when None)."""
    spec = by_name()[platform]
    return spec.simulate(text, user or spec.simulate_user, secret, spec.settings())


def inbox_rows(url: str) -> int:
    return asyncio.run(_count(url))


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


@pytest.fixture
def local_gateway(url: str) -> Iterator[str]:
    """No platform secret at all: the embedded defaults a newcomer starts with."""
    with serve_in_thread(create_app(Settings(database_url=url, local_key_file=KEY_FILE))) as base:
        yield started(base)


@pytest.mark.parametrize("platform", ["telegram", "whatsapp"])
def test_a_webhook_signed_with_the_local_key_is_accepted_from_loopback(
    local_gateway: str, url: str, platform: str
) -> None:
    key = local_key.read(Path(KEY_FILE))  # written by the gateway at start-up
    webhook = build(platform, "hello", None, key)
    response = httpx.post(
        f"{local_gateway}/webhooks/{platform}", content=webhook.body, headers=webhook.headers
    )
    assert response.json() == {"status": "accepted", "new": 1, "duplicates": 0}
    assert inbox_rows(url) == 1


@pytest.mark.parametrize("platform", ["telegram", "whatsapp"])
def test_without_the_key_the_platform_stays_disabled(local_gateway: str, url: str, platform: str) -> None:
    webhook = build(platform, "hello", None, "not-the-local-key")
    for headers in ({"content-type": "application/json"}, webhook.headers):
        response = httpx.post(f"{local_gateway}/webhooks/{platform}", content=webhook.body, headers=headers)
        assert response.status_code == 404
        assert response.json()["error"] == "platform_disabled"
    assert inbox_rows(url) == 0


def test_a_client_behind_a_loopback_proxy_is_not_local(local_gateway: str, url: str) -> None:
    """A reverse proxy on the same host forwards public clients from 127.0.0.1; uvicorn trusts its
    X-Forwarded-For from loopback, so the gateway sees the real (remote) client and refuses it even
    with the right key."""
    key = local_key.read(Path(KEY_FILE))
    webhook = build("telegram", "hello", "42", key)
    headers = {**webhook.headers, "X-Forwarded-For": "203.0.113.5"}
    response = httpx.post(f"{local_gateway}/webhooks/telegram", content=webhook.body, headers=headers)
    assert response.status_code == 404
    assert inbox_rows(url) == 0


def test_the_local_mode_can_be_turned_off(url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=url, local_key_file=""))) as base:
        webhook = build("telegram", "hello", "42", "anything")
        response = httpx.post(f"{base}/webhooks/telegram", content=webhook.body, headers=webhook.headers)
    assert response.status_code == 404
    assert not Path(KEY_FILE).exists()
    assert inbox_rows(url) == 0


def test_a_configured_platform_never_takes_the_local_key(url: str) -> None:
    settings = gateway_settings(
        database_url=url, local_key_file=KEY_FILE, telegram_secret_token="real-secret"
    )
    with serve_in_thread(create_app(settings)) as base:
        started(base)
        key = local_key.read(Path(KEY_FILE))  # created for WhatsApp, which has no secret
        webhook = build("telegram", "hello", "42", key)
        refused = httpx.post(f"{base}/webhooks/telegram", content=webhook.body, headers=webhook.headers)
        signed = build("telegram", "hello", "42", "real-secret")
        accepted = httpx.post(f"{base}/webhooks/telegram", content=signed.body, headers=signed.headers)
    assert refused.status_code == 401
    assert accepted.status_code == 200
    assert inbox_rows(url) == 1


def test_an_unwritable_key_file_turns_the_local_mode_off_without_stopping(url: str, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = Settings(database_url=url, local_key_file=str(blocker / "local.key"))
    with serve_in_thread(create_app(settings)) as base:
        started(base)
        response = httpx.post(f"{base}/webhooks/telegram", content=b"{}")
    assert response.status_code == 404
