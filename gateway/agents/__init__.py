"""Agents with tools and handoffs, models, the runner, and durable session stores.

Usable on its own::

    from gateway.agents import Agent, Runner, SQLiteSessionStore, tool
"""

from gateway.agents.agent import Agent
from gateway.agents.context import Checkpoint, SessionContext, make_title
from gateway.agents.models.base import Model, ModelError, ToolSpec
from gateway.agents.models.openai_compat import OpenAIChatModel
from gateway.agents.models.scripted import Rule, ScriptedModel
from gateway.agents.runner import Runner, RunResult
from gateway.agents.stores.base import (
    DEFAULT_DEDUP_TTL_HOURS,
    BaseSessionStore,
    SessionDeletedError,
    SessionInfo,
)
from gateway.agents.stores.memory import SessionStore
from gateway.agents.stores.sql import SQLiteSessionStore, SQLSessionStore
from gateway.agents.tools import Tool, ToolArgumentsError, tool
from gateway.domain.messages import Message, Role, ToolCall

__all__ = [
    "DEFAULT_DEDUP_TTL_HOURS",
    "Agent",
    "BaseSessionStore",
    "Checkpoint",
    "Message",
    "Model",
    "ModelError",
    "OpenAIChatModel",
    "Role",
    "Rule",
    "RunResult",
    "Runner",
    "SQLSessionStore",
    "SQLiteSessionStore",
    "ScriptedModel",
    "SessionContext",
    "SessionDeletedError",
    "SessionInfo",
    "SessionStore",
    "Tool",
    "ToolArgumentsError",
    "ToolCall",
    "ToolSpec",
    "make_title",
    "tool",
]
