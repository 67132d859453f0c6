"""The HTTP app over real loopback HTTP: health, readiness, metrics, errors and request ids."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import create_app
from gateway.logs import configure_logging
from gateway.settings import Settings
from gateway.store import migrations
from gateway.store.engine import create_engine
from tests.helpers import free_port, serve_in_thread


async def migrate(url: str) -> None:
    engine = create_engine(url)
    try:
        await migrations.upgrade(engine)
    finally:
        await engine.dispose()


async def test_healthz_and_readyz_when_migrated(database_url: str) -> None:
    await migrate(database_url)
    with serve_in_thread(create_app(Settings(database_url=database_url))) as base:
        async with httpx.AsyncClient(base_url=base) as client:
            health = await client.get("/healthz")
            ready = await client.get("/readyz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ready",
        "database": "ok",
        "schema": migrations.head_revision(),
        "claims": {"worker": "ok", "delivery": "ok"},
    }


def test_readyz_is_503_when_the_schema_is_behind(sqlite_url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        ready = httpx.get(f"{base}/readyz")
        health = httpx.get(f"{base}/healthz")
    assert ready.status_code == 503
    assert ready.json()["status"] == "unready"
    assert f"expected {migrations.head_revision()}" in ready.json()["reason"]
    assert health.status_code == 200  # alive, just not ready


def test_readyz_is_503_when_the_database_is_unreachable() -> None:
    url = f"postgresql+asyncpg://postgres:pw-secret@127.0.0.1:{free_port()}/nowhere"
    with serve_in_thread(create_app(Settings(database_url=url))) as base:
        ready = httpx.get(f"{base}/readyz")
    assert ready.status_code == 503
    reason = ready.json()["reason"]
    assert "cannot use the database" in reason
    assert "pw-secret" not in reason


def test_in_memory_sqlite_is_migrated_by_the_app_and_shared() -> None:
    with serve_in_thread(create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))) as base:
        first = httpx.get(f"{base}/readyz")
        second = httpx.get(f"{base}/readyz")
    assert first.status_code == second.status_code == 200


def test_metrics_count_requests_by_route_and_status(sqlite_url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        httpx.get(f"{base}/healthz")
        httpx.get(f"{base}/healthz")
        httpx.get(f"{base}/no/such/page/123")
        metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'gateway_http_requests_total{method="GET",route="/healthz",status="200"} 2.0' in text
    assert 'gateway_http_requests_total{method="GET",route="<unmatched>",status="404"} 1.0' in text
    assert "/no/such/page" not in text  # raw paths would explode the label space
    assert 'gateway_http_request_duration_seconds_bucket{le="0.005",method="GET",route="/healthz"' in text
    assert "process_cpu_seconds_total" in text


def test_unknown_route_and_wrong_method_are_json(sqlite_url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        missing = httpx.get(f"{base}/nope")
        wrong = httpx.post(f"{base}/healthz")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    assert missing.json()["request_id"] == missing.headers["X-Request-ID"]
    assert wrong.status_code == 405
    assert wrong.json()["error"] == "method_not_allowed"
    assert set(wrong.headers["allow"].split(", ")) == {"GET", "HEAD"}


def test_request_id_is_taken_from_the_header_or_generated(sqlite_url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        given = httpx.get(f"{base}/healthz", headers={"X-Request-ID": "trace-42.a:b"})
        generated = httpx.get(f"{base}/healthz")
        forged = httpx.get(f"{base}/healthz", headers={"X-Request-ID": 'x" injected=1'})
    assert given.headers["X-Request-ID"] == "trace-42.a:b"
    assert len(generated.headers["X-Request-ID"]) == 32
    assert forged.headers["X-Request-ID"] != 'x" injected=1'


def test_unhandled_error_is_500_json_with_request_id_and_logged_traceback(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")

    async def boom(request: Request) -> Response:
        raise RuntimeError("the disk is on fire")

    app = create_app(Settings(database_url=sqlite_url))
    app.router.routes.append(Route("/boom", boom))
    with serve_in_thread(app) as base:
        response = httpx.get(f"{base}/boom", headers={"X-Request-ID": "req-500"})
    assert response.status_code == 500
    assert response.json() == {
        "error": "internal_error",
        "request_id": "req-500",
        "detail": "unexpected error; see the logs",
    }
    assert "disk is on fire" not in response.text  # internals stay in the logs
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    failed = next(e for e in events if e["event"] == "request_failed")
    assert failed["request_id"] == "req-500"
    assert "the disk is on fire" in json.dumps(failed["exception"])
    access = next(e for e in events if e["event"] == "request_finished" and e["path"] == "/boom")
    assert access["status"] == 500
    assert set(access) >= {"method", "path", "status", "duration_ms", "request_id"}


def test_metrics_histogram_has_its_buckets_count_sum_and_created(sqlite_url: str) -> None:
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        for _ in range(3):
            httpx.get(f"{base}/healthz")
        text = httpx.get(f"{base}/metrics").text
    labels = 'method="GET",route="/healthz",status="200"'
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"
    }
    buckets = [
        samples[f'gateway_http_request_duration_seconds_bucket{{le="{le}",{labels}}}']
        for le in (
            "0.001",
            "0.0025",
            "0.005",
            "0.01",
            "0.025",
            "0.05",
            "0.1",
            "0.25",
            "0.5",
            "1.0",
            "2.5",
            "5.0",
            "10.0",
            "+Inf",
        )
    ]
    assert buckets == sorted(buckets)  # cumulative
    assert buckets[-1] == samples[f"gateway_http_request_duration_seconds_count{{{labels}}}"] == 3
    assert 0 < samples[f"gateway_http_request_duration_seconds_sum{{{labels}}}"] < 3 * 10
    assert samples[f"gateway_http_requests_total{{{labels}}}"] == 3
    assert samples[f"gateway_http_requests_created{{{labels}}}"] > 1e9
    assert samples[f"gateway_http_request_duration_seconds_created{{{labels}}}"] > 1e9
    assert "# TYPE gateway_http_request_duration_seconds histogram" in text
    assert "# TYPE gateway_http_requests_total counter" in text


def test_the_request_id_header_is_set_once_even_when_the_answer_has_one(sqlite_url: str) -> None:
    # error_response puts X-Request-ID on its answers itself; the middleware must not add a second.
    with serve_in_thread(create_app(Settings(database_url=sqlite_url))) as base:
        missing = httpx.get(f"{base}/no-such-route", headers={"X-Request-ID": "req-404"})
        fine = httpx.get(f"{base}/healthz", headers={"X-Request-ID": "req-200"})
    assert missing.status_code == 404
    assert missing.headers.get_list("x-request-id") == ["req-404"]
    assert missing.json()["request_id"] == "req-404"
    assert fine.headers.get_list("x-request-id") == ["req-200"]
