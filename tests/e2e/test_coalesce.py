"""The real `gateway serve` with GATEWAY_COALESCE_MS: three Telegram messages sent a moment apart are
one model call and one reply, every inbox row done; a message after the reply is a turn of its own."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fakes import FakeOpenAI, FakeTelegram, chat_completion, telegram_text_update
from tests.helpers import REPO_ROOT, wait_until
from tests.serve_process import serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "e2e-secret_0123456789"
BOT_TOKEN = "123456:ABCdef"
ADMIN_TOKEN = "admin-token-0123456789"
CHAT = 5151
BURST = ["hi", "my order is 1001", "where is it?"]


def update(update_id: int, text: str) -> dict[str, object]:
    return telegram_text_update(update_id, CHAT, text)


def user_texts(request_body: dict[str, object]) -> list[str]:
    messages = request_body["messages"]
    assert isinstance(messages, list)
    return [m["content"] for m in messages if m["role"] == "user"]


def test_a_burst_of_messages_gets_one_reply(
    tmp_path: Path, fakes: tuple[FakeOpenAI, str, FakeTelegram, str]
) -> None:
    model, model_url, telegram, telegram_url = fakes
    model.enqueue(body=chat_completion("Order 1001 has shipped."))
    model.enqueue(body=chat_completion("You're welcome."))
    settings = {
        "GATEWAY_MODEL": "openai:gpt-test",
        "GATEWAY_OPENAI_BASE_URL": f"{model_url}/v1",
        "GATEWAY_OPENAI_API_KEY": "sk-e2e-0123456789abcdef",
        "GATEWAY_AGENT": "tests.faultkit_agent:agent",
        "PYTHONPATH": str(REPO_ROOT),
        "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
        "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
        "GATEWAY_TELEGRAM_API_BASE": telegram_url,
        "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
        "GATEWAY_COALESCE_MS": "1500",
    }
    headers = {"X-Telegram-Bot-Api-Secret-Token": SECRET}
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with serve_process(tmp_path, **settings) as served:  # type: ignore[arg-type]
        for number, text in enumerate(BURST, start=1):  # a moment apart, well within the window
            answer = httpx.post(
                f"{served.base}/webhooks/telegram", json=update(number, text), headers=headers
            )
            assert answer.status_code == 200

        def sent(count: int) -> list[str] | None:
            texts = [call["text"] for call in telegram.calls("sendMessage")]
            return texts if len(texts) >= count else None

        assert wait_until(lambda: sent(1), "the burst's reply", timeout=60) == ["Order 1001 has shipped."]
        inbox = httpx.get(f"{served.base}/api/inbox", headers=auth).json()["items"]
        assert sorted((item["text"], item["status"]) for item in inbox) == sorted((t, "done") for t in BURST)
        assert len(model.requests) == 1
        assert user_texts(model.requests[0].json) == BURST

        # After the reply, a new message is a turn of its own, with the burst in its history.
        answer = httpx.post(f"{served.base}/webhooks/telegram", json=update(4, "thanks!"), headers=headers)
        assert answer.status_code == 200
        replies = wait_until(lambda: sent(2), "the second reply", timeout=60)
        session = httpx.get(f"{served.base}/api/sessions/telegram:{CHAT}", headers=auth).json()
        events = served.events()

    assert replies == ["Order 1001 has shipped.", "You're welcome."]
    assert len(model.requests) == 2
    assert user_texts(model.requests[1].json) == [*BURST, "thanks!"]
    assert [(m["role"], m["content"]) for m in session["messages"]] == [
        *(("user", text) for text in BURST),
        ("model", "Order 1001 has shipped."),
        ("user", "thanks!"),
        ("model", "You're welcome."),
    ]
    committed = [e for e in events if e["event"] == "turn_committed"]
    assert [e.get("rows") for e in committed] == [3, None]
    assert "where is it?" not in served.log.read_text()  # message text is never logged
