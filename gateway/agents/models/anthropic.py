"""A model backed by Anthropic's Messages API (`POST {base_url}/v1/messages`), with tool use.

The gateway's history maps to alternating user and assistant turns of content blocks: a MODEL message's
tool calls become `tool_use` blocks, the TOOL answers that follow become one user turn of `tool_result`
blocks, and SYSTEM messages join the agent's instructions in `system`. The key goes in `x-api-key`.
Sending, retries (529 "overloaded" included), the budget and errors are HttpChatModel's.

Hand-written rather than the `anthropic` SDK (an optional extra was the first choice): the request and
answer are two small JSON shapes (these 130 lines), while `import anthropic` (2.15.0) took 1.07 s and
loaded 3,512 modules here against 2 ms and 2 modules for this and gemini.py, and the SDK's own retries,
client and response models would sit beside the budget, retries and errors every provider here shares.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from gateway.agents.models.base import ToolSpec
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.http_model import AgentLike, HttpChatModel, Malformed
from gateway.agents.models.openai_compat import count
from gateway.domain.messages import Message, Role, ToolCall

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 1024  # the Messages API needs a limit on the answer


class AnthropicModel(HttpChatModel):
    """The `Model` protocol over Anthropic's Messages API. `max_tokens` caps each answer."""

    PROVIDER = "anthropic"
    DEFAULT_BASE_URL = DEFAULT_BASE_URL
    max_tokens = DEFAULT_MAX_TOKENS

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/messages"

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def build_request(
        self, agent: AgentLike, history: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        system = [agent.render_instructions()]
        turns: list[dict[str, Any]] = []
        for message in history:
            if message.role is Role.SYSTEM:
                system.append(message.content or "")
                continue
            role = "assistant" if message.role is Role.MODEL else "user"
            blocks = _blocks(message)
            if turns and turns[-1]["role"] == role:
                turns[-1]["content"].extend(blocks)  # the API wants user and assistant to alternate
            else:
                turns.append({"role": role, "content": blocks})
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": turns}
        if instructions := "\n\n".join(part for part in system if part):
            body["system"] = instructions
        if tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
                for t in tools
            ]
        return body

    def parse_reply(self, data: Any, agent: AgentLike) -> Message:
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, list):
            raise Malformed("no content")
        texts: list[str] = []
        calls: list[ToolCall] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use":
                call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
                if not (isinstance(call_id, str) and isinstance(name, str) and name):
                    raise Malformed("a tool_use block without id or name")
                calls.append(ToolCall(call_id, name, arguments if isinstance(arguments, dict) else {}))
        return Message(Role.MODEL, "".join(texts) if texts else None, tool_calls=calls, agent_name=agent.name)

    def tokens(self, data: Any) -> tuple[int, int]:
        usage = data.get("usage") if isinstance(data, dict) else None
        if not isinstance(usage, dict):
            return 0, 0
        return count(usage.get("input_tokens")), count(usage.get("output_tokens"))


def _blocks(message: Message) -> list[dict[str, Any]]:
    if message.role is Role.TOOL:
        return [
            {"type": "tool_result", "tool_use_id": message.tool_call_id, "content": message.content or ""}
        ]
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks.extend(
        {"type": "tool_use", "id": call.id, "name": call.name, "input": _jsonable(call.arguments)}
        for call in message.tool_calls
    )
    return blocks or [{"type": "text", "text": "(no text)"}]  # the API refuses an empty turn


def _jsonable(arguments: dict[str, Any]) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(json.dumps(arguments, default=str))
    return parsed


def anthropic_model_from_spec(
    spec: str,
    *,
    base_url: str | None,
    api_key: str | None,
    client: httpx.AsyncClient | None = None,
    budget: ProviderBudget | None = None,
) -> AnthropicModel:
    """Build the model named by a setting such as `anthropic:claude-sonnet-4-5`."""
    prefix, sep, model = spec.strip().partition(":")
    if prefix != "anthropic" or not sep or not model.strip():
        raise ValueError(f"expected a model spec of the form 'anthropic:<model>', got {spec!r}")
    return AnthropicModel(model.strip(), base_url, api_key, client=client, budget=budget)
