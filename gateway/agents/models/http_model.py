"""What every HTTP model provider's client shares: one POST per attempt through the provider's budget,
retries of what is worth retrying (429, 5xx gateways, timeouts, dropped connections) with capped,
jittered exponential backoff that defers to the server's `Retry-After` (a 429 pauses the whole provider
instead), `ModelError` for the rest, and each answer's usage. A provider's subclass says where to post,
with which headers, and how its wire format maps to the gateway's messages.

The API key goes only to the model's own base URL, in a header: never in a URL (which logs and error
messages may show), never after a redirect (the client does not follow them; a 3xx is an error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Protocol

import httpx
import orjson
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

from gateway.agents.models.base import ModelError, ToolSpec
from gateway.agents.models.breaker import ProviderDown
from gateway.agents.models.budget import Grant, ProviderBudget, estimate_tokens
from gateway.agents.models.wire import (
    RETRYABLE_ERRORS,
    RETRYABLE_STATUSES,
    error_message,
    excerpt,
    retry_after,
)
from gateway.domain.messages import Message, ModelUsage
from gateway.http_client import HttpAnswer, endpoint, http_client, post

__all__ = ["AgentLike", "HttpChatModel", "Malformed", "Refused"]

logger = structlog.get_logger(__name__)


class AgentLike(Protocol):
    """The two things a model needs of an agent (the real Agent class satisfies it)."""

    @property
    def name(self) -> str: ...

    def render_instructions(self) -> str: ...


class Malformed(Exception):
    """Raised by a subclass's `parse_reply`: the answer does not have the provider's shape (why)."""


class Refused(Exception):
    """Raised by a subclass's `parse_reply`: the provider declined the request itself (why), e.g. a
    blocked prompt: asking again cannot help, so the turn is dead at once."""


class _RetryableStatus(Exception):
    """An answer with a status in RETRYABLE_STATUSES; tenacity retries on it."""

    def __init__(self, status: int, message: str, retry_after: float | None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.retry_after = retry_after


# What another attempt may cure.
_RETRIED: tuple[type[Exception], ...] = (_RetryableStatus, *RETRYABLE_ERRORS)


class HttpChatModel:
    """The `Model` protocol over one provider's HTTP API; subclasses set PROVIDER, DEFAULT_BASE_URL and
    implement `url`, `headers`, `build_request`, `parse_reply` and `tokens`.

    It sends through one `httpx.AsyncClient`: the one passed in (shared with the rest of the app, and
    left open), or one it creates on first use and closes in `aclose()`. `timeout` applies to each
    attempt; `max_retries` counts retries after the first attempt. `backoff_base` and `backoff_max`
    shape the full-jitter backoff, `retry_after_max` caps a server's `Retry-After`, and `sleep` is the
    awaitable used to wait, so tests can record delays instead of waiting them. `budget` is the
    provider's (shared by its models); without one, calls are unlimited.
    """

    PROVIDER: ClassVar[str]
    DEFAULT_BASE_URL: ClassVar[str]

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
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
        self.base_url = (base_url or self.DEFAULT_BASE_URL).rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self._api_key = api_key
        self._client = client
        self._owns_client = client is None
        self._backoff = wait_random_exponential(multiplier=backoff_base, max=backoff_max)
        self._retry_after_max = retry_after_max
        self._sleep = sleep
        self.budget = budget or ProviderBudget(self.PROVIDER, sleep=sleep)

    def __repr__(self) -> str:  # never shows the api key
        return f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r})"

    @property
    def spec(self) -> str:
        """The model as a spec string: how usage and metrics name it."""
        return f"{self.PROVIDER}:{self.model}"

    @property
    def url(self) -> str:
        raise NotImplementedError

    def headers(self, api_key: str | None) -> dict[str, str]:
        """The request's headers besides Content-Type: the key, as the provider wants it."""
        raise NotImplementedError

    def build_request(
        self, agent: AgentLike, history: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        """The JSON body of one request."""
        raise NotImplementedError

    def parse_reply(self, data: Any, agent: AgentLike) -> Message:
        """The answer's JSON as a MODEL message; `Malformed` when it does not have the expected shape."""
        raise NotImplementedError

    def tokens(self, data: Any) -> tuple[int, int]:
        """The input and output tokens the provider counted for the answer (0 where it did not)."""
        raise NotImplementedError

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
        try:
            data = response.json()
        except ValueError:
            raise self._malformed(response, "the body is not JSON") from None
        try:
            reply = self.parse_reply(data, agent)
        except Malformed as exc:
            raise self._malformed(response, str(exc)) from None
        except Refused as exc:
            raise ModelError(
                f"{self.PROVIDER} model {self.model!r} refused the request ({exc})",
                provider=self.PROVIDER,
                refused=True,
            ) from None
        input_tokens, output_tokens = self.tokens(data)
        if input_tokens or output_tokens:
            self.budget.spend(grant, input_tokens + output_tokens)
        reply.usage = ModelUsage(self.spec, input_tokens, output_tokens, seconds)
        return reply

    async def _post_with_retries(self, body: dict[str, Any]) -> tuple[HttpAnswer, Grant, float]:
        attempts = self.max_retries + 1
        try:
            try:
                return await self._post_once(body)
            except _RETRIED as first:
                return await self._retry(body, first)
        except _RetryableStatus as exc:
            raise ModelError(exc.message, status=exc.status, provider=self.PROVIDER, transient=True) from None
        except ProviderDown as exc:
            raise ModelError(f"{self.PROVIDER}: {exc}", provider=self.PROVIDER, transient=True) from None
        except httpx.TimeoutException as exc:
            raise ModelError(
                f"{self.PROVIDER} model {self.model!r} at {self.url} did not answer within {self.timeout}s "
                f"({attempts} attempt{'s' if attempts > 1 else ''})",
                provider=self.PROVIDER,
                transient=True,
            ) from exc
        except httpx.TransportError as exc:
            raise ModelError(
                f"{self.PROVIDER} model {self.model!r} at {self.url} could not be reached: "
                f"{type(exc).__name__}: {exc}",
                provider=self.PROVIDER,
                transient=isinstance(exc, RETRYABLE_ERRORS),
            ) from exc

    async def _retry(self, body: dict[str, Any], first: BaseException) -> tuple[HttpAnswer, Grant, float]:
        """The attempts after a first one failed with `first`, which tenacity is shown as its attempt 1
        (its wait, its log line). The first attempt goes without tenacity: setting up its retry state
        cost ~24 us a call, 2% of a turn's CPU at model latency, for calls that mostly succeed at once."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception_type(_RETRIED),
            before_sleep=self._log_retry,
            sleep=self._backoff_sleep,
            reraise=True,
        )
        failed: BaseException | None = first
        async for attempt in retrying:
            with attempt:
                if failed is not None:
                    error, failed = failed, None
                    raise error
                return await self._post_once(body)
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _post_once(self, body: dict[str, Any]) -> tuple[HttpAnswer, Grant, float]:
        """One attempt: the answer, its budget grant and its seconds (from the request's start)."""
        if self._client is None:
            self._client = http_client(self.timeout)
        headers = {"Content-Type": "application/json", **self.headers(self._api_key)}
        content = orjson.dumps(body)
        breaker = self.budget.breaker
        async with self.budget.call(estimate_tokens(len(content))) as grant:
            started = time.perf_counter()
            try:
                response = await post(self._client, endpoint(self.url), content, headers, self.timeout)
            except RETRYABLE_ERRORS:
                breaker.failed()
                raise
            if response.status_code in RETRYABLE_STATUSES and response.status_code != 429:
                breaker.failed()
            else:
                breaker.succeeded()  # it answered: a refusal or a 429 is no outage
            if response.is_success:
                return response, grant, time.perf_counter() - started
        message = error_message(response)
        wait = retry_after(response.headers)
        if response.status_code == 429:
            self.budget.pause(None if wait is None else min(wait, self._retry_after_max))
        if response.status_code in RETRYABLE_STATUSES:
            raise _RetryableStatus(response.status_code, message, wait)
        raise ModelError(message, status=response.status_code, provider=self.PROVIDER)

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
            provider=self.PROVIDER,
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

    def _malformed(self, response: HttpAnswer, why: str) -> ModelError:
        return ModelError(
            f"{self.PROVIDER} model {self.model!r} sent a malformed reply ({why}): {excerpt(response.text)}",
            provider=self.PROVIDER,
        )
