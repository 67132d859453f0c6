"""A real `gateway serve` process for the edge tests: a free port, its log in a file, ready or not,
stopped with SIGTERM; and raw loopback sockets for clients that httpx will not imitate."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import GATEWAY, free_port, gateway_env, wait_until

START_TIMEOUT_SECONDS = 60


@dataclass(frozen=True)
class ServeProcess:
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def events(self) -> list[dict[str, Any]]:
        """The JSON log events written so far (uvicorn's own lines are skipped)."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                found.append(json.loads(line))
        return found

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def open_files(self) -> int:
        return len(list(Path(f"/proc/{self.pid}/fd").iterdir()))

    def status(self, field: str) -> int:
        """A `/proc/<pid>/status` figure in kB (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise KeyError(field)


def wait_ready(served: ServeProcess) -> None:
    def ready() -> bool:
        if served.process.poll() is not None:
            pytest.fail(f"gateway serve exited with {served.process.returncode}:\n{served.log_tail()}")
        try:
            return httpx.get(f"{served.base}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, f"{served.base}/readyz", timeout=START_TIMEOUT_SECONDS)


@contextmanager
def serve_process(
    cwd: Path,
    *,
    command: list[str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    ready: bool = True,
    **settings: str,
) -> Iterator[ServeProcess]:
    """`gateway serve` (or `command`, which must exec it) with these GATEWAY_* settings, JSON logs."""
    port = free_port()
    log = cwd / f"serve-{port}.log"
    env = gateway_env(GATEWAY_LOG_FORMAT="json", GATEWAY_PORT=str(port), **settings)
    process = subprocess.Popen(
        [*(command or []), GATEWAY, "serve"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec_fn,
    )
    # The test process writes the log file: a limit on the gateway's file sizes must not stop its logs.
    copier = threading.Thread(target=_copy, args=(process, log), daemon=True)
    copier.start()
    served = ServeProcess(port, process, log)
    try:
        if ready:
            wait_ready(served)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        copier.join(timeout=10)


def _copy(process: subprocess.Popen[bytes], log: Path) -> None:
    assert process.stdout is not None
    with process.stdout, log.open("wb") as out:
        for line in process.stdout:
            out.write(line)
            out.flush()


@contextmanager
def sockets(port: int, count: int = 1) -> Iterator[list[socket.socket]]:
    """`count` connected loopback sockets (non-blocking), closed afterwards."""
    made: list[socket.socket] = []
    try:
        for _ in range(count):
            made.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            made[-1].setblocking(False)
        yield made
    finally:
        for sock in made:
            sock.close()


def read_until_closed(sockets: list[socket.socket], timeout: float) -> dict[socket.socket, bytes]:
    """What each socket received until the server closed it; sockets still open at the deadline are
    left out. Waits on the sockets themselves (select), never on a clock alone."""
    received: dict[socket.socket, bytearray] = {sock: bytearray() for sock in sockets}
    open_ = set(sockets)
    closed: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + timeout
    while open_:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(list(open_), [], [], left)
        for sock in readable:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if chunk:
                received[sock] += chunk
            else:
                open_.discard(sock)
                closed[sock] = bytes(received[sock])
    return closed


def status_of(response: bytes) -> int | None:
    """The status code of a raw HTTP/1.1 response, or None when nothing came."""
    if not response.startswith(b"HTTP/1.1 "):
        return None
    return int(response[9:12])


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    """One HTTP response as far as it came: its head and Content-Length body, or what arrived before
    the server closed the connection or the deadline passed (waiting on the socket, not a clock)."""
    answer = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        head, separator, body = bytes(answer).partition(b"\r\n\r\n")
        if separator:
            length = next(
                (
                    int(line[15:])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ),
                0,
            )
            if len(body) >= length:
                return bytes(answer)
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return bytes(answer)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(answer)
        if not chunk:
            return bytes(answer)
        answer += chunk
