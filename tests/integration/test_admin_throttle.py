"""Wrong admin tokens are throttled per client address, over real loopback HTTP from several loopback
addresses; a short GATEWAY_ADMIN_TOKEN stops start-up."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import GATEWAY, gateway_env, serve_in_thread

TOKEN = "admin-token-for-throttle-tests-0123"
FAILURES_BEFORE_429 = 10


def client_from(base: str, address: str, token: str | None) -> httpx.Client:
    """A client whose connections come from `address` (any of 127.0.0.0/8 is this machine's loopback)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(
        base_url=base, headers=headers, transport=httpx.HTTPTransport(local_address=address), timeout=30
    )


@pytest.fixture
def base() -> Iterator[str]:
    settings = Settings(database_url="sqlite+aiosqlite:///:memory:", admin_token=TOKEN, local_key_file="")
    with serve_in_thread(create_app(settings)) as served:
        yield served


def test_wrong_tokens_from_one_address_get_429_then_even_the_right_one(base: str) -> None:
    with (
        structlog.testing.capture_logs() as logs,
        client_from(base, "127.0.0.2", "wrong-token") as guesser,
        client_from(base, "127.0.0.2", TOKEN) as same_address,
    ):
        wrong = [guesser.get("/api/sessions").status_code for _ in range(FAILURES_BEFORE_429)]
        throttled = [guesser.get("/api/sessions") for _ in range(5)]
        right_but_throttled = same_address.get("/api/sessions")
    assert wrong == [401] * FAILURES_BEFORE_429
    for answer in [*throttled, right_but_throttled]:
        assert answer.status_code == 429
        assert answer.json()["error"] == "too_many_failures"
        assert 0 < int(answer.headers["Retry-After"]) <= 60
    events = [e for e in logs if e["event"] == "admin_throttled"]
    assert len(events) == 1  # once per lockout, not once per refused request
    assert events[0]["client"] == "127.0.0.2"
    assert TOKEN not in repr(logs)


def test_others_failures_never_throttle_a_correct_token(base: str) -> None:
    with client_from(base, "127.0.0.3", None) as anonymous:
        for _ in range(FAILURES_BEFORE_429 + 5):
            anonymous.get("/api/sessions")
        assert anonymous.get("/api/sessions").status_code == 429
    with client_from(base, "127.0.0.1", TOKEN) as operator, client_from(base, "127.0.0.4", "x") as other:
        assert operator.get("/api/sessions").status_code == 200
        assert other.get("/api/sessions").status_code == 401  # a fresh address starts with a clean slate


def test_a_correct_token_clears_the_address_failures(base: str) -> None:
    with client_from(base, "127.0.0.5", "typo") as typo, client_from(base, "127.0.0.5", TOKEN) as fixed:
        for _ in range(FAILURES_BEFORE_429 - 1):
            assert typo.get("/api/sessions").status_code == 401
        assert fixed.get("/api/sessions").status_code == 200
        assert typo.get("/api/sessions").status_code == 401  # counted afresh, not the tenth failure


def test_a_short_admin_token_stops_start_up_naming_the_setting(tmp_path: Path) -> None:
    result = subprocess.run(
        [GATEWAY, "serve"],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_ADMIN_TOKEN="fifteen-chars-x"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gateway: invalid setting GATEWAY_ADMIN_TOKEN (environment): ")
    assert "16" in line
    assert "fifteen-chars-x" not in result.stderr + result.stdout
    assert not (tmp_path / "data").exists()  # stopped before anything was created
