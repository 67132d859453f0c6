"""The local mode's key file and the webhooks `gateway simulate` builds."""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.platforms import local_key
from gateway.platforms.registry import by_name
from gateway.platforms.telegram.adapter import TelegramAdapter
from gateway.platforms.telegram.spec import TELEGRAM, TelegramSettings
from gateway.platforms.whatsapp.adapter import WhatsAppAdapter
from gateway.platforms.whatsapp.spec import SIMULATED_PHONE_NUMBER_ID, WHATSAPP, WhatsAppSettings


def test_the_key_is_created_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "data" / "local.key"
    key = local_key.load_or_create(path)
    assert len(key) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local_key.load_or_create(path) == key
    assert local_key.read(path) == key
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_key_other_users_can_read_is_refused(tmp_path: Path) -> None:
    """The finding: a pre-existing world-readable local.key was used silently; whoever reads it can
    post webhooks in the gateway's local mode."""
    path = tmp_path / "local.key"
    key = local_key.load_or_create(path)
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(ValueError, match="readable by other users"):
            local_key.read(path)
        with pytest.raises(ValueError, match="chmod 600"):
            local_key.load_or_create(path)
    path.chmod(0o600)
    assert local_key.read(path) == key
    fresh = tmp_path / "new" / "local.key"
    local_key.load_or_create(fresh)
    assert oct(fresh.parent.stat().st_mode & 0o777) == "0o700"


def test_processes_starting_together_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "local.key"
    with ThreadPoolExecutor(8) as pool:
        keys = set(pool.map(lambda _: local_key.load_or_create(path), range(32)))
    assert keys == {local_key.read(path)}


def test_a_missing_or_empty_key_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        local_key.read(tmp_path / "missing.key")
    (tmp_path / "empty.key").write_text("\n")
    (tmp_path / "empty.key").chmod(0o600)  # private, so emptiness is what is wrong with it
    with pytest.raises(ValueError, match=r"empty\.key is empty"):
        local_key.read(tmp_path / "empty.key")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("10.0.0.1", False),
        ("203.0.113.5", False),
        ("::ffff:203.0.113.5", False),
        ("localhost", False),  # a name is not an address: never trusted
        ("", False),
        (None, False),
    ],
)
def test_only_loopback_addresses_count_as_local(host: str | None, loopback: bool) -> None:
    assert local_key.is_loopback(host) is loopback


def test_a_simulated_telegram_update_is_one_text_the_adapter_accepts() -> None:
    webhook = TELEGRAM.simulate("héllo", "42", "key-123", TelegramSettings(bot_token="777:bot-secret"))
    adapter = TelegramAdapter("key-123", "777")
    assert adapter.verify(webhook.headers, webhook.body)
    assert not TelegramAdapter("other-key", "777").verify(webhook.headers, webhook.body)
    (message,) = adapter.parse(json.loads(webhook.body)).messages
    assert (message.text, message.user_id, message.session_id) == ("héllo", "42", "telegram:42")
    assert webhook.dedup_key == message.dedup_key
    assert webhook.dedup_key.startswith("tg:777:")


def test_a_simulated_whatsapp_message_is_signed_over_its_raw_bytes() -> None:
    webhook = WHATSAPP.simulate("Grüße 😀", "15551234567", "key-123", WhatsAppSettings())
    adapter = WhatsAppAdapter("key-123")
    assert adapter.verify(webhook.headers, webhook.body)
    assert not adapter.verify(webhook.headers, webhook.body + b" ")
    (message,) = adapter.parse(json.loads(webhook.body)).messages
    assert (message.text, message.user_id) == ("Grüße 😀", "15551234567")
    assert message.session_id == f"whatsapp:{SIMULATED_PHONE_NUMBER_ID}:15551234567"
    assert webhook.dedup_key == message.dedup_key


def test_every_simulated_message_is_new() -> None:
    keys = {TELEGRAM.simulate("hi", "42", "k", TelegramSettings()).dedup_key for _ in range(50)}
    assert len(keys) == 50


@pytest.mark.parametrize(
    ("platform", "user"), [("telegram", "abc"), ("whatsapp", "+1 555"), ("telegram", "")]
)
def test_a_user_id_the_platform_cannot_have_is_refused(platform: str, user: str) -> None:
    spec = by_name()[platform]
    with pytest.raises(ValueError, match="user id"):
        spec.simulate("hi", user, "k", spec.settings())
