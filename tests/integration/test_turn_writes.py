"""A save writes its messages and prunes with a few multi-row statements: more rows than one takes."""

from __future__ import annotations

from gateway.agents import Agent, Message, Role, SQLSessionStore
from gateway.store.sessions import ROWS_PER_STATEMENT


async def test_a_save_larger_than_one_statement_writes_and_prunes_every_row(database_url: str) -> None:
    store = SQLSessionStore(database_url)
    agent = Agent("Support", "s")
    try:
        turns = ROWS_PER_STATEMENT + 11  # 2 messages a turn: more than two statements' worth
        session = await store.get_or_create("telegram:7", agent)
        for n in range(turns):
            session.history.append(Message(Role.USER, f"question {n}"))
            session.history.append(Message(Role.MODEL, f"answer {n}"))
        await store.save(session)
        reader = SQLSessionStore(database_url)  # another store: read from the database, not a cache
        loaded = await reader.get("telegram:7")
        await reader.aclose()
        assert loaded is not None
        assert [m.content for m in loaded.history] == [m.content for m in session.history]
        assert [m.position for m in loaded.history] == list(range(2 * turns))

        session.max_turns = 3
        session._prune_history()  # deletes 2 * (turns - 3) positions in one save
        session.history.append(Message(Role.USER, "one more"))
        await store.save(session)
        reader = SQLSessionStore(database_url)
        again = await reader.get("telegram:7")
        await reader.aclose()
        assert again is not None
        assert [m.content for m in again.history] == [
            f"question {turns - 3}",
            f"answer {turns - 3}",
            f"question {turns - 2}",
            f"answer {turns - 2}",
            f"question {turns - 1}",
            f"answer {turns - 1}",
            "one more",
        ]
        assert again.history[-1].position == 2 * turns
    finally:
        await store.aclose()
