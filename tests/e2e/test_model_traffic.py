"""The real `gateway serve` against a fake OpenAI-compatible server on loopback: a model outage is waited
out with one holding reply and the answer after it, and the turn's usage reaches the table, the admin
API and /metrics; two processes on one database share the provider's requests per minute."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.fakes import FakeOpenAI, FakeTelegram, chat_completion, openai_error, telegram_text_update
from tests.helpers import REPO_ROOT, serve_in_thread, wait_until
from tests.serve_process import serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECRET = "e2e-secret_0123456789"
BOT_TOKEN = "123456:ABCdef"
ADMIN_TOKEN = "admin-token-0123456789"
API_KEY = "sk-e2e-0123456789abcdef"
HOLDING = "One moment, please."
CHAT = 4242


def update(update_id: int, text: str) -> dict[str, object]:
    return telegram_text_update(update_id, CHAT, text)


def test_an_outage_gets_one_holding_reply_then_the_answer_and_usage_is_counted(
    tmp_path: Path, fakes: tuple[FakeOpenAI, str, FakeTelegram, str]
) -> None:
    model, model_url, telegram, telegram_url = fakes
    for _ in range(10):  # several tries of the turn, each with the client's own quick retries
        model.enqueue_error(503, "overloaded")
    body = chat_completion("Order 1001 has shipped.")
    body["usage"] = {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}
    model.enqueue(body=body)
    settings = {
        "GATEWAY_MODEL": "openai:gpt-test",
        "GATEWAY_OPENAI_BASE_URL": f"{model_url}/v1",
        "GATEWAY_OPENAI_API_KEY": API_KEY,
        "GATEWAY_AGENT": "tests.faultkit_agent:agent",
        "PYTHONPATH": str(REPO_ROOT),
        "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
        "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
        "GATEWAY_TELEGRAM_API_BASE": telegram_url,
        "GATEWAY_HOLDING_REPLY_AFTER_S": "1",
        "GATEWAY_HOLDING_REPLY": HOLDING,
        "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
        "GATEWAY_MODEL_PRICES": '{"openai:gpt-test": [1000000, 2000000]}',
    }
    with serve_process(tmp_path, **settings) as served:  # type: ignore[arg-type]
        answer = httpx.post(
            f"{served.base}/webhooks/telegram",
            json=update(1, "Where is order 1001?"),
            headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
        )
        assert answer.status_code == 200

        def replies() -> list[str] | None:
            sent = [call["text"] for call in telegram.calls("sendMessage")]
            return sent if len(sent) >= 2 else None

        assert wait_until(replies, "the holding reply and the answer", timeout=60) == [
            HOLDING,
            "Order 1001 has shipped.",
        ]
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        session = httpx.get(f"{served.base}/api/usage/sessions/telegram:{CHAT}", headers=auth).json()
        daily = httpx.get(f"{served.base}/api/usage", params={"days": 1}, headers=auth).json()
        metrics = httpx.get(f"{served.base}/metrics").text
        events = served.events()

    usage = {
        "model": "openai:gpt-test",
        "turns": 1,
        "calls": 1,
        "input_tokens": 42,
        "output_tokens": 7,
        "tool_calls": 0,
        "estimated_cost_usd": 42 + 2 * 7,  # dollars per million tokens, a million a token
    }
    assert session["session_id"] == f"telegram:{CHAT}"
    assert [{k: v for k, v in item.items() if k != "latency_ms"} for item in session["models"]] == [usage]
    assert session["models"][0]["latency_ms"] >= 0
    assert [{k: v for k, v in item.items() if k not in ("latency_ms", "day")} for item in daily["items"]] == [
        usage
    ]
    assert 'gateway_model_tokens_total{direction="input",model="openai:gpt-test"} 42.0' in metrics
    assert 'gateway_model_tokens_total{direction="output",model="openai:gpt-test"} 7.0' in metrics
    assert 'gateway_model_calls_total{model="openai:gpt-test"} 1.0' in metrics
    waits = [e for e in events if e["event"] == "turn_waiting_for_model"]
    assert waits
    assert {e["status"] for e in waits} <= {503, None}  # None: held back by the open breaker, no call
    assert len(model.requests) == 11  # the 10 failures, then the answer
    assert [e["event"] for e in events].count("holding_reply_queued") == 1
    assert not [e for e in events if e["event"] == "turn_dead_lettered"]
    assert API_KEY not in served.log.read_text()
    assert all(r.headers.get("authorization") == f"Bearer {API_KEY}" for r in model.requests)


class MeteredModel:
    """An OpenAI-compatible server that allows `per_second` calls a second (a bucket holding one
    second's worth, as providers meter) and refuses the rest with 429."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self.tokens = float(per_second)
        self.refilled = time.monotonic()
        self.answered: list[float] = []
        self.refused = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.completions, methods=["POST"])])

    async def completions(self, request: Request) -> JSONResponse:
        now = time.monotonic()
        self.tokens = min(self.per_second, self.tokens + (now - self.refilled) * self.per_second)
        self.refilled = now
        if self.tokens < 1:
            self.refused += 1
            return JSONResponse(openai_error("rate limited"), status_code=429, headers={"Retry-After": "1"})
        self.tokens -= 1
        self.answered.append(now)
        return JSONResponse(chat_completion("It is on its way."))


def test_two_processes_on_one_database_share_the_providers_rpm(tmp_path: Path) -> None:
    """GATEWAY_OPENAI_RPM is the account's: two `gateway serve` processes on one SQLite file each
    spend half of it, so together they stay under the provider's limit (each alone would spend it all)."""
    model, telegram = MeteredModel(per_second=10), FakeTelegram(BOT_TOKEN)
    messages = 40
    with serve_in_thread(model.app) as model_url, serve_in_thread(telegram.app) as telegram_url:
        settings = {
            "GATEWAY_MODEL": "openai:gpt-test",
            "GATEWAY_OPENAI_BASE_URL": f"{model_url}/v1",
            "GATEWAY_OPENAI_API_KEY": API_KEY,
            "GATEWAY_OPENAI_RPM": "600",  # the provider's 10 a second
            "GATEWAY_AGENT": "tests.faultkit_agent:agent",
            "PYTHONPATH": str(REPO_ROOT),
            "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}",
            "GATEWAY_TELEGRAM_SECRET_TOKEN": SECRET,
            "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
            "GATEWAY_TELEGRAM_API_BASE": telegram_url,
            "GATEWAY_TELEGRAM_CHAT_PER_SECOND": "0",
            "GATEWAY_TELEGRAM_GLOBAL_PER_SECOND": "0",
        }
        with serve_process(tmp_path, **settings) as first, serve_process(tmp_path, **settings) as second:  # type: ignore[arg-type]
            for served in (first, second):
                wait_until(
                    lambda served=served: any(  # type: ignore[misc]
                        e["event"] == "budget_shared" and e["processes"] == 2 for e in served.events()
                    ),
                    "each process sharing the budget with the other",
                )
            for number in range(messages):
                answer = httpx.post(
                    f"{(first, second)[number % 2].base}/webhooks/telegram",
                    json=telegram_text_update(1000 + number, 5000 + number, f"Where is order {number}?"),
                    headers={"X-Telegram-Bot-Api-Secret-Token": SECRET},
                )
                assert answer.status_code == 200
            wait_until(
                lambda: len(telegram.calls("sendMessage")) >= messages, "every message answered", timeout=120
            )
            metrics = [httpx.get(f"{served.base}/metrics").text for served in (first, second)]
    assert model.refused == 0
    assert len(model.answered) == messages
    for text in metrics:
        assert 'gateway_model_budget_processes{provider="openai"} 2.0' in text
        assert 'gateway_model_budget_processes{provider="gemini"} 1.0' in text  # no limit: not shared
        assert 'gateway_model_budget_waiting_calls{provider="openai"} 0.0' in text
    spent = model.answered[-1] - model.answered[0]
    assert (messages - 1) / spent <= 10 * 1.1  # alone, each process would start 10 a second
