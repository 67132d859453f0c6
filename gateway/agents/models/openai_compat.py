"""A model backed by any OpenAI-compatible Chat Completions server.

OpenAI, Azure OpenAI, Gemini's and Grok's compatible endpoints, Ollama, vLLM and LiteLLM all answer
`POST {base_url}/chat/completions`, so one small client covers them. It maps the gateway's history to
the wire format and back, and retries what is worth retrying (429, 5xx gateways, timeouts, dropped
connections) with capped, jittered exponential backoff that defers to the server's `Retry-After`.
Everything else becomes a `ModelError` carrying the provider's status and message. Each attempt
passes through the provider's budget (gateway/agents/models/budget.py): it waits for room, and a
429 pauses every call to the provider.

Tool-call arguments that are not a JSON object do not fail the turn: the call is kept with the raw text
under `RAW_ARGUMENTS_KEY`, so the tool layer rejects the arguments like any other invalid ones and the
model can correct itself on the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import httpx
import orjson
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

from gateway.agents.models.base import ModelError, ToolSpec
from gateway.agents.models.budget import Grant, ProviderBudget, estimate_tokens
from gateway.agents.models.wire import (
    RETRYABLE_ERRORS,
    RETRYABLE_STATUSES,
    error_message,
    excerpt,
    retry_after,
)
from gateway.domain.messages import Message, ModelUsage, Role, ToolCall
from gateway.http_client import http_client

__all__ = [
    "DEFAULT_BASE_URL",
    "RAW_ARGUMENTS_KEY",
    "RETRYABLE_STATUSES",
    "OpenAIChatModel",
    "openai_model_from_spec",
]

logger = structlog.get_logger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
PROVIDER = "openai"
# Under this key a tool call keeps arguments that were not a JSON object, for the tool layer to reject.
RAW_ARGUMENTS_KEY = "__raw_arguments__"


class AgentLike(Protocol):
    """The two things this model needs of an agent (the real Agent class satisfies it)."""

    @property
    def name(self) -> str: ...

    def render_instructions(self) -> str: ...


class _RetryableStatus(Exception):
    """An answer with a status in RETRYABLE_STATUSES; tenacity retries on it."""

    def __init__(self, status: int, message: str, retry_after: float | None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


class OpenAIChatModel:
    """The `Model` protocol over an OpenAI-compatible `/chat/completions` endpoint.

    It sends through one `httpx.AsyncClient`: the one passed in (shared with the rest of the app, and
    left open), or one it creates on first use and closes in `aclose()`. `timeout` applies to each
    attempt; `max_retries` counts retries after the first attempt. `backoff_base` and `backoff_max`
    shape the full-jitter backoff, `retry_after_max` caps a server's `Retry-After`, and `sleep` is the
    awaitable used to wait, so tests can record delays instead of waiting them. `budget` is the
    provider's (shared by its models); without one, calls are unlimited.
    """

    def __init__(
        self,
        model: str,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        max_retries: int = 3,
        client: httpx.AsyncClient | None = None,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        retry_after_max: float = 60.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        budget: ProviderBudget | None = None,
    ) -> None:
        if not model:
            raise ValueError("model name must not be empty")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self._api_key = api_key
        self._client = client
        self._owns_client = client is None
        self._backoff = wait_random_exponential(multiplier=backoff_base, max=backoff_max)
        self._retry_after_max = retry_after_max
        self._sleep = sleep
        self.budget = budget or ProviderBudget(PROVIDER, sleep=sleep)

    def __repr__(self) -> str:  # never shows the api key
        return f"OpenAIChatModel(model={self.model!r}, base_url={self.base_url!r})"

    @property
    def spec(self) -> str:
        """The model as a spec string: how usage and metrics name it."""
        return f"{PROVIDER}:{self.model}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    async def aclose(self) -> None:
        """Close the HTTP client if this model created it; a client passed in belongs to its owner."""
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def respond(
        self, agent: AgentLike, history: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> Message:
        """Send the agent's instructions, the history and the tools; return the reply as a MODEL message."""
        response, grant, seconds = await self._post_with_retries(self.build_request(agent, history, tools))
        reply, data = self._parse_reply(response, agent)
        input_tokens, output_tokens = _tokens(data)
        if input_tokens or output_tokens:
            self.budget.spend(grant, input_tokens + output_tokens)
        reply.usage = ModelUsage(self.spec, input_tokens, output_tokens, seconds)
        return reply

    def build_request(
        self, agent: AgentLike, history: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        """The JSON body of one Chat Completions request."""
        messages: list[dict[str, Any]] = []
        instructions = agent.render_instructions()
        if instructions:
            messages.append({"role": "system", "content": instructions})
        messages.extend(_wire_message(message) for message in history)
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            body["tools"] = [_wire_tool(tool) for tool in tools]
        return body

    async def _post_with_retries(self, body: dict[str, Any]) -> tuple[httpx.Response, Grant, float]:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type((_RetryableStatus, *RETRYABLE_ERRORS)),
            before_sleep=self._log_retry,
            sleep=self._backoff_sleep,
            reraise=True,
        )
        attempts = self.max_retries + 1
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post_once(body)
        except _RetryableStatus as exc:
            raise ModelError(exc.message, status=exc.status, provider=PROVIDER, transient=True) from None
        except httpx.TimeoutException as exc:
            raise ModelError(
                f"{PROVIDER} model {self.model!r} at {self.url} did not answer within {self.timeout}s "
                f"({attempts} attempt{'s' if attempts > 1 else ''})",
                provider=PROVIDER,
                transient=True,
            ) from exc
        except httpx.TransportError as exc:
            raise ModelError(
                f"{PROVIDER} model {self.model!r} at {self.url} could not be reached: "
                f"{type(exc).__name__}: {exc}",
                provider=PROVIDER,
                transient=isinstance(exc, RETRYABLE_ERRORS),
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _post_once(self, body: dict[str, Any]) -> tuple[httpx.Response, Grant, float]:
        """One attempt: the answer, its budget grant and its seconds (from the request's start)."""
        if self._client is None:
            self._client = http_client(self.timeout)
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        content = orjson.dumps(body)
        async with self.budget.call(estimate_tokens(len(content))) as grant:
            started = time.perf_counter()
            response = await self._client.post(
                self.url, content=content, headers=headers, timeout=self.timeout
            )
            if response.is_success:
                return response, grant, time.perf_counter() - started
        message = error_message(response)
        wait = retry_after(response.headers)
        if response.status_code == 429:
            self.budget.pause(None if wait is None else min(wait, self._retry_after_max))
        if response.status_code in RETRYABLE_STATUSES:
            raise _RetryableStatus(response.status_code, message, wait)
        raise ModelError(message, status=response.status_code, provider=PROVIDER)

    def _wait(self, state: RetryCallState) -> float:
        """The server's Retry-After when it gave one (capped), else jittered exponential backoff; none
        after a 429, whose pause of the whole provider holds the retry in the budget."""
        error = state.outcome.exception() if state.outcome else None
        if isinstance(error, _RetryableStatus) and error.status == 429:
            return 0.0
        if isinstance(error, _RetryableStatus) and error.retry_after is not None:
            return min(error.retry_after, self._retry_after_max)
        return self._backoff(state)

    async def _backoff_sleep(self, seconds: float) -> None:
        if seconds > 0:
            await self._sleep(seconds)

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        logger.warning(
            "model_retry",
            provider=PROVIDER,
            model=self.model,
            status=error.status if isinstance(error, _RetryableStatus) else None,
            error=None if isinstance(error, _RetryableStatus) else type(error).__name__,
            attempt=state.attempt_number,
            delay=round(self._retry_delay(error, state), 3),
        )

    def _retry_delay(self, error: BaseException | None, state: RetryCallState) -> float:
        if isinstance(error, _RetryableStatus) and error.status == 429:
            return self.budget.paused_for()
        return state.next_action.sleep if state.next_action else 0.0

    def _parse_reply(self, response: httpx.Response, agent: AgentLike) -> tuple[Message, Any]:
        """The reply as a MODEL message, and the answer's JSON (for its usage)."""
        try:
            data = response.json()
        except ValueError:
            raise self._malformed(response, "the body is not JSON") from None
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._malformed(response, "no choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise self._malformed(response, "choices[0] has no message")
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise self._malformed(response, "tool_calls is not a list")
        try:
            tool_calls = [_parse_tool_call(raw) for raw in raw_calls]
        except (KeyError, TypeError) as exc:
            raise self._malformed(response, f"invalid tool call: {type(exc).__name__} {exc}") from None
        reply = Message(
            role=Role.MODEL,
            content=_parse_content(message.get("content")),
            tool_calls=tool_calls,
            agent_name=agent.name,
        )
        return reply, data

    def _malformed(self, response: httpx.Response, why: str) -> ModelError:
        return ModelError(
            f"{PROVIDER} model {self.model!r} sent a malformed reply ({why}): {excerpt(response.text)}",
            provider=PROVIDER,
        )


def openai_model_from_spec(
    spec: str,
    *,
    base_url: str | None,
    api_key: str | None,
    timeout: float = 60.0,
    client: httpx.AsyncClient | None = None,
    budget: ProviderBudget | None = None,
) -> OpenAIChatModel:
    """Build the model named by a setting such as `openai:gpt-4o-mini` (the base URL picks the server)."""
    prefix, sep, model = spec.strip().partition(":")
    if prefix != "openai" or not sep or not model.strip():
        raise ValueError(f"expected a model spec of the form 'openai:<model>', got {spec!r}")
    return OpenAIChatModel(
        model.strip(), base_url or DEFAULT_BASE_URL, api_key, timeout, client=client, budget=budget
    )


def _wire_message(message: Message) -> dict[str, Any]:
    if message.role is Role.MODEL:
        wire: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            wire["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in message.tool_calls
            ]
        elif message.content is None:
            wire["content"] = ""  # an assistant message needs content or tool calls
        return wire
    if message.role is Role.TOOL:
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content or ""}
    return {"role": message.role.value, "content": message.content or ""}  # system, user


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)},
    }


def _parse_tool_call(raw: Any) -> ToolCall:
    function = raw["function"]
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise TypeError("function.name is not a non-empty string")
    # Some servers (older Ollama) omit the id; the TOOL answer must still be able to name the call.
    call_id = raw.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(id=str(call_id), name=name, arguments=_parse_arguments(function.get("arguments")))


def _parse_arguments(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}  # a tool without parameters
    if isinstance(raw, dict):
        return raw  # a few servers send an object instead of a JSON string
    text = raw if isinstance(raw, str) else json.dumps(raw)
    try:
        parsed = json.loads(text)
    except ValueError:
        return {RAW_ARGUMENTS_KEY: text}
    if parsed is None:
        return {}
    return parsed if isinstance(parsed, dict) else {RAW_ARGUMENTS_KEY: text}


def _parse_content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _tokens(data: Any) -> tuple[int, int]:
    """`usage.prompt_tokens` and `completion_tokens` of a successful answer (0 where not counted)."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0
