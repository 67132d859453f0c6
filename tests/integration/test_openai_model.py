"""OpenAIChatModel against a fake OpenAI-compatible server on real loopback HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from gateway.agents.models.base import ModelError
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.openai_compat import (
    DEFAULT_BASE_URL,
    RAW_ARGUMENTS_KEY,
    OpenAIChatModel,
    openai_model_from_spec,
)
from gateway.bootstrap import build_models, build_services
from gateway.domain.messages import Message, Role, ToolCall
from tests.fakes import FakeOpenAI, chat_completion, tool_call
from tests.helpers import free_port, gateway_settings, serve_in_thread

API_KEY = "sk-test-0123456789abcdef"


@dataclass(frozen=True)
class StubAgent:
    """Stands in for the real Agent: a name and the system prompt it renders."""

    name: str = "concierge"
    instructions: str = "You are the hotel concierge."

    def render_instructions(self) -> str:
        return self.instructions


@dataclass(frozen=True)
class StubTool:
    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


WEATHER = StubTool(
    "get_weather",
    "Current weather of a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
USER_HI = [Message(Role.USER, "hi")]

MakeModel = Callable[..., OpenAIChatModel]


class SleepRecorder:
    """Replaces the backoff's sleep: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
def fake() -> FakeOpenAI:
    return FakeOpenAI()


@pytest.fixture
def base_url(fake: FakeOpenAI) -> Iterator[str]:
    with serve_in_thread(fake.app) as url:
        yield f"{url}/v1"


@pytest.fixture
async def make_model(base_url: str) -> AsyncIterator[MakeModel]:
    """Builds models on the fake (tiny real backoff unless overridden) and closes them afterwards."""
    models: list[OpenAIChatModel] = []

    def make(**overrides: Any) -> OpenAIChatModel:
        options: dict[str, Any] = {"base_url": base_url, "timeout": 5.0, "backoff_base": 0.001}
        options.update(overrides)
        model = OpenAIChatModel("gpt-test", **options)
        models.append(model)
        return model

    yield make
    for model in models:
        await model.aclose()


async def test_text_reply(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_reply("Hello! How can I help?")

    reply = await make_model().respond(StubAgent(), USER_HI, [])

    assert reply.role is Role.MODEL
    assert reply.content == "Hello! How can I help?"
    assert reply.tool_calls == []
    assert reply.agent_name == "concierge"
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"]
    assert fake.requests[0].json["model"] == "gpt-test"
    assert "tools" not in fake.requests[0].json


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
    ],
    ids=["refusal-field", "refusal-part"],
)
async def test_a_refusal_is_the_reply(
    fake: FakeOpenAI, make_model: MakeModel, message: dict[str, Any]
) -> None:
    """A model's refusal (its `refusal` field, or a content part of that type) is what the user should read:
    it was dropped, and the user got no reply at all."""
    fake.enqueue(200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    reply = await make_model().respond(StubAgent(), USER_HI, [])

    assert reply.content == "I can't help with that."


async def test_tool_call_reply_is_parsed(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_tool_calls(
        tool_call("call_1", "get_weather", {"city": "Lisbon", "units": {"temp": "C"}}),
        tool_call("call_2", "list_rooms", ""),
    )

    reply = await make_model().respond(StubAgent(), USER_HI, [WEATHER])

    assert reply.content is None
    assert reply.tool_calls == [
        ToolCall("call_1", "get_weather", {"city": "Lisbon", "units": {"temp": "C"}}),
        ToolCall("call_2", "list_rooms", {}),
    ]


@pytest.mark.parametrize("raw", ['{"city": "Lis', "[1, 2]", '"Lisbon"'])
async def test_tool_arguments_that_are_not_a_json_object_are_kept_raw(
    fake: FakeOpenAI, make_model: MakeModel, raw: str
) -> None:
    fake.enqueue_tool_calls(tool_call("call_1", "get_weather", raw), content="Checking.")

    reply = await make_model().respond(StubAgent(), USER_HI, [WEATHER])

    assert reply.content == "Checking."
    assert reply.tool_calls == [ToolCall("call_1", "get_weather", {RAW_ARGUMENTS_KEY: raw})]


async def test_request_body_maps_history_and_tools(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_reply("It is sunny in Lisbon.")
    history = [
        Message(Role.SYSTEM, "The guest is in room 12."),
        Message(Role.USER, "Weather in Lisbon?"),
        Message(
            Role.MODEL,
            None,
            tool_calls=[ToolCall("call_1", "get_weather", {"city": "Lisbon"})],
            agent_name="concierge",
        ),
        Message(Role.TOOL, '{"sky": "sunny"}', tool_call_id="call_1", name="get_weather"),
        Message(Role.MODEL, "Anything else?"),
    ]

    await make_model().respond(StubAgent(), history, [WEATHER])

    body = fake.requests[0].json
    assert body["messages"] == [
        {"role": "system", "content": "You are the hotel concierge."},
        {"role": "system", "content": "The guest is in room 12."},
        {"role": "user", "content": "Weather in Lisbon?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "Anything else?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]


async def test_bearer_auth_is_sent_with_an_api_key(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_reply("ok")

    await make_model(api_key=API_KEY).respond(StubAgent(), USER_HI, [])

    assert fake.requests[0].headers["authorization"] == f"Bearer {API_KEY}"


async def test_no_auth_header_without_an_api_key(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_reply("ok")

    await make_model(api_key=None).respond(StubAgent(), USER_HI, [])

    assert "authorization" not in fake.requests[0].headers
    assert fake.requests[0].headers["content-type"] == "application/json"


async def test_429_honours_retry_after_then_succeeds(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_error(429, "Rate limit reached", headers={"Retry-After": "2"})
    fake.enqueue_reply("ok")
    sleep = SleepRecorder()

    with capture_logs() as logs:
        reply = await make_model(api_key=API_KEY, sleep=sleep).respond(StubAgent(), USER_HI, [])

    assert reply.content == "ok"
    assert len(fake.requests) == 2
    assert sleep.delays == [pytest.approx(2.0, abs=0.5)]  # once: the provider's pause holds the retry
    retries = [event for event in logs if event["event"] == "model_retry"]
    assert len(retries) == 1
    assert retries[0]["log_level"] == "warning"
    assert (retries[0]["status"], retries[0]["attempt"]) == (429, 1)
    assert retries[0]["delay"] == pytest.approx(2.0, abs=0.5)
    assert API_KEY not in repr(logs)


async def test_retry_after_as_an_http_date(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_error(429, "slow down", headers={"Retry-After": _http_date(seconds=30)})
    fake.enqueue_reply("ok")
    sleep = SleepRecorder()

    await make_model(sleep=sleep).respond(StubAgent(), USER_HI, [])

    assert len(sleep.delays) == 1
    assert 25 <= sleep.delays[0] <= 30


async def test_retry_after_is_capped(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_error(503, "maintenance", headers={"Retry-After": "3600"})
    fake.enqueue_reply("ok")
    sleep = SleepRecorder()

    await make_model(sleep=sleep, retry_after_max=60.0).respond(StubAgent(), USER_HI, [])

    assert sleep.delays == [60.0]


async def test_503_twice_then_success(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_error(503, "overloaded")
    fake.enqueue(503, text="<html>Service Unavailable</html>")
    fake.enqueue_reply("finally")

    reply = await make_model(max_retries=3).respond(StubAgent(), USER_HI, [])  # real (tiny) sleeps

    assert reply.content == "finally"
    assert len(fake.requests) == 3


async def test_backoff_is_jittered_exponential_and_capped(fake: FakeOpenAI, make_model: MakeModel) -> None:
    for _ in range(6):
        fake.enqueue_error(500, "boom")
    fake.enqueue_reply("ok")
    sleep = SleepRecorder()

    model = make_model(max_retries=6, backoff_base=0.5, backoff_max=2.0, sleep=sleep)
    await model.respond(StubAgent(), USER_HI, [])

    windows = [0.5, 1.0, 2.0, 2.0, 2.0, 2.0]  # base * 2**n, capped at backoff_max
    assert len(sleep.delays) == len(windows)
    assert all(0 <= delay <= window for delay, window in zip(sleep.delays, windows, strict=True))
    assert len(set(sleep.delays)) > 1  # jittered, not a fixed schedule


async def test_400_raises_the_provider_message_without_retrying(
    fake: FakeOpenAI, make_model: MakeModel
) -> None:
    fake.enqueue_error(400, "Invalid 'messages[1].content': string too long.")

    with pytest.raises(ModelError) as caught:
        await make_model().respond(StubAgent(), USER_HI, [])

    assert caught.value.status == 400
    assert caught.value.message == "Invalid 'messages[1].content': string too long."
    assert caught.value.provider == "openai"
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("status", "body", "text", "expected"),
    [
        (401, {"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}}, None, None),
        (404, {"error": "model 'llama9' not found"}, None, "model 'llama9' not found"),
        (400, [{"error": {"code": 400, "message": "Bad tool schema", "status": "INVALID"}}], None, None),
        (403, None, "Forbidden by proxy", "Forbidden by proxy"),
    ],
    ids=["openai-shape", "plain-error-string", "gemini-list", "text-body"],
)
async def test_error_message_is_taken_from_the_body(
    fake: FakeOpenAI,
    make_model: MakeModel,
    status: int,
    body: Any,
    text: str | None,
    expected: str | None,
) -> None:
    fake.enqueue(status, body, text=text)

    with pytest.raises(ModelError) as caught:
        await make_model().respond(StubAgent(), USER_HI, [])

    assert caught.value.status == status
    if expected is None:
        error = body[0]["error"] if isinstance(body, list) else body["error"]
        expected = error["message"]
    assert caught.value.message == expected


async def test_a_long_text_error_body_is_truncated(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue(400, text="x" * 5000)

    with pytest.raises(ModelError) as caught:
        await make_model().respond(StubAgent(), USER_HI, [])

    assert caught.value.message.startswith("xxx")
    assert len(caught.value.message) < 400


async def test_exhausted_retries_raise_the_last_status(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_error(502, "bad gateway")
    fake.enqueue_error(500, "server error")
    fake.enqueue_error(504, "gateway timeout")

    with pytest.raises(ModelError) as caught:
        await make_model(max_retries=2).respond(StubAgent(), USER_HI, [])

    assert caught.value.status == 504
    assert caught.value.message == "gateway timeout"
    assert len(fake.requests) == 3
    assert fake.pending == 0


async def test_timeout_after_retries_raises_without_status(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_hang()
    fake.enqueue_hang()

    with pytest.raises(ModelError) as caught:
        await make_model(timeout=0.2, max_retries=1).respond(StubAgent(), USER_HI, [])

    assert caught.value.status is None
    assert "did not answer within 0.2s (2 attempts)" in str(caught.value)
    assert isinstance(caught.value.__cause__, httpx.TimeoutException)
    assert len(fake.requests) == 2


async def test_unreachable_server_raises_after_retries() -> None:
    model = OpenAIChatModel(
        "gpt-test", f"http://127.0.0.1:{free_port()}/v1", max_retries=2, backoff_base=0.001
    )
    try:
        with capture_logs() as logs, pytest.raises(ModelError) as caught:
            await model.respond(StubAgent(), USER_HI, [])
    finally:
        await model.aclose()

    assert caught.value.status is None
    assert "could not be reached: ConnectError" in str(caught.value)
    assert [(e["attempt"], e["error"]) for e in logs if e["event"] == "model_retry"] == [
        (1, "ConnectError"),
        (2, "ConnectError"),
    ]


@pytest.mark.parametrize(
    ("body", "text", "why"),
    [
        ({"object": "chat.completion"}, None, "no choices"),
        ({"choices": []}, None, "no choices"),
        ({"choices": [{"index": 0, "finish_reason": "stop"}]}, None, "choices[0] has no message"),
        (
            chat_completion(None, [{"id": "c1", "type": "function"}]),
            None,
            "invalid tool call: KeyError 'function'",
        ),
        (None, "<html>It works!</html>", "the body is not JSON"),
    ],
    ids=["no-choices", "empty-choices", "no-message", "tool-call-without-function", "not-json"],
)
async def test_malformed_200_body_raises(
    fake: FakeOpenAI, make_model: MakeModel, body: Any, text: str | None, why: str
) -> None:
    fake.enqueue(200, body, text=text)

    with pytest.raises(ModelError) as caught:
        await make_model().respond(StubAgent(), USER_HI, [])

    assert caught.value.status is None
    assert f"malformed reply ({why}" in str(caught.value)
    assert len(fake.requests) == 1


async def test_a_client_passed_in_is_used_and_left_open(fake: FakeOpenAI, base_url: str) -> None:
    sent: list[str] = []

    async def record(request: httpx.Request) -> None:
        sent.append(str(request.url))

    fake.enqueue_reply("ok")
    async with httpx.AsyncClient(event_hooks={"request": [record]}) as client:
        model = OpenAIChatModel("gpt-test", base_url, client=client)
        await model.respond(StubAgent(), USER_HI, [])
        await model.aclose()

        assert sent == [f"{base_url}/chat/completions"]
        assert not client.is_closed


async def test_repr_hides_the_api_key() -> None:
    model = OpenAIChatModel("gpt-test", api_key=API_KEY)

    assert API_KEY not in repr(model)
    assert "gpt-test" in repr(model)


@pytest.mark.parametrize(
    ("spec", "base_url", "expected_model", "expected_url"),
    [
        ("openai:gpt-4o-mini", None, "gpt-4o-mini", DEFAULT_BASE_URL),
        ("openai:llama3.1:8b", "http://localhost:11434/v1/", "llama3.1:8b", "http://localhost:11434/v1"),
    ],
)
def test_spec_builds_a_model(spec: str, base_url: str | None, expected_model: str, expected_url: str) -> None:
    model = openai_model_from_spec(spec, base_url=base_url, api_key=None, timeout=12.5)

    assert (model.model, model.base_url, model.timeout) == (expected_model, expected_url, 12.5)


@pytest.mark.parametrize("spec", ["gpt-4o", "anthropic:claude", "openai:", "openai: ", "scripted:echo", ""])
def test_spec_rejects_other_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="openai:<model>"):
        openai_model_from_spec(spec, base_url=None, api_key=None)


def _http_date(*, seconds: int) -> str:
    return format_datetime(datetime.now(UTC) + timedelta(seconds=seconds), usegmt=True)


async def test_a_429_pauses_the_other_models_of_the_provider(fake: FakeOpenAI, base_url: str) -> None:
    """One model's 429 with Retry-After holds back a call of another model sharing the budget."""
    sleep = SleepRecorder()
    budget = ProviderBudget("openai", sleep=sleep)
    first = OpenAIChatModel("gpt-a", base_url, max_retries=0, budget=budget, sleep=sleep)
    second = OpenAIChatModel("gpt-b", base_url, max_retries=0, budget=budget, sleep=sleep)
    fake.enqueue_error(429, "Rate limit reached", headers={"Retry-After": "7"})
    fake.enqueue_reply("ok")
    try:
        with pytest.raises(ModelError) as refused:
            await first.respond(StubAgent(), USER_HI, [])
        assert refused.value.transient
        assert sleep.delays == []

        reply = await second.respond(StubAgent(), USER_HI, [])
    finally:
        await first.aclose()
        await second.aclose()

    assert reply.content == "ok"
    assert sleep.delays == [pytest.approx(7.0, abs=0.5)]  # the second model waited out the first's 429


@pytest.mark.parametrize(
    ("status", "transient", "permanent"),
    [(400, False, True), (401, False, True), (404, False, True), (429, True, False), (503, True, False)],
)
async def test_errors_say_whether_they_are_worth_waiting_for(
    fake: FakeOpenAI, make_model: MakeModel, status: int, transient: bool, permanent: bool
) -> None:
    fake.enqueue_error(status, "nope")

    with pytest.raises(ModelError) as failed:
        await make_model(max_retries=0).respond(StubAgent(), USER_HI, [])

    assert (failed.value.status, failed.value.transient, failed.value.permanent) == (
        status,
        transient,
        permanent,
    )


async def test_a_timeout_is_transient(fake: FakeOpenAI, make_model: MakeModel) -> None:
    fake.enqueue_hang()

    with pytest.raises(ModelError) as failed:
        await make_model(max_retries=0, timeout=0.2).respond(StubAgent(), USER_HI, [])

    assert failed.value.transient
    assert not failed.value.permanent


async def test_the_settings_build_the_worker_and_the_provider_budget(tmp_path: Path) -> None:
    """GATEWAY_MAX_TURNS_IN_FLIGHT bounds the worker; GATEWAY_OPENAI_* budget every openai model."""
    settings = gateway_settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}",
        model="openai:gpt-test",
        openai_api_key="sk-test-key",  # api.openai.com refuses calls without one: start-up needs it
        max_turns_in_flight=7,
        openai_max_concurrency=3,
        openai_rpm=120,
        openai_tpm=9000,
        model_retry_s=60,
        holding_reply_after_s=20,
    )
    services = build_services(settings)
    try:
        assert services.worker.concurrency == 7
        assert (services.worker.patience.retry_seconds, services.worker.patience.holding_after_seconds) == (
            60,
            20,
        )
        models = build_models(settings)
        first, second = models("openai:a"), models(None)  # None: GATEWAY_MODEL
        assert isinstance(first, OpenAIChatModel)
        assert isinstance(second, OpenAIChatModel)
        assert second.model == "gpt-test"
        assert first.budget is second.budget  # one budget per provider, whatever the model
        assert (first.budget.max_concurrency, first.budget.rpm, first.budget.tpm) == (3, 120, 9000)
    finally:
        await services.aclose()
