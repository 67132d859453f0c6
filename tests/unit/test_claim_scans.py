"""How often a claim loop scans every due head, how many rows a claim takes, and that it runs a row once
(gateway/worker/claim_loop.py).

While hinted claims keep taking rows, a scan of every due head runs at most every BUSY_SCAN_SECONDS
(on PostgreSQL under a held snapshot each one reads the whole due index); an idle loop, whose rows can
only come from other processes, keeps scanning every IDLE_POLL_SECONDS. The loop runs for real on
fake claims; the intervals are shortened so the test takes about two seconds.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from gateway.worker import claim_loop
from gateway.worker.claim_loop import ClaimLoop

IDLE = 0.05
BUSY = 0.4


@dataclass(frozen=True)
class Row:
    id: int
    session_id: str


async def scan_gaps(hinted_work: bool, scans_wanted: int) -> list[float]:
    """The loop's times between consecutive scans, with a conversation that always has a row due (the
    processed row's conversation is hinted again when it finishes) or with nothing to claim."""
    loop = asyncio.get_running_loop()
    scans: list[float] = []
    enough = asyncio.Event()
    numbers = iter(range(10**9))

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        if sessions is None:
            scans.append(loop.time())
            if len(scans) >= scans_wanted:
                enough.set()
        # With work, the one conversation always has its next row due, whoever looks for it.
        return [Row(next(numbers), "telegram:1")] if hinted_work else []

    async def process(row: Row) -> None:
        await asyncio.sleep(0)

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 1, renew=held, release=held)
    loop_under_test.wake(["telegram:1"])
    await run_until(loop_under_test, enough)
    return [b - a for a, b in itertools.pairwise(scans)]


async def held(ids: list[int]) -> set[int]:
    """Renewal and release of fake rows: every row is still held."""
    return set(ids)


async def run_until(loop_under_test: ClaimLoop[Row], event: asyncio.Event) -> None:
    """Run the loop until `event` is set (10 s at most), then stop it."""
    running = asyncio.create_task(loop_under_test.run())
    try:
        async with asyncio.timeout(10):
            await event.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


@pytest.fixture(autouse=True)
def short_intervals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claim_loop, "IDLE_POLL_SECONDS", IDLE)
    monkeypatch.setattr(claim_loop, "BUSY_SCAN_SECONDS", BUSY)


async def test_scans_are_rare_while_hinted_claims_take_rows() -> None:
    gaps = await scan_gaps(hinted_work=True, scans_wanted=4)
    assert min(gaps[1:]) >= BUSY * 0.95, gaps  # the first scan ran before any hinted claim


async def test_an_idle_loop_keeps_scanning_every_poll() -> None:
    gaps = await scan_gaps(hinted_work=False, scans_wanted=6)
    assert max(gaps) < BUSY, gaps


async def test_a_row_already_running_is_not_started_again() -> None:
    """A row the store hands on (`adopt`) while the loop's own claim took it too, or the other way
    round, runs once: run twice, a reply would be sent twice."""
    started: list[int] = []
    second_done = asyncio.Event()
    claimed_once = False

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        nonlocal claimed_once
        if claimed_once:
            return []
        claimed_once = True
        return [Row(1, "telegram:1")]

    async def process(row: Row) -> None:
        started.append(row.id)
        if row.id == 1:
            loop_under_test.adopt(Row(1, "telegram:1"), after=1)  # the same row again: ignored
            loop_under_test.adopt(Row(2, "telegram:1"), after=1)  # the next one: started
        else:
            second_done.set()

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 4, renew=held, release=held)
    await run_until(loop_under_test, second_done)
    assert started == [1, 2]


async def test_a_conversation_whose_commit_saw_nothing_waiting_is_not_looked_at_again() -> None:
    """When a row ends, its conversation is looked at again (its next row may be waiting), except
    when its commit saw nothing waiting (`nothing_waiting`) and nothing was stored here for it since
    (`wake` while it ran): under a held snapshot such a look-up walks every version of the head
    for nothing. Rows other processes store meanwhile are found by the scans."""
    rows = {session: Row(n, session) for n, session in enumerate(("telegram:1", "telegram:2", "telegram:3"))}
    hinted: list[list[str]] = []
    all_started, finish, looked_again = asyncio.Event(), asyncio.Event(), asyncio.Event()
    started = 0

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        if sessions is None:  # the first scan takes the three rows
            return [] if started else list(rows.values())
        hinted.append(list(sessions))
        looked_again.set()
        return []

    async def process(row: Row) -> None:
        nonlocal started
        started += 1
        if started == len(rows):
            all_started.set()
        await finish.wait()
        if row.session_id != "telegram:3":  # its commit asked to hand on and saw nothing waiting
            loop_under_test.nothing_waiting(row.id)

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 4, renew=held, release=held)
    running = asyncio.create_task(loop_under_test.run())
    try:
        async with asyncio.timeout(10):
            await all_started.wait()
            loop_under_test.wake(["telegram:2"])  # a message of conversation 2 stored while it runs
            finish.set()
            await looked_again.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert hinted == [["telegram:2", "telegram:3"]]


async def test_a_row_handed_on_from_another_task_ends_its_conversations_look() -> None:
    """Delivery records a sent reply in a task of its own, which adopts the reply it handed on: the
    sent reply's end must not send a claim to look at the conversation (its next row runs here)."""
    hinted: list[list[str]] = []
    second_started, scans_after, looked_again = asyncio.Event(), asyncio.Event(), asyncio.Event()
    finish_second = asyncio.Event()
    scans = 0

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        nonlocal scans
        if sessions is None:
            scans += 1
            if second_started.is_set() and scans >= 3:  # the loop went round with the second row running
                scans_after.set()
            return [Row(1, "telegram:1")] if scans == 1 else []
        hinted.append(list(sessions))
        if finish_second.is_set():
            looked_again.set()
        return []

    async def adopt_the_next() -> None:
        loop_under_test.adopt(Row(2, "telegram:1"), after=1)

    async def process(row: Row) -> None:
        if row.id == 1:
            await asyncio.create_task(adopt_the_next())
        else:
            second_started.set()
            await finish_second.wait()

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 4, renew=held, release=held)
    running = asyncio.create_task(loop_under_test.run())
    try:
        async with asyncio.timeout(10):
            await scans_after.wait()
            finish_second.set()
            await looked_again.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert hinted == [["telegram:1"]]  # when the second row ended, not when the first did


@pytest.mark.parametrize("waiting", [1000, 2000])
async def test_claims_take_bounded_batches_and_leave_no_rest_behind(waiting: int) -> None:
    """With 2,000 turns allowed in flight and every turn waiting on its model, rows start in claims of
    at most MAX_CLAIM_ROWS (a claim of hundreds started them all in one stretch of the event loop, and
    acknowledgements waited behind it), and the last claim takes the rest whole: a rest smaller than a
    claim's threshold waited for a turn to finish, seconds later."""
    rows = [Row(n, f"telegram:{n}") for n in range(waiting)]
    limits: list[int] = []
    started: list[int] = []
    all_started = asyncio.Event()
    model_answers = asyncio.Event()  # never set: every turn stays in flight

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        limits.append(limit)
        taken, rows[:limit] = rows[:limit], []
        return taken

    async def process(row: Row) -> None:
        started.append(row.id)
        if len(started) == waiting:
            all_started.set()
        await model_answers.wait()

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 2000, renew=held, release=held)
    loop_under_test.wake([row.session_id for row in rows])
    await run_until(loop_under_test, all_started)
    assert sorted(started) == list(range(waiting))
    assert max(limits) <= 128, limits  # ~0.1 s of turn starts at most, not the whole backlog


async def test_a_conversation_running_here_is_looked_at_again_when_its_row_ends_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message stored for a conversation whose turn runs in this process cannot be claimed before that
    turn ends (its head is leased to it); a hinted claim looking there anyway reads the head for nothing
    (on PostgreSQL under a held snapshot, one page per version the head kept). Its turn's end names the
    conversation again, and a claim then takes the row. The other conversation, named while the loop's
    scan ran, is not forgotten when that scan ends: the scan may have read before its row was stored."""
    monkeypatch.setattr(claim_loop, "IDLE_POLL_SECONDS", 5.0)  # hinted claims only, after the first scans
    heads: dict[str, list[Row]] = {"telegram:1": [Row(1, "telegram:1")]}  # each conversation's rows
    leased: set[str] = set()
    hinted: list[str] = []
    claims = 0
    idle = asyncio.Event()  # the scans after the first row found nothing more
    other_done = asyncio.Event()
    first_may_end = asyncio.Event()
    done: list[int] = []
    all_done = asyncio.Event()

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        nonlocal claims
        claims += 1
        hinted.extend(sessions or ())
        looked = list(heads) if sessions is None else [s for s in sessions if s in heads]
        taken = [heads[s][0] for s in looked if heads[s] and s not in leased][:limit]
        leased.update(row.session_id for row in taken)
        if claims == 2:
            idle.set()
        return taken

    async def process(row: Row) -> None:
        if row.id == 1:
            await first_may_end.wait()
        heads[row.session_id].remove(row)
        leased.discard(row.session_id)
        done.append(row.id)
        if row.id == 3:
            other_done.set()
        if len(done) == 3:
            all_done.set()

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 4, renew=held, release=held)
    running = asyncio.create_task(run_until(loop_under_test, all_done))
    await idle.wait()  # the scans have run: what is stored now can only be found by a hint
    heads["telegram:1"].append(Row(2, "telegram:1"))  # the webhooks stored a row for each
    heads["telegram:2"] = [Row(3, "telegram:2")]
    loop_under_test.wake(["telegram:1", "telegram:2"])
    async with asyncio.timeout(5):
        await other_done.wait()  # telegram:2's row ran while telegram:1's still did
    hinted_while_running = list(hinted)
    first_may_end.set()
    await running
    assert sorted(done) == [1, 2, 3]
    assert hinted_while_running.count("telegram:1") == 0, hinted_while_running


async def test_a_hinted_claim_names_a_dozen_conversations_and_the_next_claims_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On PostgreSQL a claim of dozens of hinted heads was planned as a join over the whole heads table:
    each claim names at most MAX_HINTS_PER_CLAIM conversations, and none of the hinted ones is lost.
    (No scan runs after the first one here: a scan would take every due head, hinted or not.)"""
    monkeypatch.setattr(claim_loop, "IDLE_POLL_SECONDS", 60.0)
    monkeypatch.setattr(claim_loop, "BUSY_SCAN_SECONDS", 60.0)
    hinted: list[list[str]] = []
    waiting = {f"telegram:{n}" for n in range(40)}
    scanned, all_taken = asyncio.Event(), asyncio.Event()
    numbers = iter(range(10**9))

    async def claim(limit: int, sessions: Sequence[str] | None) -> list[Row]:
        if sessions is None:  # the loop's first look, before anything is stored
            scanned.set()
            return []
        hinted.append(list(sessions))
        taken = [Row(next(numbers), s) for s in sessions if s in waiting]
        waiting.difference_update(sessions)
        if not waiting:
            all_taken.set()
        return taken

    async def process(row: Row) -> None:
        await asyncio.sleep(0)

    loop_under_test: ClaimLoop[Row] = ClaimLoop("test", claim, process, 2000, renew=held, release=held)
    running = asyncio.create_task(loop_under_test.run())
    try:
        async with asyncio.timeout(10):
            await scanned.wait()
            loop_under_test.wake(sorted(waiting))
            await all_taken.wait()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert max(len(names) for names in hinted) == claim_loop.MAX_HINTS_PER_CLAIM == 12
    # Three claims of 12, then the last 4 (with conversations whose rows ended meanwhile).
    assert {name for names in hinted[:4] for name in names} >= {f"telegram:{n}" for n in range(40)}
