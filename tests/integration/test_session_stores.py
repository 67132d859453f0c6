"""One suite for every session store: memory, SQLite file, SQLite :memory:, PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from structlog.testing import capture_logs

from gateway.agents import (
    DEFAULT_DEDUP_TTL_HOURS,
    Agent,
    BaseSessionStore,
    Message,
    Role,
    SessionDeletedError,
    SessionStore,
    SQLiteSessionStore,
    SQLSessionStore,
    ToolCall,
)
from gateway.domain.messages import utcnow
from gateway.domain.sessions import StoredVersion
from gateway.store.tables import MessageRow, ProcessedMessageRow, SessionRow

SUPPORT = Agent("Support", "Help.")
BILLING = Agent("Billing", "Bill.")


@pytest.fixture
def store(any_store: BaseSessionStore) -> BaseSessionStore:
    any_store.set_agent_resolver({"Support": SUPPORT, "Billing": BILLING}.get)
    return any_store


def exchange(session_history: list[Message], text: str) -> None:
    """Append one complete turn with a tool exchange."""
    session_history.extend(
        [
            Message(Role.USER, text),
            Message(
                Role.MODEL,
                None,
                tool_calls=[ToolCall(f"c-{text}", "lookup", {"q": text})],
                agent_name="Support",
            ),
            Message(Role.TOOL, '{"ok": true}', tool_call_id=f"c-{text}", name="lookup", agent_name="Support"),
            Message(Role.MODEL, f"answer to {text}", agent_name="Support"),
        ]
    )


async def test_a_new_session_is_stored_by_its_first_save(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT, metadata={"platform": "telegram"})
    assert session.active_agent is SUPPORT
    assert await store.get("s1") is None
    exchange(session.history, "hi there")
    await store.save(session)
    loaded = await store.get("s1")
    assert loaded is not None
    assert [m.to_dict() for m in loaded.history] == [m.to_dict() for m in session.history]
    assert loaded.history[1].tool_calls == [ToolCall("c-hi there", "lookup", {"q": "hi there"})]
    assert loaded.metadata == {"platform": "telegram"}
    assert loaded.title == "hi there"
    assert loaded.created_at.tzinfo is not None


async def test_active_agent_is_bound_through_the_resolver(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT)
    session.active_agent = BILLING
    exchange(session.history, "refund")
    await store.save(session)
    loaded = await store.get_or_create("s1", SUPPORT)
    assert loaded.active_agent is BILLING


async def test_an_unknown_agent_name_gets_a_placeholder_and_a_warning(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", Agent("Retired", "Gone."))
    exchange(session.history, "hello")
    await store.save(session)
    if isinstance(store, SessionStore):
        pytest.skip(reason="the memory store keeps the agent object itself; nothing is resolved by name")
    with capture_logs() as logs:
        loaded = await store.get("s1")
    assert loaded is not None
    assert loaded.active_agent.name == "Retired"
    assert loaded.active_agent.tools == []
    assert any(e["event"] == "agent_unknown" and e["agent"] == "Retired" for e in logs)


async def test_metadata_given_to_get_or_create_is_merged(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT, metadata={"platform": "whatsapp", "user": "a"})
    exchange(session.history, "x")
    await store.save(session)
    again = await store.get_or_create("s1", SUPPORT, metadata={"user_name": "Ann"})
    assert again.metadata == {"platform": "whatsapp", "user": "a", "user_name": "Ann"}


async def test_max_turns_per_session_and_default(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT, max_turns=3)
    assert session.max_turns == 3
    assert (await store.get_or_create("s2", SUPPORT)).max_turns == store.default_max_turns == 40


async def test_pruned_messages_are_deleted_and_kept_ones_not_rewritten(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT, max_turns=2)
    for i in range(3):
        exchange(session.history, f"q{i}")
        session._prune_history()
        await store.save(session)
    loaded = await store.get_or_create("s1", SUPPORT, max_turns=2)
    assert [m.content for m in loaded.history if m.role is Role.USER] == ["q1", "q2"]
    if isinstance(store, SQLSessionStore):
        ids_before = await row_ids(store, "s1")
        exchange(loaded.history, "q3")
        loaded._prune_history()
        await store.save(loaded)
        ids_after = await row_ids(store, "s1")
        assert len(ids_after) == 8  # two complete turns of four messages
        kept_from_before = ids_before[4:]
        assert ids_after[:4] == kept_from_before  # the q2 turn kept its rows: not rewritten
        assert min(ids_after[4:]) > max(ids_before)  # the q3 turn was appended


async def row_ids(store: SQLSessionStore, session_id: str) -> list[int]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            select(MessageRow.id).where(MessageRow.session_id == session_id).order_by(MessageRow.position)
        )
        return list(rows.scalars())


async def test_delete_is_idempotent_and_takes_the_messages(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT)
    exchange(session.history, "x")
    await store.save(session)
    assert await store.delete("s1") is True
    assert await store.delete("s1") is False
    assert await store.get("s1") is None
    if isinstance(store, SQLSessionStore):
        assert await row_ids(store, "s1") == []


async def test_saving_a_deleted_session_fails_and_writes_nothing(store: BaseSessionStore) -> None:
    session = await store.get_or_create("s1", SUPPORT)
    exchange(session.history, "x")
    await store.save(session)
    running = await store.get_or_create("s1", SUPPORT)
    exchange(running.history, "y")
    await store.delete("s1")
    with pytest.raises(SessionDeletedError):
        await store.save(running)
    assert await store.get("s1") is None
    if isinstance(store, SQLSessionStore):
        assert await row_ids(store, "s1") == []


async def test_list_sessions_newest_first_with_paging(store: BaseSessionStore) -> None:
    for name in ["a", "b", "c"]:
        session = await store.get_or_create(name, SUPPORT)
        exchange(session.history, f"hello {name}")
        await store.save(session)
    first = await store.get_or_create("a", SUPPORT)
    exchange(first.history, "again")
    await store.save(first)  # "a" is now the newest
    listed = await store.list_sessions()
    assert [s.session_id for s in listed] == ["a", "c", "b"]
    assert listed[0].title == "hello a"
    assert listed[0].message_count == 8
    assert listed[0].active_agent_name == "Support"
    assert [s.session_id for s in await store.list_sessions(limit=1, offset=1)] == ["c"]
    assert not hasattr(listed[0], "history")


async def test_dedup_marks_once_within_the_ttl(store: BaseSessionStore) -> None:
    assert await store.is_message_processed("wa:msg:1") is False
    assert await store.mark_message_processed("wa:msg:1") is True
    assert await store.mark_message_processed("wa:msg:1") is False
    assert await store.is_message_processed("wa:msg:1") is True
    assert await store.is_message_processed("wa:msg:2") is False


async def test_dedup_key_lives_192_hours(store: BaseSessionStore) -> None:
    assert DEFAULT_DEDUP_TTL_HOURS == 192
    before = utcnow()
    await store.mark_message_processed("k")
    expires = await expiry_of(store, "k")
    assert before + timedelta(hours=192) <= expires <= utcnow() + timedelta(hours=192)


async def test_an_expired_key_is_not_processed_and_can_be_marked_again(store: BaseSessionStore) -> None:
    await store.mark_message_processed("k")
    await expire(store, "k")
    assert await store.is_message_processed("k") is False
    assert await store.mark_message_processed("k") is True
    assert await store.is_message_processed("k") is True


async def test_concurrent_marks_let_exactly_one_caller_through(store: BaseSessionStore) -> None:
    results = await asyncio.gather(*(store.mark_message_processed("tg:1:77") for _ in range(30)))
    assert results.count(True) == 1


async def test_purge_deletes_expired_keys_in_batches(store: BaseSessionStore) -> None:
    for i in range(2100):
        await store.mark_message_processed(f"old-{i}") if i < 5 else None
    await bulk_expired(store, 2100)
    await store.mark_message_processed("fresh")
    assert await store.purge_expired() == 2100
    assert await store.is_message_processed("fresh") is True
    assert await store.purge_expired() == 0


@pytest.mark.parametrize("factory", [SessionStore, lambda **kw: SQLiteSessionStore(":memory:", **kw)])
def test_constructor_validation(factory: Any) -> None:
    with pytest.raises(TypeError):
        factory(no_such_option=1)
    with pytest.raises(ValueError, match="default_max_turns"):
        factory(default_max_turns=0)


def test_sql_store_refuses_an_unknown_keyword() -> None:
    with pytest.raises(TypeError):
        SQLSessionStore("sqlite+aiosqlite:///:memory:", max_turns=3)  # type: ignore[call-arg]


# --- helpers reaching into each backend to move time forward without waiting ---------------


async def expiry_of(store: BaseSessionStore, key: str) -> Any:
    if isinstance(store, SessionStore):
        return store._processed[key]
    assert isinstance(store, SQLSessionStore)
    async with store.engine.connect() as conn:
        return await conn.scalar(
            select(ProcessedMessageRow.expires_at).where(ProcessedMessageRow.message_key == key)
        )


async def expire(store: BaseSessionStore, key: str) -> None:
    past = utcnow() - timedelta(seconds=1)
    if isinstance(store, SessionStore):
        store._processed[key] = past
        return
    assert isinstance(store, SQLSessionStore)
    async with store.engine.begin() as conn:
        await conn.execute(
            update(ProcessedMessageRow).where(ProcessedMessageRow.message_key == key).values(expires_at=past)
        )


async def bulk_expired(store: BaseSessionStore, count: int) -> None:
    past = utcnow() - timedelta(hours=1)
    if isinstance(store, SessionStore):
        for i in range(count):
            store._processed[f"old-{i}"] = past
        return
    assert isinstance(store, SQLSessionStore)
    from sqlalchemy import insert

    async with store.engine.begin() as conn:
        await conn.execute(
            update(ProcessedMessageRow)
            .where(ProcessedMessageRow.message_key.like("old-%"))
            .values(expires_at=past)
        )
        await conn.execute(
            insert(ProcessedMessageRow),
            [
                {"message_key": f"old-{i}", "platform": "x", "processed_at": past, "expires_at": past}
                for i in range(5, count)
            ],
        )


def _shared_sql_store(store: BaseSessionStore) -> SQLSessionStore:
    if not isinstance(store, SQLSessionStore) or store.engine.url.database in (None, "", ":memory:"):
        pytest.skip(
            reason="an in-memory store (or an in-memory SQLite) is one store's own: no second one can open it"
        )
    return store


async def test_a_second_store_on_the_same_database_sees_every_change(store: BaseSessionStore) -> None:
    other = SQLSessionStore(_shared_sql_store(store).engine.url.render_as_string(hide_password=False))
    try:
        first = await store.get_or_create("s1", SUPPORT)
        exchange(first.history, "one")
        await store.save(first)
        seen = await other.get("s1")  # the other store now holds these messages decoded
        assert seen is not None
        assert len(seen.history) == 4
        again = await store.get_or_create("s1", SUPPORT)
        exchange(again.history, "two")
        await store.save(again)
        fresh = await other.get("s1")
        assert fresh is not None
        assert [m.content for m in fresh.history if m.role is Role.USER] == ["one", "two"]
    finally:
        await other.aclose()


async def test_a_version_read_under_a_lease_spares_reading_the_session(store: BaseSessionStore) -> None:
    """The worker's claim reads the session's version; a store that remembers that version (or is told
    there is no row yet) reads nothing more."""
    sql = _shared_sql_store(store)
    session = await sql.get_or_create("s1", SUPPORT)
    exchange(session.history, "one")
    await sql.save(session)
    version = StoredVersion(session.updated_at)
    other = SQLSessionStore(sql.engine.url.render_as_string(hide_password=False))
    try:
        async with other.engine.begin() as conn:  # the row changes behind `sql`'s back, same version
            await conn.execute(update(SessionRow).values(metadata_json={"seen": "by the row"}))
        trusted = await sql.get_or_create("s1", SUPPORT, stored=version)
        assert trusted.metadata == {}  # the remembered copy: the row was not read
        assert len(trusted.history) == 4
        read = await sql.get_or_create("s1", SUPPORT)
        assert read.metadata == {"seen": "by the row"}
        fresh = await sql.get_or_create("s2", SUPPORT, stored=StoredVersion(None))
        assert fresh.history == []
    finally:
        await other.aclose()


async def test_a_stale_version_cannot_overwrite_another_stores_turn(store: BaseSessionStore) -> None:
    """Should a claim ever read a version older than the newest (a PostgreSQL snapshot taken just
    before another process's commit), the turn built on the stale copy fails to commit: the next
    message position is taken, so nothing of the other turn is lost."""
    sql = _shared_sql_store(store)
    other = SQLSessionStore(sql.engine.url.render_as_string(hide_password=False))
    try:
        first = await sql.get_or_create("s1", SUPPORT)
        exchange(first.history, "one")
        await sql.save(first)
        stale = StoredVersion(first.updated_at)
        later = await other.get_or_create("s1", SUPPORT)
        exchange(later.history, "two")
        await other.save(later)
        behind = await sql.get_or_create("s1", SUPPORT, stored=stale)
        exchange(behind.history, "three")
        with pytest.raises((sqlite3.IntegrityError, IntegrityError)):
            await sql.save(behind)
        kept = await other.get("s1")
        assert kept is not None
        assert [m.content for m in kept.history if m.role is Role.USER] == ["one", "two"]
    finally:
        await other.aclose()


async def test_concurrent_first_calls_check_the_schema_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of turns reaching a new store at once (2,000 model answers arriving together) ran the
    schema check once per caller, each on a connection of its own: 0.7 s in which no reply went out."""
    from gateway.store import migrations

    checks = 0
    real_check = migrations.ensure_head

    async def counted(target: Any) -> None:
        nonlocal checks
        checks += 1
        await real_check(target)

    monkeypatch.setattr(migrations, "ensure_head", counted)
    store = SQLSessionStore(f"sqlite+aiosqlite:///{tmp_path / 'burst.db'}")
    try:
        found = await asyncio.gather(*(store.get(f"s{i}") for i in range(50)))
        assert found == [None] * 50
        assert checks == 1
        await store.get("s0")
        assert checks == 1
    finally:
        await store.aclose()
