"""The real `gateway serve` process, as a user starts it: README's first command in a fresh directory."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.engine import create_engine
from gateway.store.migrations import head_revision
from tests.helpers import GATEWAY, free_port, gateway_env, wait_until

pytestmark = pytest.mark.e2e
START_TIMEOUT_SECONDS = 60


def wait_ready(process: subprocess.Popen[str], base: str) -> httpx.Response:
    """Poll /readyz until it answers 200; fail early if the process dies."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    last: httpx.Response | None = None
    while time.monotonic() < deadline:
        assert process.poll() is None, f"gateway serve exited with {process.returncode}"
        try:
            last = httpx.get(f"{base}/readyz", timeout=5)
            if last.status_code == 200:
                return last
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"not ready after {START_TIMEOUT_SECONDS}s; last answer: {last and last.text}")


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    return process.returncode, err


def test_serve_on_embedded_defaults(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [GATEWAY, "serve", "--port", str(port)],
        cwd=tmp_path,
        env=gateway_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        ready = wait_ready(process, base)
        assert ready.json() == {
            "status": "ready",
            "database": "ok",
            "schema": head_revision(),
            "claims": {"worker": "ok", "delivery": "ok"},
        }
        assert (tmp_path / "data" / "gateway.db").is_file()

        health = httpx.get(f"{base}/healthz", headers={"X-Request-ID": "e2e-1"})
        assert health.json() == {"status": "ok"}
        assert health.headers["X-Request-ID"] == "e2e-1"

        missing = httpx.get(f"{base}/does-not-exist")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/json"
        assert missing.json()["request_id"] == missing.headers["X-Request-ID"]

        metrics = httpx.get(f"{base}/metrics").text
        assert 'gateway_http_requests_total{method="GET",route="/healthz",status="200"} 1.0' in metrics
        assert "process_resident_memory_bytes" in metrics
    finally:
        code, err = stop(process)
    assert code == 0, err
    events = [json.loads(line) for line in err.splitlines()]  # not a TTY: every line is JSON
    access = [e for e in events if e["event"] == "request_finished" and e["path"] == "/healthz"]
    assert access, "no access event for /healthz"
    assert access[0]["request_id"] == "e2e-1"
    assert {"method", "status", "duration_ms"} <= set(access[0])
    assert any(e["event"] == "database_migrated" for e in events)


def test_serve_with_unreachable_postgres_exits_1_with_one_line(tmp_path: Path) -> None:
    url = f"postgresql+asyncpg://gw:do-not-print@127.0.0.1:{free_port()}/gateway"
    result = subprocess.run(
        [GATEWAY, "serve"],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gateway: cannot use the database at postgresql+asyncpg://gw:***@127.0.0.1")
    assert "do-not-print" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_serve_with_several_workers(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [GATEWAY, "serve", "--port", str(port), "--workers", "2"],
            cwd=tmp_path,
            env=gateway_env(GATEWAY_LOG_FORMAT="json"),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )

    def started() -> list[dict[str, object]]:
        return [json.loads(line) for line in log.read_text().splitlines() if '"gateway_started"' in line]

    try:
        assert wait_ready(process, f"http://127.0.0.1:{port}").json()["schema"] == head_revision()
        # One app per worker process: the second may still be starting when the first answers.
        wait_until(
            lambda: len(started()) == 2, "both worker processes started", timeout=START_TIMEOUT_SECONDS
        )
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()
    assert len(started()) == 2


@pytest.mark.postgres
@pytest.mark.slow
async def test_sigterm_drains_an_in_flight_request(postgres_url: str, tmp_path: Path) -> None:
    """A request blocked in the database when SIGTERM arrives still gets its answer; exit code 0."""
    port = free_port()
    env = gateway_env(GATEWAY_DATABASE_URL=postgres_url, GATEWAY_LOG_FORMAT="json")
    process = await asyncio.create_subprocess_exec(
        GATEWAY, "serve", "--port", str(port), cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE
    )
    assert process.stderr is not None
    base = f"http://127.0.0.1:{port}"
    engine = create_engine(postgres_url)
    try:
        await read_until(process.stderr, "Application startup complete")
        async with httpx.AsyncClient(base_url=base, timeout=30) as client, engine.connect() as blocker:
            # Hold the schema table so /readyz blocks inside the database.
            await blocker.execute(text("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE"))
            in_flight = asyncio.create_task(client.get("/readyz"))
            await wait_for_blocked_query(engine)
            process.send_signal(signal.SIGTERM)
            await read_until(process.stderr, "Shutting down")
            await blocker.rollback()  # let the blocked request finish
            response = await in_flight
        assert response.status_code == 200
        assert response.json()["status"] == "ready"
        rest = await process.stderr.read()
        assert await process.wait() == 0, rest.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await engine.dispose()


async def read_until(stream: asyncio.StreamReader, marker: str) -> None:
    async with asyncio.timeout(START_TIMEOUT_SECONDS):
        while True:
            line = (await stream.readline()).decode()
            assert line, f"the process ended before logging {marker!r}"
            if marker in line:
                return


async def wait_for_blocked_query(engine: AsyncEngine) -> None:
    """Poll pg_locks (the server's own view) until a session waits for a lock."""
    query = text("SELECT count(*) FROM pg_locks WHERE NOT granted")
    async with asyncio.timeout(START_TIMEOUT_SECONDS):
        while True:
            async with engine.connect() as conn:
                if (await conn.execute(query)).scalar_one() > 0:
                    return
            await asyncio.sleep(0.05)


def test_serve_refuses_a_bad_agent_setting(tmp_path: Path) -> None:
    result = subprocess.run(
        [GATEWAY, "serve", "--port", str(free_port())],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_AGENT="gateway.demo:nothing_here"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gateway: invalid setting GATEWAY_AGENT: 'gateway.demo:nothing_here' is nothing, not an Agent"
    ]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--port", "70000"], "argument --port: must be from 1 to 65535"),
        (["--port", "0"], "argument --port: must be from 1 to 65535"),
        (["--port", "http"], "argument --port: not a whole number: 'http'"),
        (["--workers", "0"], "argument --workers: must be at least 1"),
    ],
)
def test_serve_refuses_a_bad_argument(tmp_path: Path, argv: list[str], problem: str) -> None:
    """--port 70000 used to start and serve on some other port (uvicorn took it as given)."""
    result = subprocess.run(
        [GATEWAY, "serve", *argv], cwd=tmp_path, env=gateway_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().endswith(f"gateway serve: error: {problem}")
    assert not (tmp_path / "data").exists(), "nothing may be created when start-up is refused"


@pytest.mark.parametrize("given_as", ["--host", "GATEWAY_HOST"])
def test_serve_refuses_a_host_that_does_not_resolve(tmp_path: Path, given_as: str) -> None:
    """uvicorn's own line was '[Errno -2] Name or service not known', naming neither host nor setting."""
    host = "no-such-host.invalid"
    result = subprocess.run(
        [GATEWAY, "serve", "--port", str(free_port()), *(["--host", host] if given_as == "--host" else [])],
        cwd=tmp_path,
        env=gateway_env(**({"GATEWAY_HOST": host} if given_as == "GATEWAY_HOST" else {})),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"gateway: invalid setting {given_as}: cannot bind '{host}': ")
    )
    assert not (tmp_path / "data").exists(), "nothing may be created when start-up is refused"


AGENTS_NAMING_MODELS = (
    "from gateway.agents import Agent\n"
    "billing = Agent('Billing', 'Refunds.', model='claude:sonnet')\n"
    "typo = Agent('Desk', 'Help.', handoffs=[billing])\n"
    "keyless = Agent('Desk', 'Help.', model='anthropic:claude-x')\n"
    "own_server = Agent('Desk', 'Help.', model='gemini:gemini-x')\n"
    "twins = Agent('Desk', 'Help.', handoffs=[Agent('Desk', 'Other help.')])\n"
)


@pytest.mark.parametrize(
    ("command", "agent", "problem"),
    [
        (
            "serve",
            "typo",  # the model of an agent reached only by a handoff
            "invalid setting GATEWAY_AGENT: agent 'Billing' names model 'claude:sonnet', which is not "
            "'scripted', 'openai:<model>', 'anthropic:<model>' or 'gemini:<model>'",
        ),
        (
            "worker",
            "keyless",
            "invalid setting GATEWAY_AGENT: agent 'Desk' names model 'anthropic:claude-x', which needs "
            "GATEWAY_ANTHROPIC_API_KEY: it calls https://api.anthropic.com (only a server of your own, "
            "at GATEWAY_ANTHROPIC_BASE_URL, may go without)",
        ),
        (
            "serve",
            "twins",  # the runner's own rule, met when the app started: a traceback then
            "invalid setting GATEWAY_AGENT: two different agents are named 'Desk'",
        ),
    ],
)
def test_serve_and_worker_check_the_agent_graph(
    tmp_path: Path, command: str, agent: str, problem: str
) -> None:
    """A model spec no provider has, or a provider's own endpoint without its key, was found by each
    turn, retried five times and dead-lettered: start-up refuses it now."""
    (tmp_path / "agents_naming_models.py").write_text(AGENTS_NAMING_MODELS)
    result = subprocess.run(
        [GATEWAY, command, *(["--port", str(free_port())] if command == "serve" else [])],
        cwd=tmp_path,
        env=gateway_env(GATEWAY_AGENT=f"agents_naming_models:{agent}", PYTHONPATH=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"gateway: {problem}"]
    assert not (tmp_path / "data").exists(), "nothing may be created when start-up is refused"


def test_an_agents_model_on_a_server_of_ones_own_needs_no_key(tmp_path: Path) -> None:
    (tmp_path / "agents_naming_models.py").write_text(AGENTS_NAMING_MODELS)
    port = free_port()
    process = subprocess.Popen(
        [GATEWAY, "serve", "--port", str(port)],
        cwd=tmp_path,
        env=gateway_env(
            GATEWAY_AGENT="agents_naming_models:own_server",
            GATEWAY_GEMINI_BASE_URL="http://127.0.0.1:9/v1beta",
            PYTHONPATH=str(tmp_path),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_ready(process, f"http://127.0.0.1:{port}").status_code == 200
    finally:
        assert stop(process)[0] == 0
