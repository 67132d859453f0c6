"""`gateway telegram set-webhook|webhook-info` against a fake Bot API on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.cli import main
from tests.fakes import FakeTelegram
from tests.helpers import free_port, serve_in_thread

TOKEN = "123456:test-bot-token"
SECRET = "tg-secret_1"


@pytest.fixture
def telegram(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTelegram]:
    fake = FakeTelegram(TOKEN)
    with serve_in_thread(fake.app) as base:
        monkeypatch.setenv("GATEWAY_TELEGRAM_API_BASE", base)
        monkeypatch.setenv("GATEWAY_TELEGRAM_BOT_TOKEN", TOKEN)
        monkeypatch.setenv("GATEWAY_TELEGRAM_SECRET_TOKEN", SECRET)
        yield fake


def test_set_webhook_sends_url_secret_and_allowed_updates(
    telegram: FakeTelegram, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["telegram", "set-webhook", "https://bot.example.com", "--drop-pending"]) == 0
    (call,) = telegram.calls("setWebhook")
    assert call["url"] == "https://bot.example.com/webhooks/telegram"
    assert call["secret_token"] == SECRET
    assert call["drop_pending_updates"] is True
    assert {"message", "callback_query", "my_chat_member"} <= set(call["allowed_updates"])
    out, err = capsys.readouterr()
    assert "webhook set to https://bot.example.com/webhooks/telegram" in out
    assert TOKEN not in out + err


def test_a_full_webhook_url_is_kept(telegram: FakeTelegram) -> None:
    assert main(["telegram", "set-webhook", "https://bot.example.com/hooks/webhooks/telegram"]) == 0
    assert telegram.calls("setWebhook")[0]["url"] == "https://bot.example.com/hooks/webhooks/telegram"


def test_webhook_info_and_api_errors(telegram: FakeTelegram, capsys: pytest.CaptureFixture[str]) -> None:
    telegram.results["getWebhookInfo"] = {"url": "https://x/webhooks/telegram", "pending_update_count": 3}
    assert main(["telegram", "webhook-info"]) == 0
    out = capsys.readouterr().out
    assert "pending_update_count: 3" in out
    telegram.errors["setWebhook"] = (400, {"error_code": 400, "description": "Bad Request: bad webhook"})
    assert main(["telegram", "set-webhook", "https://x"]) == 1
    err = capsys.readouterr().err
    assert "Bad Request: bad webhook" in err
    assert TOKEN not in err


def test_without_tokens_it_names_the_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["telegram", "webhook-info"]) == 2
    assert "GATEWAY_TELEGRAM_BOT_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            "bot.example.com",
            "not an https:// URL: 'bot.example.com' (Telegram posts webhooks over HTTPS only)",
        ),
        (
            "http://bot.example.com",
            "not an https:// URL: 'http://bot.example.com' (Telegram posts webhooks over HTTPS only)",
        ),
        (
            "https://bot.example.com:8080",
            "port 8080: Telegram sends webhooks to ports 443, 80, 88 and 8443 only",
        ),
    ],
)
def test_set_webhook_refuses_a_url_telegram_would(
    telegram: FakeTelegram, capsys: pytest.CaptureFixture[str], url: str, problem: str
) -> None:
    """Telegram posts webhooks over HTTPS, to four ports only: an http:// URL went to the Bot API."""
    assert main(["telegram", "set-webhook", url]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"gateway: {problem}"  # after the fake's log
    assert telegram.calls("setWebhook") == []


def test_an_unreachable_bot_api_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_TELEGRAM_API_BASE", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("GATEWAY_TELEGRAM_BOT_TOKEN", TOKEN)
    monkeypatch.setenv("GATEWAY_TELEGRAM_SECRET_TOKEN", SECRET)
    assert main(["telegram", "webhook-info"]) == 1
    assert capsys.readouterr().err.strip() == (
        "gateway: Telegram getWebhookInfo failed: cannot reach the Bot API (ConnectError)"
    )  # it said "failed (None)": no status to give
