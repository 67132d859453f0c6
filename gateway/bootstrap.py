"""The composition root: the one place that turns settings into engines, clients and services."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

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
