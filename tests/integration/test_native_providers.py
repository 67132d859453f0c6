"""Anthropic and Gemini models against fake servers on loopback that speak each wire format: text, usage,
tool round trips and handoffs through the Runner, errors, and each key kept to its own endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import RedirectResponse
from starlette.routing import Route
from structlog.testing import capture_logs

from gateway.agents import Agent, Runner, SessionStore, tool
from gateway.agents.models.anthropic import AnthropicModel
from gateway.agents.models.base import ModelError
from gateway.agents.models.gemini import GeminiModel
from gateway.agents.models.http_model import HttpChatModel
from gateway.agents.models.registry import Endpoint, model_factory
from tests.fake_providers import FakeAnthropic, FakeGemini, anthropic_message, gemini_response
from tests.fakes import FakeOpenAI
from tests.helpers import serve_in_thread

ANTHROPIC_KEY = "sk-ant-test-0123456789"
GEMINI_KEY = "AIza-test-0123456789"


@tool
def order_status(order_id: int) -> str:
    """Look an order up.

    Args:
        order_id: The order number.
    """
    return f"order {order_id} shipped"


@dataclass
class Provider:
    """One provider under test: its fake, its model, and how to script each kind of answer."""

    name: str
    fake: FakeAnthropic | FakeGemini
    model: HttpChatModel
    text: Callable[..., dict[str, Any]]
    call: Callable[[str, str, dict[str, Any]], dict[str, Any]]


def _anthropic_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return anthropic_message(tool_uses=[{"id": call_id, "name": name, "input": arguments}])


def _gemini_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return gemini_response(calls=[{"name": name, "args": arguments}])


@pytest.fixture(params=["anthropic", "gemini"])
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[Provider]:
    if request.param == "anthropic":
        fake: FakeAnthropic | FakeGemini = FakeAnthropic(ANTHROPIC_KEY)
        with serve_in_thread(fake.app) as url:
            model: HttpChatModel = AnthropicModel("claude-test", url, ANTHROPIC_KEY, backoff_base=0.001)
            yield Provider("anthropic", fake, model, anthropic_message, _anthropic_call)
            await model.aclose()
    else:
        fake = FakeGemini(GEMINI_KEY)
        with serve_in_thread(fake.app) as url:
            model = GeminiModel("gemini-test", f"{url}/v1beta", GEMINI_KEY, backoff_base=0.001)
            yield Provider("gemini", fake, model, gemini_response, _gemini_call)
            await model.aclose()


async def test_a_text_answer_with_its_usage(provider: Provider) -> None:
    provider.fake.enqueue(provider.text("Hello!", usage=(12, 3)))
    runner = Runner(Agent("Desk", "Be brief.", model=provider.model), SessionStore())

    result = await runner.run_async("s1", "hi")

    assert result.content == "Hello!"
    usage = result.new_messages[-1].usage
    assert usage is not None
    assert (usage.model, usage.input_tokens, usage.output_tokens) == (
        f"{provider.name}:{provider.model.model}",
        12,
        3,
    )
    (sent,) = provider.fake.requests
    text = repr(sent.json)
    assert "Be brief." in text  # the instructions, as the provider takes them
    assert "hi" in text


async def test_a_tool_round_trip_and_a_handoff(provider: Provider) -> None:
    billing = Agent("Billing", "You handle refunds.", model=provider.model)
    desk = Agent("Desk", "Help.", model=provider.model, tools=[order_status], handoffs=[billing])
    provider.fake.enqueue(provider.call("toolu_1", "order_status", {"order_id": 7}))
    provider.fake.enqueue(provider.call("toolu_2", "transfer_to_billing", {}))
    provider.fake.enqueue(provider.text("Billing here: order 7 shipped, refund opened."))
    store = SessionStore()
    runner = Runner(desk, store)

    result = await runner.run_async("s1", "refund order 7")

    assert result.content == "Billing here: order 7 shipped, refund opened."
    assert result.agent_name == "Billing"
    first, second, third = (request.json for request in provider.fake.requests)
    if provider.name == "anthropic":
        assert {t["name"] for t in first["tools"]} == {"order_status", "transfer_to_billing"}
        assert first["tools"][0]["input_schema"]["properties"]["order_id"]["type"] == "integer"
        assert second["messages"][-1] == {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "order 7 shipped"}],
        }
        assert second["messages"][-2]["content"][-1]["type"] == "tool_use"
        assert third["system"] == "You handle refunds."  # Billing answers the rest of the turn
    else:
        declarations = first["tools"][0]["functionDeclarations"]
        assert {d["name"] for d in declarations} == {"order_status", "transfer_to_billing"}
        assert second["contents"][-1] == {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "order_status", "response": {"result": "order 7 shipped"}}}
            ],
        }
        assert second["contents"][-2]["parts"][-1]["functionCall"]["name"] == "order_status"
        assert third["systemInstruction"] == {"parts": [{"text": "You handle refunds."}]}


async def test_a_refusal_is_permanent_and_says_why(provider: Provider) -> None:
    provider.fake.enqueue({"error": {"message": "tools.0.input_schema: invalid"}}, status=400)

    with pytest.raises(ModelError) as refused:
        await Runner(Agent("Desk", "Help.", model=provider.model), SessionStore()).run_async("s1", "hi")

    assert refused.value.permanent
    assert refused.value.status == 400
    assert "tools.0.input_schema: invalid" in str(refused.value)


async def test_a_blocked_prompt_is_permanent_and_says_why() -> None:
    """Gemini answers a prompt its filters block with 200 and no candidates: that was a "malformed reply",
    retried five times while the conversation's later messages waited. Asking again cannot help.
    (Anthropic's refusal is an answer, maybe empty, not a missing one.)"""
    fake = FakeGemini(GEMINI_KEY)
    fake.enqueue({"promptFeedback": {"blockReason": "PROHIBITED_CONTENT"}, "usageMetadata": {}})
    with serve_in_thread(fake.app) as url:
        model = GeminiModel("gemini-test", f"{url}/v1beta", GEMINI_KEY, backoff_base=0.001)
        with pytest.raises(ModelError) as refused:
            await Runner(Agent("Desk", "Help.", model=model), SessionStore()).run_async("s1", "hi")
        await model.aclose()

    assert refused.value.permanent
    assert "refused the request (the prompt was blocked: PROHIBITED_CONTENT)" in str(refused.value)
    assert len(fake.requests) == 1


@pytest.mark.parametrize("status", [503, 529])
async def test_an_overloaded_provider_is_retried(provider: Provider, status: int) -> None:
    provider.fake.enqueue({"error": {"message": "overloaded"}}, status=status)
    provider.fake.enqueue(provider.text("ok"))

    with capture_logs() as logs:
        result = await Runner(Agent("Desk", "Help.", model=provider.model), SessionStore()).run_async(
            "s1", "hi"
        )

    assert result.content == "ok"
    assert [e["status"] for e in logs if e["event"] == "model_retry"] == [status]
    assert ANTHROPIC_KEY not in repr(logs)
    assert GEMINI_KEY not in repr(logs)


@pytest.fixture
def look_alike() -> Iterator[tuple[FakeOpenAI, str]]:
    """Another server on loopback, where a redirect would send the key."""
    other = FakeOpenAI()
    with serve_in_thread(other.app) as url:
        yield other, url


@pytest.mark.parametrize("name", ["anthropic", "gemini"])
async def test_the_key_is_never_sent_after_a_redirect(name: str, look_alike: tuple[FakeOpenAI, str]) -> None:
    other, other_url = look_alike

    async def moved(request: Any) -> RedirectResponse:
        return RedirectResponse(f"{other_url}/v1/chat/completions", status_code=307)

    redirecting = Starlette(routes=[Route("/{path:path}", moved, methods=["POST"])])
    with serve_in_thread(redirecting) as url:
        key = ANTHROPIC_KEY if name == "anthropic" else GEMINI_KEY
        model: HttpChatModel = (
            AnthropicModel("claude-test", url, key)
            if name == "anthropic"
            else GeminiModel("gemini-test", url, key)
        )
        try:
            with pytest.raises(ModelError) as refused:
                await Runner(Agent("Desk", "Help.", model=model), SessionStore()).run_async("s1", "hi")
        finally:
            await model.aclose()

    assert refused.value.status == 307
    assert refused.value.permanent
    assert other.requests == []  # nothing, and so no key, reached the other server
    assert key not in str(refused.value)
    assert key not in repr(model)


async def test_each_key_goes_to_its_own_endpoint_only() -> None:
    anthropic, gemini = FakeAnthropic(ANTHROPIC_KEY), FakeGemini(GEMINI_KEY)
    anthropic.enqueue(anthropic_message("from claude"))
    gemini.enqueue(gemini_response("from gemini"))
    with serve_in_thread(anthropic.app) as anthropic_url, serve_in_thread(gemini.app) as gemini_url:
        models = model_factory(
            "scripted",
            openai_base_url="http://127.0.0.1:9/v1",
            openai_api_key="sk-openai-never-sent",
            endpoints={
                "anthropic": Endpoint(anthropic_url, ANTHROPIC_KEY),
                "gemini": Endpoint(f"{gemini_url}/v1beta", GEMINI_KEY),
            },
        )
        claude, flash = models("anthropic:claude-test"), models("gemini:gemini-test")
        assert isinstance(claude, AnthropicModel)
        assert isinstance(flash, GeminiModel)
        try:
            runner = Runner(
                Agent("Desk", "Help.", model="anthropic:claude-test"), SessionStore(), model_factory=models
            )
            assert (await runner.run_async("s1", "hi")).content == "from claude"
            runner = Runner(
                Agent("Desk", "Help.", model="gemini:gemini-test"), SessionStore(), model_factory=models
            )
            assert (await runner.run_async("s2", "hi")).content == "from gemini"
        finally:
            await claude.aclose()
            await flash.aclose()

    (to_anthropic,), (to_gemini,) = anthropic.requests, gemini.requests
    assert to_anthropic.headers["x-api-key"] == ANTHROPIC_KEY
    assert to_gemini.headers["x-goog-api-key"] == GEMINI_KEY
    assert GEMINI_KEY not in repr(to_anthropic)
    assert ANTHROPIC_KEY not in repr(to_gemini)
    assert "sk-openai-never-sent" not in repr(to_anthropic) + repr(to_gemini)
    assert "key=" not in to_gemini.path  # never in the URL
