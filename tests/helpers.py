"""Test helpers: free ports, an in-process uvicorn on real loopback HTTP, the real CLI process."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

REPO_ROOT = Path(__file__).resolve().parents[1]
GATEWAY = str(Path(sys.executable).with_name("gateway"))


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


def gateway_env(**settings: str) -> dict[str, str]:
    """The current environment without GATEWAY_* settings, plus the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GATEWAY_")}
    env.update(settings)
    return env
