"""Splitting long replies into messages a platform accepts (both cap a text message at 4,096 characters)."""

from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 4096
_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+")


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
