"""The embedded offline model: deterministic rules instead of an LLM, so everything works with no network.

Each rule maps a regular expression on the last user message to a reply, a tool call (arguments
from the pattern's named groups) or a handoff. After tool results come back, the rule that asked
for the tool composes the reply from them (its template may use ``{result}``, ``{result[key]}``
and the pattern's groups).

Rules read at most the first MAX_SCAN_CHARS characters of the message: a rule's regex runs on the
event loop, and however linear its pattern, a long crafted message must not cost more than a
platform's longest text (4,096 characters on WhatsApp and Telegram).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.agents.agent import HANDOFF_PREFIX, handoff_tool_name
from gateway.agents.models.base import ToolSpec
from gateway.domain.messages import Message, Role, ToolCall

if TYPE_CHECKING:
    from gateway.agents.agent import Agent

DEFAULT_FALLBACK = "I'm not sure I understood. Could you rephrase that?"
MAX_SCAN_CHARS = 4096


@dataclass(frozen=True)
class Rule:
    """`pattern` (case-insensitive regex, searched) -> `reply`, a `tool` call, or a `handoff` to an agent."""

    pattern: str
    reply: str | None = None
    tool: str | None = None
    arguments: Mapping[str, Any] | None = None
    handoff: str | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.tool, self.handoff)) > 1:
            raise ValueError("a rule calls a tool or hands off, not both")
        if self.reply is None and self.tool is None and self.handoff is None:
            raise ValueError("a rule needs a reply, a tool or a handoff")
        object.__setattr__(self, "regex", re.compile(self.pattern, re.IGNORECASE | re.DOTALL))

    def tool_arguments(self, match: re.Match[str]) -> dict[str, Any]:
        if self.arguments is None:
            return {k: v for k, v in match.groupdict().items() if v is not None}
        return {k: _fill(v, match) if isinstance(v, str) else v for k, v in self.arguments.items()}


RuleLike = Rule | Mapping[str, Any] | tuple[str, str]


def _as_rule(rule: RuleLike) -> Rule:
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, Mapping):
        return Rule(**rule)
    if isinstance(rule, tuple) and len(rule) == 2:
        return Rule(rule[0], reply=rule[1])
    raise TypeError(f"not a rule: {rule!r} (use Rule(...), a dict of its fields, or (pattern, reply))")


def _fill(template: str, match: re.Match[str], **extra: Any) -> str:
    groups = {k: v or "" for k, v in match.groupdict().items()}
    try:
        return template.format(*(g or "" for g in match.groups()), **groups, **extra)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError):
        return template


# What a ScriptedModel without rules of its own says: small talk, and an honest fallback.
GENERIC_RULES = (
    Rule(r"^\W*(hi|hello|hey|good (morning|afternoon|evening))\b", reply="Hello! How can I help you today?"),
    Rule(r"\b(thanks|thank you|cheers)\b", reply="You're welcome! Anything else I can do?"),
    Rule(r"\b(bye|goodbye|see you)\b", reply="Goodbye, and have a nice day!"),
)


class ScriptedModel:
    """Deterministic rules in order; the first that fits the last user message answers."""

    def __init__(
        self,
        rules: Iterable[RuleLike] | Mapping[str, str] | None = None,
        fallback: str = DEFAULT_FALLBACK,
    ) -> None:
        """`rules`: Rule objects, dicts of Rule fields, (pattern, reply) pairs, or a {pattern: reply} dict."""
        if rules is None:
            rules = GENERIC_RULES
        elif isinstance(rules, Mapping):
            rules = list(rules.items())
        self.rules = [_as_rule(rule) for rule in rules]
        self.fallback = fallback

    def __repr__(self) -> str:
        return f"ScriptedModel(rules={len(self.rules)})"

    spec = "scripted"  # how usage and metrics name it

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        user_text, since_user = _last_user_turn(history)
        available = {t.name for t in tools}
        results = _trailing_tool_results(since_user)
        if results and not all(r.name and r.name.startswith(HANDOFF_PREFIX) for r in results):
            return _say(agent, self._compose(user_text, results))
        handed_off = any(
            m.role is Role.TOOL and (m.name or "").startswith(HANDOFF_PREFIX) for m in since_user
        )
        call_id = _call_id_maker(history)
        for rule in self.rules:
            match = rule.regex.search(user_text)
            if match is None:
                continue
            if rule.handoff is not None:
                tool_name = handoff_tool_name(rule.handoff)
                if handed_off or tool_name not in available:
                    continue  # never hand back and forth within one turn
                return _call(agent, ToolCall(call_id, tool_name, {}))
            if rule.tool is not None:
                if rule.tool not in available:
                    continue
                call = ToolCall(call_id, rule.tool, rule.tool_arguments(match))
                return _call(agent, call)
            assert rule.reply is not None
            return _say(agent, _fill(rule.reply, match))
        return _say(agent, self.fallback)

    def _compose(self, user_text: str, results: list[Message]) -> str:
        """Turn tool results into a reply, through the template of the rule that called the tool."""
        replies = []
        for result in results:
            content = result.content or ""
            if content.startswith("Error:"):
                replies.append(f"Sorry, I couldn't do that: {content.removeprefix('Error:').strip()}")
                continue
            parsed = _parse(content)
            template = next(
                (
                    (rule, m)
                    for rule in self.rules
                    if rule.tool == result.name and rule.reply and (m := rule.regex.search(user_text))
                ),
                None,
            )
            if template is None:
                replies.append(f"Here is what I found: {content}")
            else:
                rule, match = template
                assert rule.reply is not None
                replies.append(_fill(rule.reply, match, result=parsed))
        return "\n".join(replies)


def _call_id_maker(history: Sequence[Message]) -> str:
    """call_<n>, one past the highest number in the history: the same for the same history, and
    never one that a kept message already uses (counting calls would repeat ids after pruning)."""
    numbers = [
        int(match.group(1))
        for message in history
        for call in message.tool_calls
        if (match := re.fullmatch(r"call_(\d+)", call.id))
    ]
    return f"call_{max(numbers, default=0) + 1}"


def _last_user_turn(history: Sequence[Message]) -> tuple[str, list[Message]]:
    for index in range(len(history) - 1, -1, -1):
        if history[index].role is Role.USER:
            return (history[index].content or "")[:MAX_SCAN_CHARS], list(history[index + 1 :])
    return "", list(history)


def _trailing_tool_results(messages: list[Message]) -> list[Message]:
    results: list[Message] = []
    for message in reversed(messages):
        if message.role is not Role.TOOL:
            break
        results.append(message)
    return results[::-1]


def _parse(content: str) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content


def _say(agent: Agent, text: str) -> Message:
    return Message(role=Role.MODEL, content=text, agent_name=agent.name)


def _call(agent: Agent, call: ToolCall) -> Message:
    return Message(role=Role.MODEL, content=None, tool_calls=[call], agent_name=agent.name)
