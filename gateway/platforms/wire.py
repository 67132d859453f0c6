"""Numbers as the platforms' JSON carries them: one home for the rule every adapter reads them by.

Both APIs document numbers, but the wire is looser than the docs: WhatsApp writes timestamps as
strings, order quantities and prices have been seen as strings ("3", "12.5"), and proxies that
re-encode payloads turn ids into strings. So a number is a JSON number or a string spelling one in
JSON's own syntax; anything else (booleans, "1_000", " 3", "NaN", "Infinity") is not a number.
"""

from __future__ import annotations

import math
import re
from typing import Any

_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_DECIMAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def integer(value: Any) -> int | None:
    """An integer from a JSON integer or a string of one; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        try:
            return int(value)
        except ValueError:  # past Python's int-conversion digit limit
            return None
    return None


def number(value: Any) -> float | None:
    """A finite number from a JSON number or a string of one; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        parsed = float(value)
        return parsed if math.isfinite(parsed) else None
    return None


def written(value: Any) -> str | None:
    """A number as a person writes it (2, 9.99, 15 rather than 15.0), from either form; None otherwise."""
    exact = integer(value)
    if exact is not None:
        return str(exact)
    parsed = number(value)
    if parsed is None:
        return None
    return str(int(parsed)) if parsed.is_integer() and abs(parsed) < 2**53 else str(parsed)
