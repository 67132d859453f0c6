"""Fake external servers for tests, served on real loopback HTTP with `tests.helpers.serve_in_thread`.

Each fake is a small Starlette app that answers from a script the test writes beforehand and records
every request it receives, so a test can assert both what the gateway did with an answer and what it
sent. The fakes run in the server's thread while the test appends to the script from its own, so they
only use thread-safe containers (deque appends and pops, list appends).

- `FakeOpenAI`: an OpenAI-compatible Chat Completions server (`POST /v1/chat/completions`).
- `FakeTelegram`: the Bot API (`POST /bot<token>/<method>`).
- `FakeWhatsApp`: the Graph API's send endpoint (`POST /<phone_number_id>/messages`).
- `FakePlatform`: any platform's API, every POST answered from a script (the contract tests').
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass(frozen=True)
class RecordedRequest:
    """One request a fake received: its path, headers (lower-cased names) and JSON body."""

    method: str
    path: str
    headers: dict[str, str]
    json: Any


@dataclass(frozen=True)
class ScriptedResponse:
    """One scripted answer: a JSON body (or raw `text`) with a status and headers, or a hang.

    A hanging answer never comes: the handler waits until the client gives up and disconnects, so
    timeouts are tested without sleeping and the server still stops promptly afterwards.
    """

    status: int = 200
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    text: str | None = None
    hang: bool = False


def chat_completion(
    content: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    *,
    model: str = "fake-model",
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A Chat Completions response body with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason or ("tool_calls" if tool_calls else "stop"),
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def tool_call(call_id: str, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """One `tool_calls` entry; a dict is JSON-encoded as the API does, a string is sent as it is."""
    encoded = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": encoded}}


def openai_error(
    message: str, *, type_: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """An error body in OpenAI's shape."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class FakeOpenAI:
    """An OpenAI-compatible server that answers from a queue of scripted responses.

    Serve `app` and point a model at `{url}/v1`. When the queue is empty it answers 500 with an
    OpenAI-shaped error saying so, which makes an unscripted request fail loudly.
    """

    def __init__(self) -> None:
        self._script: deque[ScriptedResponse] = deque()
        self.requests: list[RecordedRequest] = []
        self._app = Starlette(routes=[Route("/v1/chat/completions", self._completions, methods=["POST"])])

    @property
    def app(self) -> Starlette:
        return self._app

    def enqueue(
        self,
        status: int = 200,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        text: str | None = None,
    ) -> None:
        """Script the next answer: a JSON `body`, or a raw `text` body."""
        self._script.append(
            ScriptedResponse(status=status, body=body, headers=dict(headers or {}), text=text)
        )

    def enqueue_reply(self, content: str) -> None:
        """Script a plain text reply."""
        self.enqueue(body=chat_completion(content))

    def enqueue_tool_calls(self, *calls: dict[str, Any], content: str | None = None) -> None:
        """Script a reply asking for tools (build each call with `tool_call`)."""
        self.enqueue(body=chat_completion(content, list(calls)))

    def enqueue_error(self, status: int, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        """Script an OpenAI-shaped error answer."""
        self.enqueue(status, openai_error(message), headers=headers)

    def enqueue_hang(self) -> None:
        """Script an answer that never comes (until the client disconnects)."""
        self._script.append(ScriptedResponse(hang=True))

    @property
    def pending(self) -> int:
        """Scripted answers not yet used."""
        return len(self._script)

    async def _completions(self, request: Request) -> Response:
        raw = await request.body()
        try:
            payload: Any = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        self.requests.append(
            RecordedRequest(request.method, request.url.path, dict(request.headers.items()), payload)
        )
        try:
            scripted = self._script.popleft()
        except IndexError:
            return JSONResponse(openai_error("FakeOpenAI: no scripted response left", type_="fake"), 500)
        if scripted.hang:
            await _wait_for_disconnect(request)
            return Response(status_code=499)  # nobody is listening any more
        if scripted.text is not None:
            return Response(scripted.text, scripted.status, headers=dict(scripted.headers))
        return JSONResponse(scripted.body, scripted.status, headers=dict(scripted.headers))


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the ASGI server's receive() only returns when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class FakeTelegram:
    """A fake Bot API: `POST /bot<token>/<method>` answers per method, `{"ok": true}` by default;
    getMe answers the bot `username` (the token's id, `is_bot`, privacy mode on)."""

    def __init__(self, token: str, username: str = "fake_gateway_bot") -> None:
        self.token = token
        self.requests: list[RecordedRequest] = []
        bot = {"id": int(token.partition(":")[0]), "is_bot": True, "first_name": "Fake", "username": username}
        self.results: dict[str, Any] = {"getMe": {**bot, "can_read_all_group_messages": False}}
        self.errors: dict[str, tuple[int, dict[str, Any]]] = {}
        # Method -> (status, whole body) answered once each, in order, before `errors` and `results`.
        self.answers_once: dict[str, deque[tuple[int, dict[str, Any]]]] = {}
        # Old chat id -> new: a call naming the old id (a group upgraded to a supergroup) gets 400
        # with `parameters.migrate_to_chat_id`, before any scripted error of the method.
        self.migrated: dict[str, int] = {}
        self.delay = 0.0  # seconds each call waits before its answer, as a far-away Bot API's
        self.in_flight = 0
        self.most_in_flight = 0  # calls waiting for their answer at once, at most
        self._answered = threading.Condition()

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/bot{token}/{method}", self._handle, methods=["POST"])])

    def wait_for_calls(self, method: str, count: int, timeout: float) -> bool:
        """Block (a test's thread) until `count` calls of `method` were answered; False after `timeout`."""
        with self._answered:
            return self._answered.wait_for(lambda: len(self.calls(method)) >= count, timeout)

    async def _handle(self, request: Request) -> Response:
        if self.delay:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.in_flight -= 1
        response = await self._answer(request)
        with self._answered:
            self._answered.notify_all()
        return response

    async def _answer(self, request: Request) -> Response:
        if request.path_params["token"] != self.token:
            return JSONResponse(
                {"ok": False, "error_code": 401, "description": "Unauthorized"}, status_code=401
            )
        method = request.path_params["method"]
        body = await request.json()
        self.requests.append(RecordedRequest("POST", method, dict(request.headers), body))
        if isinstance(body, dict) and str(body.get("chat_id")) in self.migrated:
            error = {
                "error_code": 400,
                "description": "Bad Request: group chat was upgraded to a supergroup chat",
                "parameters": {"migrate_to_chat_id": self.migrated[str(body.get("chat_id"))]},
            }
            return JSONResponse({"ok": False, **error}, status_code=400)
        once = self.answers_once.get(method)
        if once:
            status, answer = once.popleft()
            return JSONResponse(answer, status_code=status)
        if method in self.errors:
            status, error = self.errors[method]
            return JSONResponse({"ok": False, **error}, status_code=status)
        return JSONResponse({"ok": True, "result": self.results.get(method, True)})

    def calls(self, method: str) -> list[Any]:
        return [r.json for r in self.requests if r.path == method]


class FakeWhatsApp:
    """`POST /<phone_number_id>/messages`: answers a wamid (`{"success": true}` to a mark-as-read or
    typing-indicator body), or the scripted errors first."""

    def __init__(self) -> None:
        self.requests: list[RecordedRequest] = []
        self.errors: deque[tuple[int, dict[str, Any]]] = deque()

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{phone_number_id}/messages", self._handle, methods=["POST"])])

    async def _handle(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(RecordedRequest("POST", request.url.path, dict(request.headers), body))
        if self.errors:
            status, error = self.errors.popleft()
            return JSONResponse({"error": error}, status_code=status)
        if isinstance(body, dict) and body.get("status") == "read":
            return JSONResponse({"success": True})
        wamid = f"wamid.out{len(self.requests)}"
        return JSONResponse({"messaging_product": "whatsapp", "messages": [{"id": wamid}]})


class FakePlatform:
    """Any platform's API: every POST, whatever its path, is recorded and answered with the next
    scripted answer, or `default` when none is left. The contract tests script each platform's own
    answers (success, throttled, unavailable, refused) from its kit."""

    def __init__(self, default: ScriptedResponse) -> None:
        self.default = default
        self.answers: deque[ScriptedResponse] = deque()
        self.requests: list[RecordedRequest] = []

    @property
    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST"])])

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        payload: Any = json.loads(raw) if raw else None
        self.requests.append(RecordedRequest("POST", request.url.path, dict(request.headers), payload))
        answer = self.answers.popleft() if self.answers else self.default
        return JSONResponse(answer.body, answer.status, headers=dict(answer.headers))


def telegram_text_update(update_id: int, chat_id: int, text: str) -> dict[str, Any]:
    """A Telegram update carrying a private chat's text message (its id is the update's)."""
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "from": {"id": chat_id, "is_bot": False, "first_name": "Ann"},
            "chat": {"id": chat_id, "type": "private"},
            "date": 1767225600,
            "text": text,
        },
    }
