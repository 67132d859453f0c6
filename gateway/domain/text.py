"""Text the platforms and the database accept: long replies split into messages (both platforms cap a
text message at 4,096 characters), strings without lone surrogates, and a model's text without NUL."""

from __future__ import annotations

import re
from typing import Any

MAX_MESSAGE_CHARS = 4096
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def split_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> list[str]:
    """Parts of at most `limit` characters, cut at paragraph breaks, else sentence ends, else spaces.

    Only a single word longer than `limit` is cut mid-word. Empty or blank text gives no parts.
    """
    text = text.strip()
    if not text:
        return []
    parts: list[str] = []
    while len(text) > limit:
        window = text[: limit + 1]
        cut = window.rfind("\n\n")
        if cut <= 0:
            ends = [m.start() for m in _SENTENCE_END.finditer(window) if m.start() <= limit]
            cut = ends[-1] if ends else window.rfind(" ")
        if cut <= 0:
            cut = limit
        parts.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    parts.append(text)
    return parts


def without_lone_surrogates(value: Any) -> Any:
    """`value` (parsed JSON) with every lone surrogate replaced by U+FFFD.

    JSON may escape half of a UTF-16 pair ("\\ud83d"); json.loads keeps it as is, and no UTF-8
    database or platform API can store or send such a string. A valid pair is already one character.
    """
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(item) for item in value]
    return value


def sendable(text: str | None) -> str | None:
    """A model's text as the platforms and every database take it: without NUL characters (PostgreSQL
    text cannot hold one: the turn's commit failed at every retry) and with lone surrogates replaced
    by U+FFFD (not UTF-8 at all: neither SQLite nor a platform's API takes one)."""
    if text is None:
        return None
    if "\x00" in text:
        text = text.replace("\x00", "")
    return _LONE_SURROGATE.sub("\ufffd", text)
