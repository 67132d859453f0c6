"""What a log line may carry, and how long it may be: the last processor before rendering, and the
renderer's guard. Set up by gateway/logs.py.

One walk over every event (`Sanitizer`) redacts and bounds it:

- secrets: every configured secret value, wherever it appears, and any field whose name says it holds
  one, become `***`;
- users: runs of 7 or more digits (phone numbers, Telegram chat ids) keep their last 4 digits, WhatsApp
  message ids (which encode the sender's phone) their last 6 characters, and name fields are `***`;
  hashed (GATEWAY_LOG_REDACT_USERS), user ids, session ids, phones and names become a keyed hash
  instead (`id_3f2a9c1b7e`), the same for one user on every line;
- text: fields named like message content (text, body, caption, ...) are replaced by their length;
- size: strings, the strings of an event together, lists and nesting are capped, with a marker where
  something was cut and `truncated: true` on the event. `BoundedRenderer` then guarantees the bound:
  a rendered line still over MAX_LINE_BYTES (JSON escaping can multiply a string by six) is rendered
  again in its short form.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from structlog.typing import EventDict, Processor

REDACTED = "***"
MAX_LINE_BYTES = 16 * 1024  # one rendered event (a console traceback included), in UTF-8 bytes
MAX_STRING_CHARS = 4096  # one string value
STRINGS_BUDGET_CHARS = 12 * 1024  # all strings of one event together
MAX_ITEMS = 40  # keys of a mapping, items of a list
MAX_DEPTH = 8  # nesting levels
TRUNCATED_KEY = "truncated"  # set on an event that lost something to the bounds

_SECRET_KEY = re.compile(r"(token|secret|password|passwd|signature|authorization|api_key|apikey)", re.I)
# Field names, compared in lower case. Session ids hold the user's id (a WhatsApp one is the phone).
_USER_ID_KEYS = frozenset(
    {
        *("session_id", "user_id", "chat_id", "new_chat_id", "old_chat_id", "from_user_id"),
        *("phone", "phone_number", "wa_id", "recipient", "from", "to"),
    }
)
_NAME_KEYS = frozenset(
    {"user_name", "username", "first_name", "last_name", "full_name", "display_name", "profile_name"}
)
_TEXT_KEYS = frozenset({"text", "body", "caption", "content", "message_text", "reply_text", "vcard"})
# A WhatsApp message id (base64 that spells the sender's phone), or 7+ digits not inside a word.
_IDENTIFIER = re.compile(r"wamid\.[A-Za-z0-9+/=_-]{8,}|(?<!\w)\+?\d{7,}(?!\w)")
_PLATFORM_PREFIX = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_CUT = "...[{} chars, cut]..."
_FIRST_KEYS = ("event", "level", "logger", "timestamp", "request_id", "exception")
# Set by the processors before this one (a level name, a logger's name, an ISO time): written as they are.
_OWN_KEYS = frozenset({"level", "logger", "timestamp"})


class UserIds:
    """How user identifiers look in logs: their last digits (default), or a keyed hash.

    The hash is HMAC-SHA256 under a key derived from the process's secrets, so the lines of one user
    correlate across restarts and replicas sharing the configuration, while nobody without those
    secrets can test candidate phone numbers against it (an unkeyed hash of a phone is brute-forced in
    minutes: there are only about 10^10 of them per country code). Without any secret the key is random,
    and hashes correlate within the process only.
    """

    def __init__(self, hashed: bool, secrets: Iterable[str] = ()) -> None:
        self.hashed = hashed
        material = sorted({s.encode("utf-8", "surrogatepass") for s in secrets if s})
        self._key = (
            hashlib.sha256(b"chatflow-gateway log ids\x00" + b"\x00".join(material)).digest()
            if material
            else os.urandom(32)
        )

    def digest(self, value: str) -> str:
        mac = hmac.new(self._key, value.encode("utf-8", "surrogatepass"), hashlib.sha256)
        return f"id_{mac.hexdigest()[:10]}"

    def in_text(self, match: re.Match[str]) -> str:
        """One identifier found in free text."""
        found = match.group()
        if found.startswith("wamid."):
            return f"wamid.{self.digest(found)}" if self.hashed else f"wamid.{REDACTED}{found[-6:]}"
        digits = found.lstrip("+")
        return self.digest(digits) if self.hashed else f"{REDACTED}{digits[-4:]}"

    def field(self, value: str) -> str:
        """A user-id field's value, hashed: a session id keeps its platform prefix, each other part hashed."""
        prefix, colon, rest = value.partition(":")
        if colon and rest and _PLATFORM_PREFIX.fullmatch(prefix):
            return ":".join([prefix, *(self.digest(part.lstrip("+")) for part in rest.split(":"))])
        return self.digest(value.lstrip("+"))

    def name(self, value: str) -> str:
        return self.digest(value) if self.hashed else REDACTED


class Sanitizer:
    """The redaction and the bounds, in one walk of the event (see the module's docstring); last before
    the renderer."""

    def __init__(self, secrets: Iterable[str], users: UserIds, *, json: bool = True) -> None:
        """`json`: lines are JSON, which escapes control characters and all but ASCII (\\u00e9)."""
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)
        self.users = users
        # A string is cut to its head and tail, each redacted with this much more around the cut, so a
        # secret or a phone number that straddles the cut is still seen whole.
        self.margin = max((len(s) for s in self._secrets), default=0) + 32
        self._keys: dict[str, tuple[bool, str]] = {}
        self._json = json

    def weight(self, text: str) -> int:
        """The most bytes one of its characters takes in the line: 6 for JSON's escapes (\\u0000), 4 for
        UTF-8 outside ASCII; the strings' budget counts each character that many times."""
        if text.isascii():
            return 6 if self._json and not text.isprintable() else 1
        return 6 if self._json else 4

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> EventDict:
        walk = _Walk(self, STRINGS_BUDGET_CHARS)
        # The event's name, where it comes from and its traceback first, before other values take the
        # budget.
        first = {key: event_dict[key] for key in _FIRST_KEYS if key in event_dict}
        out = walk.mapping({**first, **event_dict} if first else event_dict, 0)
        if walk.cut:
            out[TRUNCATED_KEY] = True
        return out

    def key(self, key: Any) -> tuple[bool, str]:
        """Whether a field name is written as it is (a short identifier naming no secret; else it is
        redacted like a value), and its kind: secret, user, name, text or plain. Cached: names are few."""
        known = self._keys.get(key) if isinstance(key, str) else None
        if known is None:
            as_is = (
                isinstance(key, str)
                and len(key) <= 64
                and key.isidentifier()
                and not any(secret in key for secret in self._secrets)
            )
            lowered = str(key).lower()
            if _SECRET_KEY.search(lowered):
                kind = "secret"
            elif lowered in _USER_ID_KEYS:
                kind = "user"
            elif lowered in _NAME_KEYS:
                kind = "name"
            else:
                kind = "text" if lowered in _TEXT_KEYS else "plain"
            known = (as_is, kind)
            if isinstance(key, str) and len(self._keys) < 4096:
                self._keys[key] = known
        return known

    def redact(self, text: str) -> str:
        if len(text) < 4:
            return text  # too short for a secret or an identifier
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return _IDENTIFIER.sub(self.users.in_text, text)


class _Walk:
    """One event's walk: the characters it may still take (each string, and a few for each item), and
    whether anything was cut. Once they are spent, a mapping or a list ends with a marker."""

    def __init__(self, sanitizer: Sanitizer, budget: int) -> None:
        self.s = sanitizer
        self.left = budget
        self.cut = False

    def mapping(self, value: Mapping[Any, Any], depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for index, (key, item) in enumerate(value.items()):
            if index == MAX_ITEMS or (self.left <= 0 and index):
                out["..."] = f"{len(value) - index} more keys cut"
                self.cut = True
                break
            as_is, kind = self.s.key(key)
            name = key if as_is else self.string(str(key), 64)
            self.left -= len(name) + 4
            if kind != "plain":
                out[name] = self.field(kind, item, depth + 1)
            elif type(item) is str:  # the common cases first: an event is walked on every log call
                own = depth == 0 and name in _OWN_KEYS and len(item) <= 64
                out[name] = item if own else self.string(item, MAX_STRING_CHARS)
            elif _plain_number(item):
                out[name] = item
            else:
                out[name] = self.value(item, depth + 1)
        return out

    def sequence(self, items: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        out = []
        for index, item in enumerate(items):
            if index == MAX_ITEMS or (self.left <= 0 and index):
                out.append(f"...[{len(items) - index} more items cut]")
                self.cut = True
                break
            self.left -= 2
            out.append(self.value(item, depth + 1))
        return out

    def field(self, kind: str, value: Any, depth: int) -> Any:
        if kind == "plain" or value is None or isinstance(value, bool):
            return self.value(value, depth)
        if kind == "secret":
            return REDACTED
        if kind == "text":
            return f"[{len(value)} chars]" if isinstance(value, str) else "[not logged]"
        if not isinstance(value, str | int):
            return self.value(value, depth)
        users = self.s.users
        if kind == "user" and not users.hashed:
            return self.string(str(value), MAX_STRING_CHARS)
        text = str(value)[:256]
        return users.field(text) if kind == "user" else users.name(text)

    def value(self, value: Any, depth: int) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return self.string(value, MAX_STRING_CHARS)
        if isinstance(value, int):
            # Python will not print an int of over 4,300 digits, and nobody can read one.
            return int(value) if value.bit_length() <= 64 else f"<int of {value.bit_length()} bits>"
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)  # NaN is not JSON
        if isinstance(value, bytes | bytearray | memoryview):
            return f"<{len(value)} bytes>"  # a payload: never its content
        if depth >= MAX_DEPTH and isinstance(value, Mapping | list | tuple | set | frozenset):
            self.cut = True
            return f"...[nested over {MAX_DEPTH} levels, cut]"
        if isinstance(value, Mapping):
            return self.mapping(value, depth)
        if isinstance(value, list | tuple):
            return self.sequence(value, depth)
        if isinstance(value, set | frozenset):
            return self.sequence(list(value), depth)
        try:
            text = repr(value)
        except Exception:
            text = f"<{type(value).__name__}>"
        return self.string(text, MAX_STRING_CHARS)

    def string(self, text: str, limit: int) -> str:
        """`text` redacted, in at most `limit` characters or what is left of the event's budget: its
        head and tail around a marker saying how long it was."""
        size = len(text)
        weight = self.s.weight(text)
        limit = min(limit, max(self.left // weight, 64))
        margin = self.s.margin
        if size > limit + 2 * margin:  # only what can be kept is redacted (a 40 MB string is not)
            text = text[: limit + margin] + "\n" + text[-(limit + margin) :]
        text = self.s.redact(text)
        if len(text) > limit:
            self.cut = True
            head = limit * 3 // 4
            text = text[:head] + _CUT.format(size) + text[len(text) - (limit - head) :]
        self.left -= len(text) * weight
        return text


def _plain_number(value: Any) -> bool:
    """An int or a float (not a subclass) that JSON writes as it is."""
    if type(value) is int:
        return -(2**63) <= value < 2**64
    return type(value) is float and math.isfinite(value)


class BoundedRenderer:
    """The renderer, and the guarantee: a line over MAX_LINE_BYTES (escaping can multiply a string's
    size by six) is rendered again in its short form, the first scalar fields, each cut short."""

    def __init__(self, render: Processor) -> None:
        self._render = render

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> str:
        for fields in (None, 12, 4):
            attempt = dict(event_dict) if fields is None else _short(event_dict, fields, 100)
            try:
                line = self._render(logger, method, attempt)
            except Exception:  # a value the renderer refused: try the shorter form
                continue
            if isinstance(line, str) and _fits(line):
                return line
        return '{"event": "log_line_dropped", "truncated": true}'


def _fits(line: str) -> bool:
    # At most 6 bytes per character (a lone surrogate written as \udc80); measured only near the bound.
    return len(line) * 6 <= MAX_LINE_BYTES or len(line.encode("utf-8", "backslashreplace")) <= MAX_LINE_BYTES


def _short(event_dict: EventDict, fields: int, chars: int) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in event_dict.items():
        if len(kept) == fields:
            break
        if isinstance(value, str):
            kept[str(key)[:40]] = value[:chars]
        elif value is None or isinstance(value, bool | int | float):
            kept[str(key)[:40]] = value
    kept[TRUNCATED_KEY] = f"line over {MAX_LINE_BYTES} bytes: only its first fields are kept"
    return kept
