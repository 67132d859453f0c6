"""Function tools: a Python function a model can call, its JSON schema, and running one tool call.

`@tool` reads the signature and a Google-style docstring so a tool is written once, as plain Python.
Pydantic builds the schema and validates (and, in lax mode, coerces) a model's arguments against the
same signature, so the schema the model reads and the checks its arguments meet cannot drift apart.
`execute_tool_call` turns every outcome, failures included, into a TOOL message the model can act on:
a bad tool call is the model's mistake to correct, not a reason to lose the turn.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, overload

import pydantic
import pydantic_core
import structlog

from gateway.domain.messages import Message, Role, ToolCall

__all__ = ["Tool", "ToolArgumentsError", "execute_tool_call", "tool"]

_log = structlog.get_logger(__name__)

# What OpenAI-compatible providers accept as a function name; anything else fails the whole request.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolArgumentsError(ValueError):
    """A model's arguments do not fit a tool's schema; the message names each bad argument.

    A tool may raise it itself to report an argument it cannot accept, with the same effect.
    """


class Tool:
    """A callable a model may request by name, with the JSON schema of its (keyword) arguments.

    Built by `@tool` from a function, or explicitly with a hand-written schema. An explicit tool's
    arguments are checked against that schema's `required`, `properties` (top-level `type` only) and
    `additionalProperties: false`, without coercion. Immutable once built.
    """

    __slots__ = ("description", "function", "name", "parameters")

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any]

    def __init__(
        self, name: str, description: str, parameters: Mapping[str, Any], function: Callable[..., Any]
    ) -> None:
        if not _NAME.match(name):
            raise ValueError(f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'")
        if not callable(function):
            raise TypeError(f"tool {name!r}: function must be callable, got {function!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "parameters", copy.deepcopy(dict(parameters)))
        object.__setattr__(self, "function", function)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Tool is immutable; cannot set {key!r}")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Tool is immutable; cannot delete {key!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function directly, so a decorated function still works as plain Python."""
        return self.function(*args, **kwargs)

    async def invoke(self, arguments: Mapping[str, Any]) -> Any:
        """Validate a model's arguments, then run the function without blocking the event loop.

        Async functions are awaited; sync ones run in a worker thread (`asyncio.to_thread`, which
        carries the context variables, so bound log fields follow). Raises `ToolArgumentsError`.
        """
        if not isinstance(arguments, Mapping):
            raise ToolArgumentsError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        kwargs = self._coerce(arguments)
        if _is_async_callable(self.function):
            result = self.function(**kwargs)
        else:
            result = await asyncio.to_thread(self.function, **kwargs)
        if inspect.isawaitable(result):  # e.g. a plain lambda around a coroutine function
            result = await result
        return result

    def openai_schema(self) -> dict[str, Any]:
        """The tool as OpenAI-compatible chat APIs take it in their `tools` list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def _coerce(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check arguments against a hand-written schema; return the keyword arguments to call with."""
        properties: Mapping[str, Any] = self.parameters.get("properties") or {}
        problems = [
            f"{key}: missing required argument"
            for key in self.parameters.get("required") or ()
            if key not in arguments
        ]
        for key, value in arguments.items():
            if key not in properties:
                if self.parameters.get("additionalProperties", True) is False:
                    problems.append(f"{key}: {_unexpected(properties)}")
                continue
            expected = properties[key].get("type") if isinstance(properties[key], Mapping) else None
            if expected is not None and not _has_json_type(value, expected):
                wanted = " or ".join(expected) if isinstance(expected, list) else expected
                problems.append(f"{key}: expected {wanted}, got {_json_type_name(value)}")
        if problems:
            raise ToolArgumentsError("; ".join(problems))
        return dict(arguments)


class _SignatureTool(Tool):
    """A tool built by `@tool`: a pydantic model of the signature validates and coerces arguments."""

    __slots__ = ("_model",)

    _model: type[pydantic.BaseModel]

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any],
        function: Callable[..., Any],
        model: type[pydantic.BaseModel],
    ) -> None:
        super().__init__(name, description, parameters, function)
        object.__setattr__(self, "_model", model)

    def _coerce(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        try:
            validated = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            raise ToolArgumentsError(_describe(exc, self.parameters.get("properties") or {})) from None
        fields = type(validated).model_fields
        # Only what the model sent: the function's own defaults apply to the rest, as in a plain call.
        return {
            fields[field].alias or field: getattr(validated, field) for field in validated.model_fields_set
        }


@overload
def tool(fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool: ...


@overload
def tool(
    fn: None = None, *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a sync or async function a `Tool`; use bare (`@tool`) or with overrides (`@tool(name=...)`).

    The schema comes from the type hints (no hint means any JSON value) and the defaults (a parameter
    with a default is optional); descriptions come from the docstring: the text before its first
    Google-style section is the tool's, and each `Args:` entry is its parameter's. Raises TypeError for
    `*args`, `**kwargs` or positional-only parameters, which a model's keyword arguments cannot fill.
    """

    def build(function: Callable[..., Any]) -> Tool:
        return _build(function, name=name, description=description)

    return build if fn is None else build(fn)


async def execute_tool_call(
    tools: Mapping[str, Tool], call: ToolCall, *, agent_name: str | None = None
) -> Message:
    """Run one tool call and answer it with a TOOL message; never raises but for cancellation.

    The content is the result as text: a str as is, anything else (None included, as "null") as JSON.
    A failure is a text starting with "Error:" that says what went wrong, so the model can correct
    its call or tell the user, and the turn goes on.
    """
    found = tools.get(call.name)
    if found is None:
        available = ", ".join(sorted(tools)) or "none"
        content = f"Error: unknown tool {call.name!r}; available tools: {available}"
        _log.warning(
            "tool_failed", tool=call.name, call_id=call.id, agent=agent_name, error_type="unknown_tool"
        )
        return _tool_message(call, content, agent_name)
    try:
        content = _render(await found.invoke(call.arguments))
    except ToolArgumentsError as exc:
        content = f"Error: invalid arguments for {call.name}: {exc}"
        _log.warning(
            "tool_failed", tool=call.name, call_id=call.id, agent=agent_name, error_type="invalid_arguments"
        )
    except Exception as exc:  # asyncio.CancelledError is a BaseException: it propagates, as it must
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        content = f"Error: {call.name} failed: {detail}"
        _log.error(
            "tool_failed", tool=call.name, call_id=call.id, agent=agent_name, error_type=type(exc).__name__
        )
        # The exception's message may quote the arguments' values, so it is logged below INFO only.
        _log.debug("tool_traceback", tool=call.name, call_id=call.id, exc_info=exc)
    return _tool_message(call, content, agent_name)


def _tool_message(call: ToolCall, content: str, agent_name: str | None) -> Message:
    return Message(
        role=Role.TOOL, content=content, tool_call_id=call.id, name=call.name, agent_name=agent_name
    )


def _render(result: Any) -> str:
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=_jsonable)


def _jsonable(value: Any) -> Any:
    """Pydantic models, dataclasses, datetimes, enums and sets as JSON; anything else as its str()."""
    try:
        return pydantic_core.to_jsonable_python(value)
    except pydantic_core.PydanticSerializationError:
        return str(value)


def _build(function: Callable[..., Any], *, name: str | None, description: str | None) -> Tool:
    tool_name = name or str(getattr(function, "__name__", ""))
    summary, arg_docs = _parse_docstring(inspect.getdoc(function) or "")
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except NameError as exc:
        raise TypeError(f"tool {tool_name!r}: cannot resolve a type hint: {exc}") from exc
    fields: dict[str, Any] = {}
    for index, param in enumerate(inspect.signature(function).parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(
                f"tool {tool_name!r}: parameter {param.name!r} is {param.kind.description}; "
                "a tool's parameters must be passable by keyword"
            )
        default = pydantic_core.PydanticUndefined if param.default is param.empty else param.default
        # Internal field names with the parameter as alias: a parameter may then be called `json`,
        # `model_config` or `_x` without clashing with BaseModel's own attributes.
        fields[f"p{index}"] = (
            hints.get(param.name, Any),
            pydantic.Field(default, alias=param.name, description=arg_docs.get(param.name)),
        )
    model = pydantic.create_model(
        f"{tool_name or 'tool'}_arguments",
        __config__=pydantic.ConfigDict(extra="forbid"),  # validated by alias only (the default)
        **fields,
    )
    return _SignatureTool(
        tool_name,
        summary if description is None else description,
        _parameters_schema(model),
        function,
        model,
    )


def _parameters_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """The model's JSON schema in the plain shape providers expect: no titles, `required` always."""
    schema = _strip_titles(model.model_json_schema(by_alias=True))
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": schema.get("properties", {}),
        "required": schema.get("required", []),
        "additionalProperties": False,
    }
    if "$defs" in schema:  # only for richer types (enums, models); the simple ones inline
        parameters["$defs"] = schema["$defs"]
    return parameters


_NAMED_SUBSCHEMAS = frozenset({"properties", "patternProperties", "$defs"})
_DATA_KEYWORDS = frozenset({"default", "enum", "const", "examples"})


def _strip_titles(node: Any) -> Any:
    """Drop pydantic's "title" keywords, but not a property named "title" nor data that holds one."""
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    cleaned: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key in _DATA_KEYWORDS:
            cleaned[key] = value
        elif key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            cleaned[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        else:
            cleaned[key] = _strip_titles(value)
    return cleaned


_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Returns?|"
    r"Yields?|Raises|Examples?|Notes?|Warnings?|See Also|Todo|Attributes|References)\s*:\s*$",
    re.IGNORECASE,
)
_ARG_SECTIONS = frozenset({"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"})
_ARG = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a cleaned Google-style docstring into its leading text and its `Args:` descriptions."""
    summary: list[str] = []
    args: dict[str, list[str]] = {}
    section: str | None = None
    current: list[str] | None = None
    arg_indent: int | None = None
    for line in doc.splitlines():
        header = _SECTION.match(line)
        if header:
            section, current, arg_indent = header.group(1).lower(), None, None
            continue
        if section is None:
            summary.append(line)
            continue
        if section not in _ARG_SECTIONS or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if arg_indent is None:
            arg_indent = indent
        entry = _ARG.match(line.strip()) if indent == arg_indent else None
        if entry:
            current = args.setdefault(entry.group("name"), [])
            current.append(entry.group("text").strip())
        elif indent > arg_indent and current is not None:
            current.append(line.strip())
        elif indent < arg_indent:
            section, current = "other", None  # text outdented past the entries ends the section
    descriptions = {key: " ".join(part for part in parts if part) for key, parts in args.items()}
    return "\n".join(summary).strip(), {key: text for key, text in descriptions.items() if text}


def _describe(error: pydantic.ValidationError, properties: Mapping[str, Any]) -> str:
    """One short line per problem, naming the argument, for a model to read and fix its call."""
    problems = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in item["loc"])
        if item["type"] == "missing":
            text = "missing required argument"
        elif item["type"] == "extra_forbidden" and len(item["loc"]) == 1:
            text = _unexpected(properties)
        else:
            text = item["msg"]
        problems.append(f"{where}: {text}" if where else text)
    return "; ".join(problems)


def _unexpected(properties: Mapping[str, Any]) -> str:
    return f"unexpected argument (known: {', '.join(properties) or 'none'})"


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list | tuple),
    "object": lambda v: isinstance(v, Mapping),
    "null": lambda v: v is None,
}


def _has_json_type(value: Any, expected: str | list[str]) -> bool:
    names = [expected] if isinstance(expected, str) else expected
    # A type this check does not know is not held against the value.
    return any(_JSON_TYPES.get(name, lambda _: True)(value) for name in names)


def _json_type_name(value: Any) -> str:
    return next((name for name, check in _JSON_TYPES.items() if check(value)), type(value).__name__)


def _is_async_callable(function: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )
