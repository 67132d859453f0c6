"""Slow and abusive clients against the real `gateway serve` on loopback: unfinished request heads, bodies
that trickle, heads that never end, idle sockets by the hundred, and unauthenticated bodies."""

from __future__ import annotations

import json
import resource
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import GATEWAY, gateway_env, wait_until
from tests.serve_process import ServeProcess, read_until_closed, serve_process, sockets, status_of

pytestmark = pytest.mark.e2e

TG_SECRET = "tg-secret-slow-clients"
WA_SECRET = "wa-secret-slow-clients"
ADMIN_TOKEN = "admin-token-slow-clients-0123"
HEAD_TIMEOUT = 1
BODY_TIMEOUT = 2
# How long past its deadline a connection may stay: the deadline checks run on a coarse timer.
SLACK = 3


def telegram_update(update_id: int) -> bytes:
    person = {"id": 1000 + update_id, "is_bot": False, "first_name": "T"}
    message = {"message_id": update_id, "date": 1767225600, "chat": {**person, "type": "private"}}
    return json.dumps({"update_id": update_id, "message": {**message, "from": person, "text": "hi"}}).encode()


def head(path: str, length: int, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {length}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One gateway with short deadlines for the module's tests (each test uses its own update ids)."""
    cwd = tmp_path_factory.mktemp("slow-clients")
    with serve_process(
        cwd,
        GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET,
        GATEWAY_WHATSAPP_APP_SECRET=WA_SECRET,
        GATEWAY_HEADER_TIMEOUT_SECONDS=str(HEAD_TIMEOUT),
        GATEWAY_BODY_TIMEOUT_SECONDS=str(BODY_TIMEOUT),
        GATEWAY_ADMIN_TOKEN=ADMIN_TOKEN,
    ) as served:
        yield served


def test_unfinished_request_heads_and_silent_sockets_are_closed(gateway: ServeProcess) -> None:
    with sockets(gateway.port, 100) as unfinished, sockets(gateway.port, 10) as silent:
        for sock in unfinished:
            sock.sendall(b"POST /webhooks/telegram HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
        started = time.monotonic()
        closed = read_until_closed(unfinished + silent, timeout=HEAD_TIMEOUT + SLACK)
    elapsed = time.monotonic() - started
    still_open = len(unfinished) + len(silent) - len(closed)
    assert still_open == 0, f"{still_open} of 110 connections still open after {elapsed:.1f}s"
    assert {status_of(closed[sock]) for sock in unfinished} == {408}
    assert {closed[sock] for sock in silent} == {b""}  # nothing was asked, nothing is answered
    # The gateway still serves everyone else.
    assert httpx.get(f"{gateway.base}/healthz").status_code == 200


def test_a_body_sent_at_one_byte_a_second_gets_408_and_the_connection_closes(gateway: ServeProcess) -> None:
    body = telegram_update(1)
    with sockets(gateway.port) as (sock,):
        sock.sendall(head("/webhooks/telegram", len(body), f"X-Telegram-Bot-Api-Secret-Token: {TG_SECRET}"))
        started = time.monotonic()
        for byte in body:
            sock.sendall(bytes([byte]))
            # One byte a second, until the gateway answers.
            readable, _, _ = select.select([sock], [], [], 1.0)
            if readable:
                break
            assert time.monotonic() - started < BODY_TIMEOUT + SLACK, "no answer to a trickling body"
        closed = read_until_closed([sock], timeout=SLACK)
        elapsed = time.monotonic() - started
    assert sock in closed, f"the connection is still open after {elapsed:.1f}s"
    answer = closed[sock]
    assert status_of(answer) == 408, answer[:200]
    assert b'"error":"request_timeout"' in answer
    assert elapsed < BODY_TIMEOUT + SLACK


def test_an_admin_body_that_stops_half_way_gets_408(gateway: ServeProcess) -> None:
    with sockets(gateway.port) as (sock,):
        sock.sendall(head("/api/sessions", 100, f"Authorization: Bearer {ADMIN_TOKEN}") + b'{"title": "ha')
        closed = read_until_closed([sock], timeout=BODY_TIMEOUT + SLACK)
    assert sock in closed, "the connection is still open"
    assert status_of(closed[sock]) == 408
    assert b'"error":"request_timeout"' in closed[sock]


def test_a_body_still_arriving_after_the_answer_is_dropped_until_its_deadline(gateway: ServeProcess) -> None:
    """Answered from its headers (a wrong secret), the request's body is read and dropped, not for ever."""
    with sockets(gateway.port) as (sock,):
        sock.sendall(head("/webhooks/telegram", 10_000, "X-Telegram-Bot-Api-Secret-Token: wrong"))
        started = time.monotonic()
        answer = b""
        for _ in range(10_000):
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            readable, _, _ = select.select([sock], [], [], 0.5)
            if readable:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            assert time.monotonic() - started < BODY_TIMEOUT + SLACK, "the body is still being read"
        elapsed = time.monotonic() - started
    assert status_of(answer) == 401
    assert elapsed >= BODY_TIMEOUT - 0.5  # read and dropped until the deadline, then closed


def test_a_request_head_that_never_ends_gets_431(gateway: ServeProcess) -> None:
    with sockets(gateway.port) as (sock,):
        sock.setblocking(True)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
        try:
            for index in range(100):  # 100 KiB of headers and counting, well within the head deadline
                sock.sendall(f"X-Pad-{index}: ".encode() + b"a" * 1000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused part of the way: the answer is what counts
        sock.setblocking(False)
        closed = read_until_closed([sock], timeout=SLACK)
    assert sock in closed, "a request head of 100 KiB is still being read"
    assert status_of(closed[sock]) == 431


def test_keep_alive_connections_still_carry_several_requests(gateway: ServeProcess) -> None:
    with httpx.Client(base_url=gateway.base) as client:
        headers = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET}
        answers = [
            client.post("/webhooks/telegram", content=telegram_update(n), headers=headers) for n in (10, 11)
        ]
        answers.append(client.get("/healthz"))
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["new"] == 1


# --- open files ----------------------------------------------------------------------------------


def limit_open_files(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_sockets_do_not_starve_a_webhook_at_256_open_files(tmp_path: Path) -> None:
    with serve_process(
        tmp_path,
        preexec_fn=lambda: limit_open_files(256, 256),
        GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET,
        GATEWAY_MAX_CONNECTIONS="64",
    ) as served:
        with sockets(served.port, 300) as idle:
            answer = httpx.post(
                f"{served.base}/webhooks/telegram",
                content=telegram_update(1),
                headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET},
                timeout=10,
            )
            assert (answer.status_code, answer.json()["new"]) == (200, 1)
            # The oldest idle sockets made room: at most 64 of the 300 are still held.
            evicted = read_until_closed(idle, timeout=SLACK)
            assert len(evicted) >= 300 - 64
            assert served.open_files() < 256
        assert not [e for e in served.events() if e.get("event") == "request_failed"]


def test_serve_raises_the_soft_open_files_limit_to_the_hard_one(tmp_path: Path) -> None:
    with serve_process(tmp_path, preexec_fn=lambda: limit_open_files(256, 4096)) as served:
        limits = Path(f"/proc/{served.pid}/limits").read_text().splitlines()
        (line,) = [line for line in limits if line.startswith("Max open files")]
        assert line.split()[3:5] == ["4096", "4096"]


def test_more_connections_than_open_files_stops_start_up_naming_the_setting(tmp_path: Path) -> None:
    result = subprocess.run(
        [GATEWAY, "serve"],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_MAX_CONNECTIONS="1000"),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: limit_open_files(256, 256),
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gateway: invalid setting GATEWAY_MAX_CONNECTIONS")
    assert "256" in line


def test_the_default_connection_cap_fits_itself_to_a_low_open_files_limit(tmp_path: Path) -> None:
    with serve_process(tmp_path, preexec_fn=lambda: limit_open_files(256, 256)) as served:
        wait_until(
            lambda: [e for e in served.events() if e.get("event") == "max_connections_lowered"],
            "the warning that the connection cap was lowered",
        )
        (event,) = [e for e in served.events() if e.get("event") == "max_connections_lowered"]
        assert event["open_files"] == 256
        assert 0 < event["max_connections"] < 256
