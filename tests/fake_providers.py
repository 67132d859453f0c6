"""Fake Anthropic and Gemini servers for loopback tests: each speaks its provider's wire format, checks
what a real one checks first (the path, the key header, the body's shape: a 400 or 401 in the
provider's own error shape otherwise) and answers from a queue of scripted answers."""

from __future__ import annotations

import itertools
import json
from collections import deque
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.fakes import RecordedRequest


class _Scripted:
    def __init__(self) -> None:
        self.requests: list[RecordedRequest] = []
        self.script: deque[tuple[int, Any, dict[str, str]]] = deque()

    def enqueue(self, body: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.script.append((status, body, dict(headers or {})))

    async def _record(self, request: Request) -> Any:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        self.requests.append(RecordedRequest(request.method, request.url.path, dict(request.headers), body))
        return body

    def _next(self) -> Response:
        if not self.script:
            return JSONResponse({"error": {"message": "fake: no scripted answer left"}}, 500)
        status, body, headers = self.script.popleft()
        return JSONResponse(body, status, headers=headers)


class FakeAnthropic(_Scripted):
    """`POST /v1/messages` with `x-api-key` and `anthropic-version`."""

    def __init__(self, api_key: str) -> None:
        super().__init__()
        self.api_key = api_key

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/messages", self._messages, methods=["POST"])])

    async def _messages(self, request: Request) -> Response:
        body = await self._record(request)
        if request.headers.get("x-api-key") != self.api_key:
            return self._error(401, "authentication_error", "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return self._error(400, "invalid_request_error", "anthropic-version header is required")
        problem = _anthropic_problem(body)
        if problem:
            return self._error(400, "invalid_request_error", problem)
        return self._next()

    @staticmethod
    def _error(status: int, kind: str, message: str) -> Response:
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def _anthropic_problem(body: Any) -> str | None:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return "model: Field required"
    if not isinstance(body.get("max_tokens"), int):
        return "max_tokens: Field required"
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns or turns[0].get("role") != "user":
        return "messages: the first message must use the user role"
    for before, after in itertools.pairwise(turns):
        if before["role"] == after["role"]:
            return "messages: roles must alternate between user and assistant"
    for turn in turns:
        if not turn.get("content"):
            return "messages: all messages must have non-empty content"
    return None


def anthropic_message(
    text: str | None = None, tool_uses: list[dict[str, Any]] | None = None, usage: tuple[int, int] = (1, 1)
) -> dict[str, Any]:
    content: list[dict[str, Any]] = [] if text is None else [{"type": "text", "text": text}]
    content.extend({"type": "tool_use", **use} for use in tool_uses or [])
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": content,
        "stop_reason": "tool_use" if tool_uses else "end_turn",
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


class FakeGemini(_Scripted):
    """`POST /v1beta/models/{model}:generateContent` with `x-goog-api-key`."""

    def __init__(self, api_key: str) -> None:
        super().__init__()
        self.api_key = api_key

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1beta/models/{call:path}", self._generate, methods=["POST"])])

    async def _generate(self, request: Request) -> Response:
        body = await self._record(request)
        if not request.path_params["call"].endswith(":generateContent"):
            return self._error(404, "NOT_FOUND", "unknown method")
        if request.headers.get("x-goog-api-key") != self.api_key or "key" in request.query_params:
            return self._error(400, "INVALID_ARGUMENT", "API key not valid. Please pass a valid API key.")
        contents = body.get("contents") if isinstance(body, dict) else None
        if not isinstance(contents, list) or not contents:
            return self._error(400, "INVALID_ARGUMENT", "contents is not specified")
        for turn in contents:
            if turn.get("role") not in ("user", "model") or not turn.get("parts"):
                return self._error(400, "INVALID_ARGUMENT", "each content needs a role and parts")
        return self._next()

    @staticmethod
    def _error(status: int, code: str, message: str) -> Response:
        return JSONResponse({"error": {"code": status, "message": message, "status": code}}, status)


def gemini_response(
    text: str | None = None, calls: list[dict[str, Any]] | None = None, usage: tuple[int, int] = (1, 1)
) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [] if text is None else [{"text": text}]
    parts.extend({"functionCall": call} for call in calls or [])
    return {
        "candidates": [{"content": {"role": "model", "parts": parts}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {
            "promptTokenCount": usage[0],
            "candidatesTokenCount": usage[1],
            "totalTokenCount": sum(usage),
        },
        "modelVersion": "gemini-fake",
    }
