"""A model backed by any OpenAI-compatible Chat Completions server.

OpenAI, Azure OpenAI, Gemini's and Grok's compatible endpoints, Ollama, vLLM and LiteLLM all answer
`POST {base_url}/chat/completions`, so one small client covers them. It maps the gateway's history to
the wire format and back; sending, retries, the budget and errors are HttpChatModel's
(gateway/agents/models/http_model.py).

Tool-call arguments that are not a JSON object do not fail the turn: the call is kept with the raw text
under `RAW_ARGUMENTS_KEY`, so the tool layer rejects the arguments like any other invalid ones and the
model can correct itself on the next step.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from gateway.agents.models.base import ToolSpec
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.http_model import AgentLike, HttpChatModel, Malformed
from gateway.agents.models.wire import RETRYABLE_STATUSES
from gateway.domain.messages import Message, Role, ToolCall

__all__ = [
    "DEFAULT_BASE_URL",
    "RAW_ARGUMENTS_KEY",
    "RETRYABLE_STATUSES",
    "OpenAIChatModel",
    "openai_model_from_spec",
]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
# Under this key a tool call keeps arguments that were not a JSON object, for the tool layer to reject.
RAW_ARGUMENTS_KEY = "__raw_arguments__"


class OpenAIChatModel(HttpChatModel):
    """The `Model` protocol over an OpenAI-compatible `/chat/completions` endpoint (a bearer key)."""

    PROVIDER = "openai"
    DEFAULT_BASE_URL = DEFAULT_BASE_URL

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

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

    def parse_reply(self, data: Any, agent: AgentLike) -> Message:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise Malformed("no choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise Malformed("choices[0] has no message")
        raw_calls = message.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise Malformed("tool_calls is not a list")
        try:
            tool_calls = [_parse_tool_call(raw) for raw in raw_calls]
        except (KeyError, TypeError) as exc:
            raise Malformed(f"invalid tool call: {type(exc).__name__} {exc}") from None
        return Message(
            role=Role.MODEL,
            content=_parse_content(message.get("content"), message.get("refusal")),
            tool_calls=tool_calls,
            agent_name=agent.name,
        )

    def tokens(self, data: Any) -> tuple[int, int]:
        """`usage.prompt_tokens` and `completion_tokens` (0 where not counted)."""
        usage = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(usage, dict):
            return 0, 0
        return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def count(value: Any) -> int:
    """A token count from an answer: a non-negative int, else 0."""
    return value if isinstance(value, int) and value >= 0 else 0


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
    return OpenAIChatModel(model.strip(), base_url, api_key, timeout, client=client, budget=budget)


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


def _parse_content(content: Any, refusal: Any) -> str | None:
    """The reply's text; a refusal (the `refusal` field, or a content part of that type) is the model's
    words to the user as well, else the user would get no reply at all."""
    text: str | None
    if isinstance(content, list):  # content parts: keep the text and refusal ones
        text = "".join(
            str(p.get("text") or p.get("refusal") or "")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "refusal")
        )
    else:
        text = None if content is None else str(content)
    if not text and isinstance(refusal, str) and refusal:
        return refusal
    return text
