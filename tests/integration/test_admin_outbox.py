"""The admin API's outbox routes over real loopback HTTP, on SQLite and PostgreSQL: the dead and failed
views, retry (and the delivery it wakes), the token, bad input; and `gateway outbox list|retry`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, select, update

from gateway.app import create_app
from gateway.cli import main
from gateway.store.engine import create_engine
from gateway.store.tables import OutboxRow
from gateway.worker import claim_loop
from tests.helpers import serve_in_thread, wait_until
from tests.integration.test_admin_api import AUTH, run_sql, settings

NETWORK_ERROR = ("network", "ConnectError: [Errno 111] Connection refused")
BLOCKED = ("403", "Forbidden: bot was blocked by the user")


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with (
        serve_in_thread(create_app(settings(url))) as served,
        httpx.Client(base_url=served, headers=AUTH, timeout=30) as made,
    ):
        yield made


def add_outbox_rows(url: str, statuses: list[str], session_id: str = "telegram:42") -> list[int]:
    """Outbox rows of one conversation, a second apart, each as delivery leaves a row of that status."""

    async def add() -> list[int]:
        engine = create_engine(url)
        ids = []
        start = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        try:
            async with engine.begin() as conn:
                for i, status in enumerate(statuses):
                    at = start + timedelta(seconds=i)
                    error = NETWORK_ERROR if status == "dead" else BLOCKED if status == "failed" else None
                    result = await conn.execute(
                        insert(OutboxRow)
                        .values(
                            inbox_id=None,
                            platform="telegram",
                            session_id=session_id,
                            kind="text",
                            text=f"reply {i}",
                            target_json={"chat_id": "42"},
                            status=status,
                            attempts={"dead": 9, "failed": 1}.get(status, 0),
                            next_attempt_at=at + timedelta(hours=24) if error else at,
                            retry_until=at + timedelta(hours=24) if status == "dead" else None,
                            platform_message_id=f"m{i}" if status == "sent" else None,
                            error_code=error and error[0],
                            error_message=error and error[1],
                            created_at=at,
                            updated_at=at + timedelta(hours=24),
                        )
                        .returning(OutboxRow.id)
                    )
                    ids.append(int(result.scalar_one()))
        finally:
            await engine.dispose()
        return ids

    return asyncio.run(add())


def statuses(url: str) -> dict[int, tuple[str, int, str | None]]:
    """Each row's status, attempts and error code, read from the table itself."""
    query = select(OutboxRow.id, OutboxRow.status, OutboxRow.attempts, OutboxRow.error_code)
    return {row_id: (status, n, code) for row_id, status, n, code in asyncio.run(run_sql(url, query))}


# --- the views ---------------------------------------------------------------------------------------
def test_the_dead_view_lists_given_up_replies_newest_first(url: str, client: httpx.Client) -> None:
    sent, dead1, failed, dead2, dry = add_outbox_rows(url, ["sent", "dead", "failed", "dead", "dry_run"])
    answer = client.get("/api/outbox", params={"status": "dead"})
    assert answer.status_code == 200
    dead = answer.json()["items"]
    assert [item["id"] for item in dead] == [dead2, dead1]
    item = dead[0]
    assert item == {
        "id": dead2,
        "inbox_id": None,
        "platform": "telegram",
        "session_id": "telegram:42",
        "kind": "text",
        "status": "dead",
        "attempts": 9,
        "error_code": "network",
        "error_message": "ConnectError: [Errno 111] Connection refused",
        "created_at": item["created_at"],
        "updated_at": item["updated_at"],
        "next_attempt_at": item["next_attempt_at"],
        "retry_until": item["retry_until"],
    }
    created = datetime.fromisoformat(item["created_at"])
    assert created.tzinfo is not None
    assert datetime.fromisoformat(item["retry_until"]) - created == timedelta(hours=24)
    assert "reply 3" not in answer.text  # never the reply's text

    everything = client.get("/api/outbox").json()["items"]
    assert [i["id"] for i in everything] == [dry, dead2, failed, dead1, sent]
    assert everything[-1]["retry_until"] is None
    (refused,) = client.get("/api/outbox", params={"status": "failed"}).json()["items"]
    assert (refused["id"], refused["error_code"], refused["attempts"]) == (failed, "403", 1)
    limited = client.get("/api/outbox", params={"limit": 2}).json()["items"]
    assert [i["id"] for i in limited] == [dry, dead2]
    assert client.get("/api/outbox", params={"status": "read"}).json() == {"items": []}


# --- retry -------------------------------------------------------------------------------------------
def test_retry_requeues_dead_and_failed_rows_and_refuses_the_others(url: str, client: httpx.Client) -> None:
    sent, dead, failed = add_outbox_rows(url, ["sent", "dead", "failed"])
    retried = client.post(f"/api/outbox/{dead}/retry")
    assert retried.status_code == 200, retried.text
    item = retried.json()
    assert (item["id"], item["status"], item["attempts"]) == (dead, "pending", 0)
    assert (item["error_code"], item["error_message"], item["retry_until"]) == (None, None, None)
    assert datetime.fromisoformat(item["next_attempt_at"]) > datetime.now(UTC) - timedelta(minutes=5)

    again = client.post(f"/api/outbox/{dead}/retry")
    assert (again.status_code, again.json()["error"]) == (409, "not_retryable")
    # The app's delivery (dry-run: no bot token) may already have taken it.
    assert again.json()["outbox_status"] in {"pending", "dry_run"}

    assert client.post(f"/api/outbox/{failed}/retry").json()["status"] == "pending"
    refused = client.post(f"/api/outbox/{sent}/retry")
    assert (refused.status_code, refused.json()["error"]) == (409, "not_retryable")
    assert refused.json()["outbox_status"] == "sent"
    assert "dead or failed" in refused.json()["detail"]
    missing = client.post("/api/outbox/999999/retry")
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")

    stored = statuses(url)
    assert stored[sent] == ("sent", 0, None)  # untouched
    for requeued in (dead, failed):
        assert stored[requeued][0] in {"pending", "dry_run"}
        assert stored[requeued][1:] == (0, None)
    assert client.get("/api/outbox", params={"status": "dead"}).json() == {"items": []}


def test_a_retried_reply_goes_out_at_once_not_at_the_next_poll(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delivery idles for an hour here: only the retry's wake can make it look again."""
    monkeypatch.setattr(claim_loop, "IDLE_POLL_SECONDS", 3600)
    first, dead = add_outbox_rows(url, ["pending", "dead"], session_id="telegram:7")
    with (
        serve_in_thread(create_app(settings(url))) as served,
        httpx.Client(base_url=served, headers=AUTH, timeout=30) as client,
    ):
        # Delivery's first look at start-up sends the pending row (dry-run); then it idles.
        wait_until(lambda: statuses(url)[first][0] == "dry_run", "the pending row's delivery")
        assert client.post(f"/api/outbox/{dead}/retry").json()["status"] == "pending"
        wait_until(lambda: statuses(url)[dead][0] == "dry_run", "the retried row's delivery", timeout=30)


# --- the guard and bad input -------------------------------------------------------------------------
def test_the_outbox_routes_need_the_api_on_and_the_token(url: str) -> None:
    (dead,) = add_outbox_rows(url, ["dead"])
    with serve_in_thread(create_app(settings(url, admin_token=None))) as served:
        for method, path in [("GET", "/api/outbox"), ("POST", f"/api/outbox/{dead}/retry")]:
            answer = httpx.request(method, f"{served}{path}", headers=AUTH)
            assert (answer.status_code, answer.json()["error"]) == (404, "admin_disabled")
    with serve_in_thread(create_app(settings(url))) as served:
        for method, path in [("GET", "/api/outbox"), ("POST", f"/api/outbox/{dead}/retry")]:
            answer = httpx.request(method, f"{served}{path}", headers={"Authorization": "Bearer wrong"})
            assert (answer.status_code, answer.json()["error"]) == (401, "unauthorized")
    assert statuses(url)[dead][0] == "dead"  # nothing was requeued


BAD_REQUESTS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("GET", "/api/outbox", {"params": {"status": "bogus"}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"status": ""}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"status": "DEAD"}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"limit": "0"}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"limit": "501"}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"limit": "1e3"}}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"limit": "9" * 5000}}, 422, "invalid_request"),
    ("GET", "/api/outbox?status=dead&status=failed", {}, 422, "invalid_request"),
    ("GET", "/api/outbox", {"params": {"stauts": "dead"}}, 422, "invalid_request"),  # a typo
    ("GET", "/api/outbox?limit=1&=null", {}, 422, "invalid_request"),
    ("POST", "/api/outbox/abc/retry", {}, 404, "not_found"),
    ("POST", "/api/outbox/0/retry", {}, 404, "not_found"),
    ("POST", "/api/outbox/-1/retry", {}, 404, "not_found"),
    ("POST", "/api/outbox/1.5/retry", {}, 404, "not_found"),
    ("POST", "/api/outbox/9223372036854775808/retry", {}, 404, "not_found"),  # past BIGINT
    ("POST", "/api/outbox/99999999999999999999/retry", {}, 404, "not_found"),
    ("POST", "/api/outbox/%00/retry", {}, 404, "not_found"),
    ("GET", "/api/outbox/1/retry", {}, 405, "method_not_allowed"),
    ("POST", "/api/outbox", {}, 405, "method_not_allowed"),
]


def test_bad_input_gets_a_json_4xx_and_changes_nothing(url: str, client: httpx.Client) -> None:
    (dead,) = add_outbox_rows(url, ["dead"])
    wrong = []
    for method, path, kwargs, status, error in BAD_REQUESTS:
        answer = client.request(method, path, **kwargs)
        body = answer.json() if answer.headers.get("content-type") == "application/json" else None
        if (
            answer.status_code != status
            or body is None
            or body.get("error") != error
            or body.get("request_id") != answer.headers["X-Request-ID"]
            or not isinstance(body.get("detail"), str)
        ):
            wrong.append(f"{method} {path[:60]} {str(kwargs)[:80]}: {answer.status_code} {answer.text[:200]}")
    assert wrong == []
    assert statuses(url) == {dead: ("dead", 9, "network")}


# --- the CLI -----------------------------------------------------------------------------------------
def test_cli_outbox_list_and_retry(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", migrated_url)
    assert main(["outbox", "list", "--status", "dead"]) == 0
    assert capsys.readouterr().out == "no outbox rows with status dead\n"

    sent, dead, failed = add_outbox_rows(migrated_url, ["sent", "dead", "failed"], "telegram:42\x1b[2J")
    assert main(["outbox", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[0]) for line in lines] == [failed, dead, sent]  # newest first
    dead_line = lines[1]
    for part in ("dead", " 9 ", "telegram", "[text]", "error: network: ConnectError: [Errno 111]"):
        assert part in dead_line, (part, dead_line)
    assert "error: 403: Forbidden: bot was blocked" in lines[0]
    assert "error" not in lines[2]
    assert "reply " not in "".join(lines)  # never the reply's text
    assert "\x1b" not in "".join(lines)  # nor a control character from outside
    assert "telegram:42 [2J" in dead_line

    assert main(["outbox", "list", "--status", "failed", "--limit", "1"]) == 0
    assert [int(line.split()[0]) for line in capsys.readouterr().out.splitlines()] == [failed]

    assert main(["outbox", "retry", str(dead)]) == 0
    assert capsys.readouterr().out == f"outbox row {dead} requeued\n"
    assert statuses(migrated_url)[dead] == ("pending", 0, None)
    # A requeued row that failed before waits on retries: the list says how many, per platform.
    assert main(["outbox", "list", "--status", "dead"]) == 0
    assert capsys.readouterr().out == "no outbox rows with status dead\n"

    for outbox_id, error in [
        (dead, f"gateway: outbox row {dead} is pending: only a dead or failed row is retried"),
        (sent, f"gateway: outbox row {sent} is sent: only a dead or failed row is retried"),
        (999999, "gateway: no outbox row with id 999999"),
        (2**63, f"gateway: no outbox row with id {2**63}"),
        (0, "gateway: no outbox row with id 0"),
    ]:
        assert main(["outbox", "retry", str(outbox_id)]) == 1
        assert capsys.readouterr().err.strip() == error
    assert statuses(migrated_url)[sent] == ("sent", 0, None)


def test_cli_outbox_list_says_which_platforms_replies_wait_on(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", migrated_url)
    add_outbox_rows(migrated_url, ["pending", "sent"])
    assert main(["outbox", "list"]) == 0
    assert "waiting" not in capsys.readouterr().out  # a pending row that never failed waits on nothing

    first, second = add_outbox_rows(migrated_url, ["pending", "pending"], "telegram:9")
    gives_up = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    for row_id, retry_until in [(first, gives_up + timedelta(hours=1)), (second, gives_up)]:
        failed_once = update(OutboxRow).where(OutboxRow.id == row_id)
        asyncio.run(run_sql(migrated_url, failed_once.values(attempts=3, retry_until=retry_until)))
    assert main(["outbox", "list", "--status", "dead"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "no outbox rows with status dead",
        "waiting: 2 telegram replies retried after failures; the first is dead at 2030-01-02 03:04:05",
    ]
