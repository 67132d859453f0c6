"""Test helpers: free ports, an in-process uvicorn on real loopback HTTP, the real CLI process, polling,
and PostgreSQL databases for fixtures wider than one test."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
import uvicorn
from hypothesis import strategies as st
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.types import ASGIApp

from gateway.platforms.registry import settings_groups
from gateway.settings import Settings, settings_from

REPO_ROOT = Path(__file__).resolve().parents[1]
GATEWAY = str(Path(sys.executable).with_name("gateway"))
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve_in_thread(app: ASGIApp) -> Iterator[str]:
    """Serve `app` on a loopback port in a background thread; yield its base URL.

    The socket is bound and listening before the thread starts, so a request sent at once waits
    in the backlog until the app has finished its start-up: no polling, no sleeps.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


def gateway_settings(**values: Any) -> Settings:
    """Settings as a config file with these keys would give them: the platforms' keys included
    (`telegram_secret_token=...` is the Telegram group's `secret_token`)."""
    return settings_from(values, settings_groups())


def gateway_env(**settings: str) -> dict[str, str]:
    """The current environment without GATEWAY_* settings, plus the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GATEWAY_")}
    env.update(settings)
    return env


def wait_until(
    condition: Callable[[], T | Literal[False] | None], what: str, timeout: float = 60, interval: float = 0.05
) -> T:
    """Call `condition` until it returns something truthy and return that; fail the test at the deadline.

    For waiting on another process or thread: the deadline is generous, the condition decides.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    """A fresh, empty database on the server of `admin_url`; its URL. Dropped afterwards, even in use.

    conftest's `postgres_url` fixture does the same for one test; this serves wider fixtures.
    """
    name = f"gw_test_{uuid.uuid4().hex[:12]}"
    _postgres_admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _postgres_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _postgres_admin(admin_url: str, statement: str) -> None:
    """Run one statement on the server, on a thread of its own (callers may be inside an event loop)."""

    async def run() -> None:
        engine = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                await conn.exec_driver_sql(statement)
        finally:
            await engine.dispose()

    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, run()).result()


def json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path (keys and indexes) of every part of parsed JSON, the whole of it first."""
    found = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            found += json_paths(child, (*prefix, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += json_paths(child, (*prefix, index))
    return found


def replace_one_part(data: st.DataObject, payload: Any, values: st.SearchStrategy[Any]) -> tuple[Any, ...]:
    """Replace one part of `payload` (at any depth, never the whole) with a drawn value; its path."""
    path: tuple[Any, ...] = data.draw(st.sampled_from(json_paths(payload)[1:]))
    parent = payload
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = data.draw(values)
    return path
