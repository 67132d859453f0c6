"""A model backed by Google's Gemini API (`POST {base_url}/models/<model>:generateContent`), with function
calling.

The gateway's history maps to `contents` of user and model turns: a MODEL message's tool calls become
`functionCall` parts, the TOOL answers that follow one user turn of `functionResponse` parts (by tool
name; Gemini's call ids are echoed when it sent them), SYSTEM messages join the instructions in
`systemInstruction`. Tools are `functionDeclarations` with their JSON schema as `parametersJsonSchema`.
The key goes in the `x-goog-api-key` header, never in the URL's `?key=` (URLs reach logs and errors).
Sending, retries, the budget and errors are HttpChatModel's.

Hand-written rather than the `google-genai` SDK (an optional extra was the first choice): two small JSON
shapes, while `import google.genai` (3.6.1) took 0.50 s and 407 modules here (2 ms and 2 modules for
this and anthropic.py) and installs google-auth, requests and websockets: an HTTP client, retries and
an auth stack beside the ones every provider here shares.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from gateway.agents.models.base import ToolSpec
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.http_model import AgentLike, HttpChatModel, Malformed, Refused
from gateway.agents.models.openai_compat import count
from gateway.domain.messages import Message, Role, ToolCall

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"


class GeminiModel(HttpChatModel):
    """The `Model` protocol over the Gemini API's generateContent."""

    PROVIDER = "gemini"
    DEFAULT_BASE_URL = DEFAULT_BASE_URL

    @property
    def url(self) -> str:
        return f"{self.base_url}/models/{self.model}:generateContent"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"x-goog-api-key": api_key} if api_key else {}

    def build_request(
        self, agent: AgentLike, history: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> dict[str, Any]:
        system = [agent.render_instructions()]
        contents: list[dict[str, Any]] = []
        for message in history:
            if message.role is Role.SYSTEM:
                system.append(message.content or "")
                continue
            role = "model" if message.role is Role.MODEL else "user"
            parts = _parts(message)
            if contents and contents[-1]["role"] == role:
                contents[-1]["parts"].extend(parts)
            else:
                contents.append({"role": role, "parts": parts})
        body: dict[str, Any] = {"contents": contents}
        if instructions := "\n\n".join(part for part in system if part):
            body["systemInstruction"] = {"parts": [{"text": instructions}]}
        if tools:
            declarations = [
                {"name": t.name, "description": t.description, "parametersJsonSchema": dict(t.parameters)}
                for t in tools
            ]
            body["tools"] = [{"functionDeclarations": declarations}]
        return body

    def parse_reply(self, data: Any, agent: AgentLike) -> Message:
        candidates = data.get("candidates") if isinstance(data, dict) else None
        if not isinstance(candidates, list) or not candidates or not isinstance(candidates[0], dict):
            feedback = data.get("promptFeedback") if isinstance(data, dict) else None
            blocked = feedback.get("blockReason") if isinstance(feedback, dict) else None
            if isinstance(blocked, str) and blocked:
                raise Refused(f"the prompt was blocked: {blocked[:64]}")
            raise Malformed("no candidates")
        content = candidates[0].get("content") or {}
        parts = content.get("parts") if isinstance(content, dict) else None
        if not isinstance(parts, list):
            parts = []  # e.g. finishReason SAFETY: an empty answer, not a broken one
        texts: list[str] = []
        calls: list[ToolCall] = []
        for part in parts:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str) and not part.get("thought"):
                texts.append(part["text"])
            call = part.get("functionCall")
            if isinstance(call, dict):
                name = call.get("name")
                if not isinstance(name, str) or not name:
                    raise Malformed("a functionCall without a name")
                arguments = call.get("args")
                call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
                calls.append(ToolCall(str(call_id), name, arguments if isinstance(arguments, dict) else {}))
        return Message(Role.MODEL, "".join(texts) if texts else None, tool_calls=calls, agent_name=agent.name)

    def tokens(self, data: Any) -> tuple[int, int]:
        usage = data.get("usageMetadata") if isinstance(data, dict) else None
        if not isinstance(usage, dict):
            return 0, 0
        return count(usage.get("promptTokenCount")), count(usage.get("candidatesTokenCount"))


def _parts(message: Message) -> list[dict[str, Any]]:
    if message.role is Role.TOOL:
        response: dict[str, Any] = {"name": message.name or "", "response": {"result": message.content or ""}}
        if message.tool_call_id and not message.tool_call_id.startswith("call_"):
            response["id"] = message.tool_call_id  # Gemini's own id: echoed back
        return [{"functionResponse": response}]
    parts: list[dict[str, Any]] = []
    if message.content:
        parts.append({"text": message.content})
    for call in message.tool_calls:
        function_call: dict[str, Any] = {
            "name": call.name,
            "args": json.loads(json.dumps(call.arguments, default=str)),
        }
        if not call.id.startswith("call_"):
            function_call["id"] = call.id
        parts.append({"functionCall": function_call})
    return parts or [{"text": ""}]


def gemini_model_from_spec(
    spec: str,
    *,
    base_url: str | None,
    api_key: str | None,
    client: httpx.AsyncClient | None = None,
    budget: ProviderBudget | None = None,
) -> GeminiModel:
    """Build the model named by a setting such as `gemini:gemini-2.5-flash`."""
    prefix, sep, model = spec.strip().partition(":")
    if prefix != "gemini" or not sep or not model.strip() or "/" in model:
        raise ValueError(f"expected a model spec of the form 'gemini:<model>', got {spec!r}")
    return GeminiModel(model.strip(), base_url, api_key, client=client, budget=budget)
