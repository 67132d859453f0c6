"""Alembic environment: async engines, batch mode on SQLite, one lock per upgrade on PostgreSQL.

`gateway db …` hands over a live connection in ``config.attributes["connection"]``; plain
`alembic …` builds an engine from the gateway's settings.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from sqlalchemy import Connection, text

from gateway.settings import load_settings
from gateway.store.engine import SQLITE_IMMEDIATE, create_engine
from gateway.store.migrations import MIGRATION_LOCK_KEY
from gateway.store.tables import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def render_item(kind: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Write the gateway's UTCDateTime as a plain DateTime, so migrations never import the models."""
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def do_run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        render_item=render_item,
        transactional_ddl=True,
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas starting together queue here; each then sees the version the previous one left.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def run_async_migrations() -> None:
    engine = create_engine(load_settings().database_url)
    try:
        async with engine.connect() as conn:
            await conn.execution_options(**{SQLITE_IMMEDIATE: True})
            await conn.run_sync(do_run_migrations)
            await conn.commit()
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(
        url=load_settings().database_url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
elif (shared := config.attributes.get("connection")) is not None:
    do_run_migrations(shared)
else:
    if config.config_file_name is not None:
        fileConfig(config.config_file_name)
    asyncio.run(run_async_migrations())
