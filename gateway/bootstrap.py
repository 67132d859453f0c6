"""The composition root: the one place that turns settings into engines, clients and services."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.agents import Agent, Runner, SQLSessionStore
from gateway.agents.models.registry import model_factory_from_settings
from gateway.errors import SettingsError
from gateway.settings import Settings
from gateway.store.engine import create_engine


@dataclass(frozen=True)
class Services:
    """Everything long-lived that the app's lifespan owns and closes."""

    settings: Settings
    engine: AsyncEngine

    async def aclose(self) -> None:
        await self.engine.dispose()


def build_services(settings: Settings) -> Services:
    return Services(settings=settings, engine=create_engine(settings.database_url))


def load_agent(spec: str) -> Agent:
    """The starting agent named by GATEWAY_AGENT ("module:attribute"); SettingsError when it is not one."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(f"invalid setting GATEWAY_AGENT: cannot import {module_name!r}: {exc}") from None
    agent = getattr(module, attribute, None)
    if not isinstance(agent, Agent):
        found = "nothing" if agent is None else type(agent).__name__
        raise SettingsError(f"invalid setting GATEWAY_AGENT: {spec!r} is {found}, not an Agent")
    return agent


def build_runner(settings: Settings, engine: AsyncEngine) -> Runner:
    """The configured agent graph on an SQL session store sharing the service's engine."""
    store = SQLSessionStore(engine)
    return Runner(load_agent(settings.agent), store, model_factory=model_factory_from_settings(settings))
