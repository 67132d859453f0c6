"""docs/platforms.md's tables are generated here, from the adapters' own tables of update types and
content fields, each row's behaviour taken from a real payload parsed by the real adapter; the test
fails when the document and the adapters part. `GATEWAY_DOCS_WRITE=1 pytest tests/test_platform_docs.py`
rewrites the tables (the prose around them is kept).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, cast

from gateway.domain.inbound import DEFAULT_TURN_KINDS, MessageKind, ParsedUpdate, agent_text, starts_turn
from gateway.platforms.base import PlatformAdapter
from gateway.platforms.telegram.adapter import (
    CONTENT_FIELDS,
    SERVICE_FIELDS,
    UNSUPPORTED_CONTENT,
    UPDATE_TYPES,
    TelegramAdapter,
)
from gateway.platforms.whatsapp.adapter import MESSAGE_TYPES, WhatsAppAdapter
from tests.helpers import REPO_ROOT

DOC = REPO_ROOT / "docs" / "platforms.md"
PAYLOADS = REPO_ROOT / "tests" / "payloads"
WRITE = os.environ.get("GATEWAY_DOCS_WRITE") == "1"
BOT_USERNAME = "foo_bot"  # the bot of the corpus's Telegram fixtures
TEXT_CHARS = 60
# Documented WhatsApp message types the adapter does not read (docs/platform-specs.md 1.2).
WHATSAPP_UNREAD_TYPES = ("unsupported", "edit", "revoke", "request_welcome")
WHATSAPP_INTERACTIVE = ("button_reply", "list_reply", "nfm_reply", "call_permission_reply")
WHATSAPP_STATUSES = ("sent", "delivered", "read", "played", "failed")

Row = tuple[str, ...]


def payloads(platform: str) -> Iterator[tuple[str, Any]]:
    """The corpus from the wild first, then the gateway's own fixtures."""
    for folder in (PAYLOADS / "corpus" / platform, PAYLOADS / platform):
        for path in sorted(folder.rglob("*.json")):
            yield path.relative_to(PAYLOADS).as_posix(), json.loads(path.read_bytes())


def outcome(parsed: ParsedUpdate) -> tuple[str, str, str]:
    """(what the gateway does, the kind, what the agent reads) for a parsed example."""
    if parsed.messages:
        message = parsed.messages[0]
        action = "turn" if starts_turn(message) else "recorded"
        return action, f"`{message.kind.value}`", cell(agent_text(message))
    if parsed.statuses:
        return "status of a reply", "—", "—"
    if parsed.memberships:
        return "bot's membership", "—", "—"
    return "ignored", "—", "—"


def cell(text: str) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else "(empty)"


def example_row(
    name: str, platform: str, adapter: PlatformAdapter, matches: Callable[..., bool], fallback: Row
) -> Row:
    # `matches` is called with a payload. Typed `Callable[..., bool]`, not `Callable[[Any], bool]`: mypy
    # cannot infer a lambda binding a loop value as a default (`lambda p, u=update: ...`) against the latter.
    for path, payload in payloads(platform):
        if matches(payload):
            return (f"`{name}`", *outcome(adapter.parse(payload)), f"`{path}`")
    return (f"`{name}`", *fallback, "—")


def table(header: Row, rows: list[Row]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


HEADER = ("", "gateway", "kind", "the agent reads", "example")


# --- Telegram ----------------------------------------------------------------------------------------

TELEGRAM = TelegramAdapter("docs", "807", BOT_USERNAME)


def _message(payload: Any) -> dict[str, Any]:
    message = payload.get("message") if isinstance(payload, dict) else None
    return message if isinstance(message, dict) else {}


def telegram_updates() -> str:
    rows = [
        example_row(
            update,
            "telegram",
            TELEGRAM,
            # A plain text shows the message update best; the content table below has every other field.
            lambda p, u=update: isinstance(p, dict) and u in p and (u != "message" or "text" in _message(p)),
            ("ignored" if handling == "ignored" else "no example", "—", "—"),
        )
        for update, handling in UPDATE_TYPES.items()
    ]
    return table(("update", *HEADER[1:]), rows)


def telegram_content() -> str:
    """Per content field of a message (a private chat's: in groups only messages to the bot are turns)."""
    fields: dict[str, MessageKind] = {
        **CONTENT_FIELDS,
        **dict.fromkeys(SERVICE_FIELDS, MessageKind.SYSTEM),
        **dict.fromkeys(UNSUPPORTED_CONTENT, MessageKind.UNSUPPORTED),
    }
    rows = []
    for field, kind in fields.items():

        def matches(payload: Any, field: str = field, kind: MessageKind = kind) -> bool:
            message = _message(payload)
            if field not in message or message.get("chat", {}).get("type") != "private":
                return False
            parsed = TELEGRAM.parse(payload).messages
            return bool(parsed) and parsed[0].kind is kind

        default = "turn" if kind in DEFAULT_TURN_KINDS else "recorded"
        rows.append(example_row(field, "telegram", TELEGRAM, matches, (default, f"`{kind.value}`", "—")))
    return table(("message field", *HEADER[1:]), rows)


# --- WhatsApp ----------------------------------------------------------------------------------------

WHATSAPP = WhatsAppAdapter("docs")


def _values(payload: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    for entry in payload.get("entry", []) if isinstance(payload, dict) else []:
        for change in entry.get("changes", []):
            yield change.get("field"), change.get("value") or {}


def _first_message(payload: Any) -> dict[str, Any]:
    for field, value in _values(payload):
        if field == "messages" and value.get("messages"):
            message: dict[str, Any] = value["messages"][0]
            return message
    return {}


def whatsapp_messages() -> str:
    rows = []
    for type_ in (*MESSAGE_TYPES, *WHATSAPP_UNREAD_TYPES):
        if type_ == "interactive":
            for reply in WHATSAPP_INTERACTIVE:
                rows.append(
                    example_row(
                        f"interactive.{reply}",
                        "whatsapp",
                        WHATSAPP,
                        lambda p, r=reply: _first_message(p).get("interactive", {}).get("type") == r,
                        ("no example", "—", "—"),
                    )
                )
            continue
        rows.append(
            example_row(
                type_,
                "whatsapp",
                WHATSAPP,
                lambda p, t=type_: _first_message(p).get("type") == t,
                ("recorded", "`unsupported`", "`[unsupported]`"),
            )
        )
    return table(("message type", *HEADER[1:]), rows)


def whatsapp_other() -> str:
    """Statuses of the gateway's own replies, and the change fields besides `messages`."""
    rows = [
        example_row(
            f"statuses: {status}",
            "whatsapp",
            WHATSAPP,
            lambda p, s=status: any(
                f == "messages" and (v.get("statuses") or [{}])[0].get("status") == s for f, v in _values(p)
            ),
            ("status of a reply", "—", "—"),
        )
        for status in WHATSAPP_STATUSES
    ]
    rows.append(
        example_row(
            "errors (alone)",
            "whatsapp",
            WHATSAPP,
            lambda p: any(
                f == "messages" and set(v) >= {"errors"} and not v.get("messages") for f, v in _values(p)
            ),
            ("ignored (logged)", "—", "—"),
        )
    )
    fields = sorted({f for _, p in payloads("whatsapp") for f, _ in _values(p) if f != "messages" and f})
    rows += [
        example_row(
            field,
            "whatsapp",
            WHATSAPP,
            lambda p, f=field: any(g == f for g, _ in _values(p)),
            ("ignored",) * 3,
        )
        for field in fields
    ]
    return table(("notification", *HEADER[1:]), rows)


TABLES: dict[str, Callable[[], str]] = {
    "telegram-updates": telegram_updates,
    "telegram-content": telegram_content,
    "whatsapp-messages": whatsapp_messages,
    "whatsapp-other": whatsapp_other,
}


def _section(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(\n<!-- end: {name} -->)", re.S)


def test_the_document_matches_what_the_adapters_do() -> None:
    document = DOC.read_text(encoding="utf-8")
    stale = []
    for name, render in TABLES.items():
        found = _section(name).search(document)
        assert found, f"docs/platforms.md has no generated section {name!r}"
        rendered = render()
        if found.group(2) != rendered:
            stale.append(name)
            document = _section(name).sub(
                cast(Callable[[re.Match[str]], str], lambda m, r=rendered: m.group(1) + r + m.group(3)),
                document,
            )
    if WRITE:
        DOC.write_text(document, encoding="utf-8")
        return
    assert not stale, f"docs/platforms.md is out of date ({stale}): GATEWAY_DOCS_WRITE=1 pytest {__file__}"


def test_every_update_type_and_field_of_the_adapters_has_a_row() -> None:
    document = DOC.read_text(encoding="utf-8")
    names = [
        *UPDATE_TYPES,
        *CONTENT_FIELDS,
        *SERVICE_FIELDS,
        *UNSUPPORTED_CONTENT,
        *(t for t in MESSAGE_TYPES if t != "interactive"),
        *(f"interactive.{r}" for r in WHATSAPP_INTERACTIVE),
        *WHATSAPP_UNREAD_TYPES,
    ]
    missing = [name for name in names if f"| `{name}` |" not in document]
    assert not missing, missing


def test_rows_with_examples_are_the_majority() -> None:
    """The tables are evidence, not claims: most rows show a real payload's outcome."""
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("| `")]
    with_example = [row for row in rows if row.rstrip(" |").endswith(".json`")]
    assert len(with_example) * 4 >= len(rows) * 3, (len(with_example), len(rows))
