"""Unauthenticated webhooks against the real `gateway serve`: a secret carried in the headers is checked
before any body byte is read, so nobody without it can make the gateway hold a body."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.serve_process import ServeProcess, read_answer, serve_process, sockets, status_of

pytestmark = pytest.mark.e2e

TG_SECRET = "tg-secret-unauthenticated"
WA_SECRET = "wa-secret-unauthenticated"
FOUR_MIB = 4 * 1024 * 1024


def head(path: str, length: int, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", f"Content-Length: {length}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    cwd = tmp_path_factory.mktemp("unauthenticated")
    with serve_process(
        cwd, GATEWAY_TELEGRAM_SECRET_TOKEN=TG_SECRET, GATEWAY_WHATSAPP_APP_SECRET=WA_SECRET
    ) as served:
        yield served


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/webhooks/telegram", ("X-Telegram-Bot-Api-Secret-Token: wrong",)),
        ("/webhooks/telegram", ()),
        ("/webhooks/whatsapp", ()),  # no X-Hub-Signature-256 at all: the HMAC cannot match
        ("/webhooks/whatsapp", ("X-Hub-Signature-256: md5=abc",)),
    ],
)
def test_a_missing_or_wrong_header_secret_is_refused_before_any_body_byte(
    gateway: ServeProcess, path: str, headers: tuple[str, ...]
) -> None:
    with sockets(gateway.port) as (sock,):
        sock.sendall(head(path, FOUR_MIB, *headers))  # 4 MiB announced, not one byte of it sent
        answer = read_answer(sock, timeout=10)
    assert status_of(answer) == 401, answer[:300]
    assert b'"error":"unauthorized"' in answer


def test_unauthenticated_bodies_are_never_buffered(gateway: ServeProcess) -> None:
    """40 bodies of 4 MiB with a wrong secret, at once: each gets its 401, none is kept."""
    body = b"{" + b" " * (FOUR_MIB - 2) + b"}"
    peak_before = gateway.status("VmHWM")
    statuses: list[int | None] = []

    def post() -> None:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
            sock.sendall(head("/webhooks/telegram", len(body), "X-Telegram-Bot-Api-Secret-Token: wrong"))
            # The gateway may close once it has answered; the answer is still there to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(body)
            statuses.append(status_of(read_answer(sock, timeout=30)))

    threads = [threading.Thread(target=post) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    growth_mib = (gateway.status("VmHWM") - peak_before) / 1024
    assert statuses.count(401) == 40, statuses
    assert growth_mib < 16, f"peak RSS grew by {growth_mib:.0f} MiB for 40 unauthenticated bodies"
