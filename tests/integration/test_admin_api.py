"""The session admin API over real loopback HTTP, on SQLite and PostgreSQL: auth, listing and paging,
filters, odd session ids, create, rename, delete (also under a running turn), the inbox, bad input."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import structlog
from sqlalchemy import func, insert, select
from sqlalchemy.engine import make_url

from gateway.agents import (
    Agent,
    Message,
    Role,
    Runner,
    RunResult,
    SessionDeletedError,
    SQLSessionStore,
    ToolCall,
    tool,
)
from gateway.agents.models.base import ToolSpec
from gateway.app import create_app
from gateway.settings import Settings
from gateway.store.engine import create_engine
from gateway.store.tables import InboxRow, MessageRow, SessionRow
from tests.helpers import serve_in_thread

TOKEN = "admin-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ODD_IDS = [
    "telegram:123",
    "whatsapp:15550001111:wa.id/with/slashes",
    "cli:ünïcødé 🙂 and spaces",
    "a/b/../c",  # dot segments, only ever sent percent-encoded
    "x%2Fy?z#w",  # characters that mean something in a URL
    "trailing/",
    "%",
]


def path_of(session_id: str) -> str:
    return f"/api/sessions/{quote(session_id, safe='')}"


@pytest.fixture
def url(migrated_url: str) -> str:
    return migrated_url


def settings(url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"database_url": url, "admin_token": TOKEN, "local_key_file": "", **overrides}
    return Settings(**values)


@pytest.fixture
def base(url: str) -> Iterator[str]:
    with serve_in_thread(create_app(settings(url))) as served:
        yield served


@pytest.fixture
def client(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as made:
        yield made


async def run_sql(url: str, statement: Any, rows: Sequence[dict[str, Any]] | None = None) -> Any:
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(statement, rows) if rows else await conn.execute(statement)
            return result.all() if result.returns_rows else None
    finally:
        await engine.dispose()


def seed_sessions(url: str, sessions: list[tuple[str, str | None, datetime]]) -> None:
    """Session rows with chosen ids, titles and updated_at (no messages)."""
    rows: list[dict[str, Any]] = [
        {
            "session_id": session_id,
            "title": title,
            "active_agent_name": "Support",
            "metadata_json": {},
            "created_at": updated - timedelta(minutes=1),
            "updated_at": updated,
            "message_count": 0,
        }
        for session_id, title, updated in sessions
    ]
    asyncio.run(run_sql(url, insert(SessionRow), rows))


# --- a real conversation, through the runner and the SQL session store ------------------------------
@tool
def check_order(order_id: int) -> dict[str, Any]:
    """Look an order up.

    Args:
        order_id: The order number.
    """
    return {"order_id": order_id, "status": "shipped"}


class OrderModel:
    """Calls check_order for the first user message, then answers; answers plainly after that."""

    async def respond(self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]) -> Message:
        if history[-1].role is Role.TOOL:
            return Message(Role.MODEL, f"Order status: {history[-1].content}")
        if sum(m.role is Role.USER for m in history) == 1:
            return Message(
                Role.MODEL, None, tool_calls=[ToolCall("call-1", "check_order", {"order_id": 1001})]
            )
        return Message(Role.MODEL, "Anything else?")


async def converse(url: str, session_id: str, *texts: str) -> None:
    store = SQLSessionStore(url)
    try:
        runner = Runner(Agent("Support", "Help.", model=OrderModel(), tools=[check_order]), store)
        for text in texts:
            await runner.run_async(session_id, text, metadata={"platform": "telegram", "user_id": "42"})
    finally:
        await store.aclose()


# --- the switch and the lock ------------------------------------------------------------------------
def test_without_a_token_the_api_is_disabled_and_says_how_to_enable_it(url: str) -> None:
    with (
        structlog.testing.capture_logs() as logs,
        serve_in_thread(create_app(settings(url, admin_token=None))) as served,
    ):
        answers = [
            httpx.get(f"{served}/api/sessions", headers=AUTH),
            httpx.get(f"{served}/api/sessions/telegram:1"),
            httpx.post(f"{served}/api/sessions", json={}),
            httpx.get(f"{served}/api/openapi.json", headers=AUTH),
            httpx.post(f"{served}/api/inbox/1/retry"),
        ]
    for answer in answers:
        assert answer.status_code == 404
        assert answer.json()["error"] == "admin_disabled"
        assert "GATEWAY_ADMIN_TOKEN" in answer.json()["detail"]
    events = [(e["event"], e.get("enable_with")) for e in logs if e["event"].startswith("admin_")]
    assert ("admin_disabled", "GATEWAY_ADMIN_TOKEN") in events
    assert not [e for e in logs if e["event"] == "admin_enabled"]


def test_start_up_logs_that_the_api_is_enabled(url: str) -> None:
    with structlog.testing.capture_logs() as logs, serve_in_thread(create_app(settings(url))) as served:
        assert httpx.get(f"{served}/api/sessions", headers=AUTH).status_code == 200
    events = [e["event"] for e in logs]
    assert "admin_enabled" in events
    assert TOKEN not in repr(logs)


WRONG_AUTHORIZATION: list[dict[str, Any]] = [
    {},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"Authorization": "Bearer ünï".encode()},
]


def test_a_missing_or_wrong_token_gets_401(base: str) -> None:
    for index, headers in enumerate(WRONG_AUTHORIZATION):
        # Each from a loopback address of its own: ten failures from one address lock it out (429).
        transport = httpx.HTTPTransport(local_address=f"127.0.1.{index + 1}")
        with httpx.Client(base_url=base, transport=transport) as anonymous:
            for method, path in [
                ("GET", "/api/sessions"),
                ("DELETE", "/api/sessions/x"),
                ("GET", "/api/inbox"),
            ]:
                answer = anonymous.request(method, path, headers=headers)
                assert answer.status_code == 401, (headers, method, path)
                assert answer.json()["error"] == "unauthorized"
                assert answer.headers["WWW-Authenticate"].startswith("Bearer")
                assert answer.json()["request_id"] == answer.headers["X-Request-ID"]


def test_the_scheme_is_case_insensitive(base: str) -> None:
    answer = httpx.get(f"{base}/api/sessions", headers={"Authorization": f"bearer {TOKEN}"})
    assert answer.status_code == 200


def test_a_rejected_delete_deletes_nothing(base: str, url: str, client: httpx.Client) -> None:
    assert client.post("/api/sessions", json={"session_id": "telegram:9"}).status_code == 201
    assert httpx.delete(f"{base}{path_of('telegram:9')}").status_code == 401
    assert client.get(path_of("telegram:9")).status_code == 200


# --- sessions -----------------------------------------------------------------------------------------
def test_odd_session_ids_go_through_every_route(client: httpx.Client) -> None:
    for session_id in ODD_IDS:
        odd_id_round_trip(client, session_id)


def odd_id_round_trip(client: httpx.Client, session_id: str) -> None:
    created = client.post("/api/sessions", json={"session_id": session_id, "title": "Odd one"})
    assert created.status_code == 201, created.text
    assert created.json()["session_id"] == session_id
    assert created.headers["Location"] == path_of(session_id)
    shown = client.get(created.headers["Location"])
    assert (shown.status_code, shown.json()["session_id"]) == (200, session_id)
    assert [s["session_id"] for s in client.get("/api/sessions").json()["sessions"]] == [session_id]
    renamed = client.put(path_of(session_id), json={"title": "Renamed"})
    assert (renamed.status_code, renamed.json()["title"]) == (200, "Renamed")
    assert client.delete(path_of(session_id)).status_code == 204
    assert client.get(path_of(session_id)).status_code == 404


def test_ids_with_slashes_also_work_unencoded(client: httpx.Client) -> None:
    session_id = "whatsapp:1555:a/b/c"
    assert client.post("/api/sessions", json={"session_id": session_id}).status_code == 201
    assert client.get(f"/api/sessions/{session_id}").json()["session_id"] == session_id
    assert client.get("/api/sessions/whatsapp:1555:a/b").status_code == 404  # a prefix is another id


def test_create_without_an_id_makes_a_uuid_and_a_taken_id_conflicts(client: httpx.Client) -> None:
    first = client.post("/api/sessions")  # no body at all
    assert first.status_code == 201
    item = first.json()
    assert str(uuid.UUID(item["session_id"])) == item["session_id"]
    assert item == {
        "session_id": item["session_id"],
        "title": None,
        "platform": None,
        "active_agent": "Support",  # the configured starting agent (the demo desk)
        "created_at": item["created_at"],
        "updated_at": item["created_at"],
        "message_count": 0,
    }
    again = client.post("/api/sessions", json={"session_id": item["session_id"], "title": "Other"})
    assert (again.status_code, again.json()["error"]) == (409, "session_exists")
    assert client.get(path_of(item["session_id"])).json()["title"] is None  # unchanged


def test_show_renders_the_stored_messages_in_order(url: str, client: httpx.Client) -> None:
    asyncio.run(converse(url, "telegram:42", "Where is order 1001?", "Thanks"))
    answer = client.get(path_of("telegram:42"))
    assert answer.status_code == 200
    session = answer.json()
    assert session["platform"] == "telegram"
    assert session["title"] == "Where is order 1001?"  # from the first user message
    assert session["active_agent"] == "Support"
    assert session["metadata"] == {"platform": "telegram", "user_id": "42"}
    assert session["message_count"] == len(session["messages"]) == 6
    messages = session["messages"]
    assert [m["role"] for m in messages] == ["user", "model", "tool", "model", "user", "model"]
    assert messages[0]["content"] == "Where is order 1001?"
    assert messages[1]["tool_calls"] == [
        {"id": "call-1", "name": "check_order", "arguments": {"order_id": 1001}}
    ]
    assert messages[1]["content"] is None
    assert messages[2]["tool_call_id"] == "call-1"
    assert "shipped" in messages[2]["content"]
    assert messages[3]["agent_name"] == "Support"
    assert messages[5]["content"] == "Anything else?"
    stamps = [datetime.fromisoformat(m["created_at"]) for m in messages]
    assert all(s.tzinfo is not None for s in stamps)
    assert stamps == sorted(stamps)
    assert set(messages[0]) == {"role", "content", "tool_calls", "tool_call_id", "agent_name", "created_at"}


def test_listing_shows_items_without_messages(url: str, client: httpx.Client) -> None:
    asyncio.run(converse(url, "telegram:42", "Where is order 1001?"))
    (item,) = client.get("/api/sessions").json()["sessions"]
    assert set(item) == {
        "session_id",
        "title",
        "platform",
        "active_agent",
        "created_at",
        "updated_at",
        "message_count",
    }
    assert (item["session_id"], item["message_count"], item["platform"]) == ("telegram:42", 4, "telegram")


def test_pages_follow_updated_at_then_id_and_end_with_a_null_cursor(url: str, client: httpx.Client) -> None:
    now = datetime.now(UTC).replace(microsecond=123456)
    tie = now - timedelta(minutes=5)
    seeded: list[tuple[str, str | None, datetime]] = [
        (f"telegram:{i}", f"t{i}", now - timedelta(minutes=i)) for i in range(8)
    ]
    seeded += [(f"whatsapp:tie{i}", None, tie) for i in range(4)]  # same updated_at: the id decides
    seed_sessions(url, seeded)
    expected = [sid for sid, _, at in sorted(seeded, key=lambda s: (s[2], s[0]), reverse=True)]

    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 5, **({"cursor": cursor} if cursor else {})}
        page = client.get("/api/sessions", params=params).json()
        seen += [s["session_id"] for s in page["sessions"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert len(page["sessions"]) == 5
    assert seen == expected
    assert pages == 3  # 5 + 5 + 2
    # An exact multiple of the limit ends with a null cursor too, not with an empty page.
    assert client.get("/api/sessions", params={"limit": 12}).json()["next_cursor"] is None


def test_paging_is_stable_while_sessions_change(url: str, client: httpx.Client) -> None:
    now = datetime.now(UTC)
    seed_sessions(url, [(f"cli:{i:02}", None, now - timedelta(seconds=i)) for i in range(6)])
    first = client.get("/api/sessions", params={"limit": 3}).json()
    assert [s["session_id"] for s in first["sessions"]] == ["cli:00", "cli:01", "cli:02"]
    # A new session and a renamed one move to the front; the next page neither repeats nor skips.
    assert client.post("/api/sessions", json={"session_id": "cli:new"}).status_code == 201
    assert client.put(path_of("cli:04"), json={"title": "bumped"}).status_code == 200
    second = client.get("/api/sessions", params={"limit": 3, "cursor": first["next_cursor"]}).json()
    assert [s["session_id"] for s in second["sessions"]] == ["cli:03", "cli:05"]
    assert second["next_cursor"] is None


def test_platform_filter_is_the_id_prefix(url: str, client: httpx.Client) -> None:
    now = datetime.now(UTC)
    ids = ["telegram:1", "telegram:2:7", "telegramx:3", "TELEGRAM:4", "whatsapp:1:2", "cli:ab", "t_legram:5"]
    seed_sessions(url, [(sid, None, now - timedelta(seconds=i)) for i, sid in enumerate(ids)])

    def listed(platform: str) -> list[str]:
        answer = client.get("/api/sessions", params={"platform": platform})
        assert answer.status_code == 200
        return [s["session_id"] for s in answer.json()["sessions"]]

    assert listed("telegram") == ["telegram:1", "telegram:2:7"]
    assert listed("whatsapp") == ["whatsapp:1:2"]
    assert listed("TELEGRAM") == ["TELEGRAM:4"]
    assert listed("t_legram") == ["t_legram:5"]  # '_' is no wildcard
    assert listed("slack") == []
    items = {s["session_id"]: s["platform"] for s in client.get("/api/sessions").json()["sessions"]}
    assert items["telegram:2:7"] == "telegram"
    assert items["cli:ab"] == "cli"


def test_title_search_ignores_case_and_takes_wildcards_literally(url: str, client: httpx.Client) -> None:
    now = datetime.now(UTC)
    titles = ["Refund for ORDER 1002", "100% done", "1000 done", "a_b", "axb", "Ünïcode Straße", None]
    seed_sessions(url, [(f"cli:{i}", t, now - timedelta(seconds=i)) for i, t in enumerate(titles)])

    def found(q: str, **extra: str) -> list[str | None]:
        answer = client.get("/api/sessions", params={"q": q, **extra})
        assert answer.status_code == 200
        return [s["title"] for s in answer.json()["sessions"]]

    assert found("order") == ["Refund for ORDER 1002"]
    assert found("%") == ["100% done"]
    assert found("_") == ["a_b"]
    assert found("üNÏ") == ["Ünïcode Straße"]
    assert found("0 d") == ["1000 done"]
    assert found("00 done") == ["1000 done"]
    assert found("\\") == []
    assert found("") == [t for t in titles]  # an empty search filters nothing
    assert found("done", platform="cli", limit="1") == ["100% done"]


def test_rename_strips_and_moves_the_session_to_the_front(url: str, client: httpx.Client) -> None:
    now = datetime.now(UTC)
    # updated_at in the future: the rename must still move it forward, not back to "now".
    seed_sessions(
        url, [("cli:old", "Old", now + timedelta(hours=1)), ("cli:new", "New", now + timedelta(hours=2))]
    )
    before = client.get(path_of("cli:old")).json()
    renamed = client.put(path_of("cli:old"), json={"title": "  Billing question \u3000"})
    assert renamed.status_code == 200
    item = renamed.json()
    assert item["title"] == "Billing question"
    assert datetime.fromisoformat(item["updated_at"]) > datetime.fromisoformat(before["updated_at"])
    assert item["created_at"] == before["created_at"]
    assert client.get(path_of("cli:old")).json()["title"] == "Billing question"
    assert client.put(path_of("cli:gone"), json={"title": "x"}).status_code == 404


def test_a_renamed_title_survives_the_next_turn(url: str, client: httpx.Client) -> None:
    asyncio.run(converse(url, "telegram:42", "Where is order 1001?"))
    assert client.put(path_of("telegram:42"), json={"title": "VIP"}).status_code == 200
    asyncio.run(converse(url, "telegram:42", "Thanks"))
    assert client.get(path_of("telegram:42")).json()["title"] == "VIP"


def test_delete_takes_the_messages_and_is_idempotent(url: str, client: httpx.Client) -> None:
    asyncio.run(converse(url, "telegram:42", "Where is order 1001?"))
    asyncio.run(converse(url, "telegram:43", "Where is order 1001?"))
    assert client.delete(path_of("telegram:42")).status_code == 204
    assert client.delete(path_of("telegram:42")).status_code == 204
    assert client.delete(path_of("never:was")).status_code == 204
    counts = asyncio.run(
        run_sql(url, select(MessageRow.session_id, func.count()).group_by(MessageRow.session_id))
    )
    assert [tuple(row) for row in counts] == [("telegram:43", 4)]
    assert [s["session_id"] for s in client.get("/api/sessions").json()["sessions"]] == ["telegram:43"]


@dataclass(frozen=True)
class BlockedTurn:
    store: SQLSessionStore
    turn: asyncio.Task[RunResult]
    release: asyncio.Event


@asynccontextmanager
async def turn_held_in_the_model(url: str, session_id: str, reply: str) -> AsyncIterator[BlockedTurn]:
    """A session with one finished turn, and a second turn waiting inside its model until released."""
    entered, release = asyncio.Event(), asyncio.Event()

    class Blocking:
        async def respond(
            self, agent: Agent, history: Sequence[Message], tools: Sequence[ToolSpec]
        ) -> Message:
            entered.set()
            await release.wait()
            return Message(Role.MODEL, reply)

    store = SQLSessionStore(url)
    agent = Agent("Support", "Help.", model=OrderModel(), tools=[check_order])
    runner = Runner(agent, store)
    try:
        await runner.run_async(session_id, "Where is order 1001?")
        agent.model = Blocking()
        turn = asyncio.create_task(runner.run_async(session_id, "Are you there?"))
        async with asyncio.timeout(30):
            await entered.wait()
        yield BlockedTurn(store, turn, release)
    finally:
        release.set()
        await store.aclose()


async def test_a_turn_running_on_a_deleted_session_fails_and_writes_nothing(url: str) -> None:
    async with turn_held_in_the_model(url, "telegram:7", "too late") as blocked:
        with serve_in_thread(create_app(settings(url))) as served:
            async with httpx.AsyncClient(base_url=served, headers=AUTH) as client:
                assert (await client.delete(path_of("telegram:7"))).status_code == 204
                blocked.release.set()
                with pytest.raises(SessionDeletedError):
                    await blocked.turn
                assert (await client.get(path_of("telegram:7"))).status_code == 404
        assert await blocked.store.get("telegram:7") is None
    sessions = await run_sql(url, select(func.count()).select_from(SessionRow))
    messages = await run_sql(url, select(func.count()).select_from(MessageRow))
    assert (sessions[0][0], messages[0][0]) == (0, 0)


async def test_a_rename_made_while_a_turn_runs_is_kept(url: str) -> None:
    async with turn_held_in_the_model(url, "telegram:8", "Still here.") as blocked:
        with serve_in_thread(create_app(settings(url))) as served:
            async with httpx.AsyncClient(base_url=served, headers=AUTH) as client:
                renamed = await client.put(path_of("telegram:8"), json={"title": "Renamed mid-turn"})
                assert renamed.status_code == 200
                blocked.release.set()
                assert (await blocked.turn).content == "Still here."
                detail = (await client.get(path_of("telegram:8"))).json()
    assert detail["title"] == "Renamed mid-turn"
    assert detail["messages"][-1]["content"] == "Still here."  # the turn itself committed


# --- the inbox ----------------------------------------------------------------------------------------
def add_inbox_rows(url: str, statuses: list[str]) -> list[int]:
    async def add() -> list[int]:
        engine = create_engine(url)
        ids = []
        try:
            async with engine.begin() as conn:
                for i, status in enumerate(statuses):
                    now = datetime.now(UTC) + timedelta(seconds=i)
                    result = await conn.execute(
                        insert(InboxRow)
                        .values(
                            dedup_key=f"tg:1:{i}",
                            platform="telegram",
                            session_id="telegram:42",
                            message_id=f"42:{i}",
                            kind="text",
                            text=f"message {i}",
                            message_json={},
                            status=status,
                            attempts=5 if status == "dead" else 1,
                            next_attempt_at=now,
                            received_at=now,
                            last_error="ModelError: 503" if status == "dead" else None,
                        )
                        .returning(InboxRow.id)
                    )
                    ids.append(int(result.scalar_one()))
        finally:
            await engine.dispose()
        return ids

    return asyncio.run(add())


def test_inbox_lists_newest_first_by_status(url: str, client: httpx.Client) -> None:
    done, dead1, recorded, dead2 = add_inbox_rows(url, ["done", "dead", "recorded", "dead"])
    dead = client.get("/api/inbox", params={"status": "dead"}).json()["items"]
    assert [item["id"] for item in dead] == [dead2, dead1]
    assert dead[0] == {
        "id": dead2,
        "platform": "telegram",
        "session_id": "telegram:42",
        "kind": "text",
        "status": "dead",
        "attempts": 5,
        "text": "message 3",
        "last_error": "ModelError: 503",
        "received_at": dead[0]["received_at"],
    }
    assert datetime.fromisoformat(dead[0]["received_at"]).tzinfo is not None
    everything = client.get("/api/inbox").json()["items"]
    assert [item["id"] for item in everything] == [dead2, recorded, dead1, done]
    assert [i["id"] for i in client.get("/api/inbox", params={"limit": 2}).json()["items"]] == [
        dead2,
        recorded,
    ]


def test_retry_requeues_a_dead_row_and_refuses_the_others(url: str, client: httpx.Client) -> None:
    done, dead = add_inbox_rows(url, ["done", "dead"])
    retried = client.post(f"/api/inbox/{dead}/retry")
    assert retried.status_code == 200
    item = retried.json()
    assert (item["id"], item["status"], item["attempts"]) == (dead, "pending", 0)
    again = client.post(f"/api/inbox/{dead}/retry")
    assert (again.status_code, again.json()["error"]) == (409, "not_dead")
    assert again.json()["inbox_status"] in {"pending", "done"}  # the app's worker may have answered it
    not_dead = client.post(f"/api/inbox/{done}/retry")
    assert (not_dead.status_code, not_dead.json()["inbox_status"]) == (409, "done")
    assert client.post("/api/inbox/999999/retry").status_code == 404


# --- bad input ----------------------------------------------------------------------------------------
def b64(value: Any) -> str:
    """A cursor-shaped token holding `value`."""
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")


BAD_REQUESTS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("GET", "/api/sessions", {"params": {"limit": "abc"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"limit": "0"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"limit": "501"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"limit": "-1"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"limit": ""}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"limit": "9" * 5000}}, 422, "invalid_request"),
    ("GET", "/api/sessions?limit=1&limit=2", {}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"cursor": "not a cursor"}}, 422, "invalid_cursor"),
    ("GET", "/api/sessions", {"params": {"cursor": ""}}, 422, "invalid_cursor"),
    ("GET", "/api/sessions", {"params": {"cursor": b64([])}}, 422, "invalid_cursor"),
    ("GET", "/api/sessions", {"params": {"cursor": b64({"a": 1})}}, 422, "invalid_cursor"),
    (
        "GET",
        "/api/sessions",
        {"params": {"cursor": b64(["2024-01-01T00:00:00", "x"])}},
        422,
        "invalid_cursor",
    ),
    (
        "GET",
        "/api/sessions",
        {"params": {"cursor": b64(["0001-01-01T00:00:00+05:00", "x"])}},
        422,
        "invalid_cursor",
    ),
    (
        "GET",
        "/api/sessions",
        {"params": {"cursor": b64(["2024-01-01T00:00:00+00:00", ""])}},
        422,
        "invalid_cursor",
    ),
    (
        "GET",
        "/api/sessions",
        {"params": {"cursor": b64(["2024-01-01T00:00:00+00:00", 5])}},
        422,
        "invalid_cursor",
    ),
    ("GET", "/api/sessions", {"params": {"cursor": b64(["yesterday", "x"])}}, 422, "invalid_cursor"),
    ("GET", "/api/sessions", {"params": {"cursor": "A" * 5000}}, 422, "invalid_cursor"),
    ("GET", "/api/sessions", {"params": {"platform": "tele gram"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"platform": "telegram:"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"platform": ""}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"q": "a\x00b"}}, 422, "invalid_request"),
    ("GET", "/api/sessions", {"params": {"q": "x" * 256}}, 422, "invalid_request"),
    ("GET", "/api/sessions/%00", {}, 404, "not_found"),
    ("GET", "/api/sessions/" + "x" * 300, {}, 404, "not_found"),
    ("GET", "/api/sessions/%ED%A0%80", {}, 404, "not_found"),  # an encoded lone surrogate
    ("POST", "/api/sessions", {"content": b"{bad json"}, 400, "invalid_json"),
    ("POST", "/api/sessions", {"content": b"\xff\xfe\x00"}, 400, "invalid_json"),
    ("POST", "/api/sessions", {"content": b"[" * 60000}, 400, "invalid_json"),
    ("POST", "/api/sessions", {"content": b"1" * 5000}, 400, "invalid_json"),  # too many digits for Python
    ("POST", "/api/sessions", {"content": b"12"}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": []}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": "title"}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": 5}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": None}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": ""}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": " \t "}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": "x" * 201}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"title": "two\nlines"}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": ""}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": None}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": 5}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": ["a"]}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": "a\x00b"}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"session_id": "x" * 256}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"content": b'{"session_id": "\\ud800"}'}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"content": b'{"title": "\\udfff"}'}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"content": b'{"\\ud800": 1}'}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"json": {"titel": "typo"}}, 422, "invalid_request"),
    ("POST", "/api/sessions", {"content": b"x" * (64 * 1024 + 1)}, 413, "payload_too_large"),
    ("PUT", "/api/sessions/cli:x", {"json": {}}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"content": b""}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"json": {"title": None}}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"json": {"title": 1.5}}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"json": {"title": "x" * 201}}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"json": {"title": "ok", "extra": 1}}, 422, "invalid_request"),
    ("PUT", "/api/sessions/cli:x", {"content": b"{"}, 400, "invalid_json"),
    ("PUT", "/api/sessions/cli:x", {"content": b"{}" + b" " * (64 * 1024)}, 413, "payload_too_large"),
    ("PUT", "/api/sessions/cli:missing", {"json": {"title": "fine"}}, 404, "not_found"),
    ("GET", "/api/inbox", {"params": {"status": "bogus"}}, 422, "invalid_request"),
    ("GET", "/api/inbox", {"params": {"limit": "1e3"}}, 422, "invalid_request"),
    ("POST", "/api/inbox/abc/retry", {}, 404, "not_found"),
    ("POST", "/api/inbox/0/retry", {}, 404, "not_found"),
    ("POST", "/api/inbox/-1/retry", {}, 404, "not_found"),
    ("POST", "/api/inbox/99999999999999999999/retry", {}, 404, "not_found"),
    ("PATCH", "/api/sessions", {}, 405, "method_not_allowed"),
    ("POST", "/api/sessions/cli:x", {}, 405, "method_not_allowed"),
    ("GET", "/api/nothing-here", {}, 404, "not_found"),
]


def test_bad_input_gets_a_json_4xx_and_changes_nothing(client: httpx.Client) -> None:
    assert client.post("/api/sessions", json={"session_id": "cli:x"}).status_code == 201
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
    # Nothing of the refused requests was stored.
    listed = client.get("/api/sessions").json()["sessions"]
    assert [(s["session_id"], s["title"]) for s in listed] == [("cli:x", None)]


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_database_that_does_not_answer_gets_503(migrated_url: str) -> None:
    """Another process holds SQLite's write lock past the busy timeout: the write is refused, not a 500."""
    sqlite_url = migrated_url
    path = make_url(sqlite_url).database
    assert path is not None
    with (
        serve_in_thread(create_app(settings(sqlite_url))) as served,
        httpx.Client(base_url=served, headers=AUTH, timeout=60) as client,
    ):
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            answer = client.post("/api/sessions", json={"session_id": "cli:blocked"})
        finally:
            holder.close()
        assert answer.status_code == 503
        assert answer.json()["error"] == "database_unavailable"
        assert client.post("/api/sessions", json={"session_id": "cli:blocked"}).status_code == 201


def test_the_openapi_document_is_served_behind_the_token(base: str, client: httpx.Client) -> None:
    document = client.get("/api/openapi.json").json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == {
        "/api/sessions",
        "/api/sessions/{session_id}",
        "/api/inbox",
        "/api/inbox/{inbox_id}/retry",
        "/api/outbox",
        "/api/outbox/{outbox_id}/retry",
        "/api/usage",
        "/api/usage/sessions/{session_id}",
        "/api/openapi.json",
    }
    assert set(document["paths"]["/api/sessions/{session_id}"]) >= {"get", "put", "delete"}
    assert httpx.get(f"{base}/api/openapi.json").status_code == 401


def test_admin_writes_wait_for_the_database_not_fail(url: str, client: httpx.Client) -> None:
    """Many writes at once (SQLite has one writer) all succeed."""

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=str(client.base_url), headers=AUTH, timeout=60) as many:
            answers = await asyncio.gather(
                *(
                    many.post("/api/sessions", json={"session_id": f"cli:{i}", "title": f"t{i}"})
                    for i in range(30)
                )
            )
        return [a.status_code for a in answers]

    assert asyncio.run(burst()) == [201] * 30
    page = client.get("/api/sessions", params={"limit": 500}).json()
    assert len(page["sessions"]) == 30


def test_usage_routes_check_their_parameters(base: str, client: httpx.Client) -> None:
    """Totals themselves: tests/e2e/test_model_traffic.py (a real turn) and test_turn_usage.py."""
    assert client.get("/api/usage").json() == {"items": []}
    assert client.get("/api/usage/sessions/telegram:1/x").json() == {
        "session_id": "telegram:1/x",
        "models": [],
    }
    for params in ({"days": "0"}, {"days": "367"}, {"days": "two"}, {"day": "1"}, {"days": ["1", "2"]}):
        answer = client.get("/api/usage", params=params)
        assert answer.status_code == 422, params
        assert answer.json()["error"] == "invalid_request"
    assert client.get("/api/usage/sessions/telegram:1", params={"x": "1"}).status_code == 422
    assert httpx.get(f"{base}/api/usage").status_code == 401


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/sessions?limit=1"),
        ("POST", "/api/sessions?"),
        ("GET", "/api/sessions/cli:x?"),
        ("PUT", "/api/sessions/cli:x?"),
        ("DELETE", "/api/sessions/cli:x?"),
        ("GET", "/api/inbox?limit=1"),
        ("POST", "/api/inbox/1/retry?"),
        ("GET", "/api/outbox?limit=1"),
        ("POST", "/api/outbox/1/retry?"),
        ("GET", "/api/usage?days=1"),
        ("GET", "/api/usage/sessions/cli:x?"),
    ],
)
@pytest.mark.parametrize("extra", ["stauts=dead", "=null"], ids=["typo", "empty name"])
def test_a_query_parameter_a_route_does_not_know_is_422(
    client: httpx.Client, method: str, path: str, extra: str
) -> None:
    """Every route: a typo must not widen a list or be ignored, an empty name neither (schemathesis
    found `GET /api/inbox?limit=1&=null` answered 200)."""
    assert client.post("/api/sessions", json={"session_id": "cli:x"}).status_code == 201
    body = {"title": "t"} if method == "PUT" else ({} if method == "POST" else None)
    answer = client.request(method, f"{path}&{extra}", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_request"
    assert "unknown parameter" in answer.json()["detail"]
    assert client.get("/api/sessions/cli:x").status_code == 200  # nothing was deleted or renamed
    assert client.get("/api/sessions/cli:x").json()["title"] is None


def test_an_empty_query_pair_names_no_parameter(client: httpx.Client) -> None:
    """`?limit=1&&` (a link built by string joining) is still the list it asks for."""
    assert client.post("/api/sessions", json={"session_id": "cli:x"}).status_code == 201
    for path in ("/api/sessions?limit=1&&", "/api/inbox?limit=1&&", "/api/outbox?limit=1&&"):
        answer = client.get(path)
        assert answer.status_code == 200, (path, answer.text)
    assert [s["session_id"] for s in client.get("/api/sessions?limit=1&&").json()["sessions"]] == ["cli:x"]
