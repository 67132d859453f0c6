"""`gateway simulate` against the real `gateway serve` on its embedded defaults: no platform secret,
so the webhooks go through the local mode, and the replies come back from the database."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_serve import stop, wait_ready
from tests.helpers import GATEWAY, free_port, gateway_env

pytestmark = pytest.mark.e2e


def simulate(cwd: Path, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAY, "simulate", *args],
        cwd=cwd,
        env=gateway_env(GATEWAY_PORT=str(port)),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def served_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """README's first command in a fresh directory (one for this module's tests); the directory and port."""
    tmp_path = tmp_path_factory.mktemp("served")
    port = free_port()
    process = subprocess.Popen(
        [GATEWAY, "serve"],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_PORT=str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(process, f"http://127.0.0.1:{port}")
        yield tmp_path, port
    finally:
        code, err = stop(process)
        assert code == 0, err


@pytest.mark.parametrize(("platform", "user"), [("telegram", "4242"), ("whatsapp", "4915112345678")])
def test_simulate_prints_the_agents_reply(served_in: tuple[Path, int], platform: str, user: str) -> None:
    directory, port = served_in
    result = simulate(directory, port, platform, "Where is my order 1001?", "--user", user)
    assert result.returncode == 0, result.stderr
    assert "TRK-55821" in result.stdout  # the demo desk looked order 1001 up with its tool
    again = simulate(directory, port, platform, "and order 1003?", "--user", user)
    assert again.returncode == 0, again.stderr
    assert "1003" in again.stdout


def test_without_the_local_key_simulate_says_how_to_get_it(
    served_in: tuple[Path, int], tmp_path: Path
) -> None:
    result = simulate(tmp_path, served_in[1], "telegram", "hi")  # not where the gateway keeps its key
    assert result.returncode == 1
    assert "no local key at data/local.key" in result.stderr
    assert "start `gateway serve`" in result.stderr


def test_simulate_without_a_running_gateway_fails_in_one_line(tmp_path: Path) -> None:
    key = tmp_path / "data" / "local.key"
    key.parent.mkdir()
    key.write_text("some-key")
    key.chmod(0o600)
    result = simulate(tmp_path, free_port(), "whatsapp", "hi")
    assert result.returncode == 1
    assert "cannot reach the gateway" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_key_other_users_can_read_is_refused_in_one_line(tmp_path: Path) -> None:
    key = tmp_path / "data" / "local.key"
    key.parent.mkdir()
    key.write_text("some-key")
    key.chmod(0o644)
    result = simulate(tmp_path, free_port(), "whatsapp", "hi")
    assert result.returncode == 1
    assert "readable by other users" in result.stderr
    assert "chmod 600" in result.stderr


@pytest.mark.parametrize(
    ("timeout", "problem"),
    [
        ("nan", "must be more than 0 and at most 3600"),
        ("-1", "must be more than 0 and at most 3600"),
        ("inf", "must be more than 0 and at most 3600"),
        ("soon", "not a number: 'soon'"),
    ],
)
def test_simulate_refuses_a_timeout_that_is_no_wait(tmp_path: Path, timeout: str, problem: str) -> None:
    """nan, inf and negative timeouts were taken as given."""
    result = simulate(tmp_path, free_port(), "telegram", "hi", "--timeout", timeout)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(f"argument --timeout: {problem}")
