"""ProviderBudget: calls wait, in arrival order, for room under concurrency, RPM, TPM and 429 pauses."""

from __future__ import annotations

import asyncio

import pytest

from gateway.agents.models.breaker import OPEN_AFTER, ProviderDown
from gateway.agents.models.budget import DEFAULT_429_PAUSE_SECONDS, ProviderBudget, estimate_tokens


class FakeTime:
    """A clock that only moves when the budget sleeps: start times are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def budget(time: FakeTime, **limits: int) -> ProviderBudget:
    return ProviderBudget("test", clock=time.clock, sleep=time.sleep, **limits)


async def test_rpm_spaces_requests_evenly() -> None:
    time = FakeTime()
    limited = budget(time, rpm=60)
    starts = []
    for _ in range(4):
        async with limited.call():
            starts.append(time.now)
    assert starts == [0.0, 1.0, 2.0, 3.0]


async def test_a_429_pauses_every_later_call() -> None:
    time = FakeTime()
    limited = budget(time)
    limited.pause(5)
    async with limited.call():
        assert time.now == 5.0
    limited.pause(None)  # no Retry-After: a short default pause
    async with limited.call():
        assert time.now == 5.0 + DEFAULT_429_PAUSE_SECONDS


async def test_tpm_waits_until_the_oldest_calls_leave_the_minute() -> None:
    time = FakeTime()
    limited = budget(time, tpm=100)
    async with limited.call(60) as first:
        pass
    limited.spend(first, 70)  # the provider counted more than the estimate
    async with limited.call(20):
        assert time.now == 0.0  # 70 + 20 fit
    async with limited.call(20):
        assert time.now == 60.0  # 70 + 20 + 20 do not: wait for the first call to leave the window
    async with limited.call(500):
        assert time.now == 120.0  # larger than the whole budget: waits for an empty window


async def test_a_call_larger_than_the_budget_goes_alone() -> None:
    time = FakeTime()
    limited = budget(time, tpm=100)
    async with limited.call(500):
        assert time.now == 0.0
    async with limited.call(1):
        assert time.now == 60.0


async def test_concurrency_is_bounded_and_waiters_go_in_arrival_order() -> None:
    limited = ProviderBudget("test", max_concurrency=2)
    release = asyncio.Event()
    two_in = asyncio.Event()
    admitted: list[int] = []

    async def call(number: int) -> None:
        async with limited.call():
            admitted.append(number)
            if len(admitted) == 2:
                two_in.set()
            await release.wait()

    tasks = [asyncio.create_task(call(n)) for n in range(6)]
    await two_in.wait()  # set in the loop iteration that started all six, so all four others wait
    assert limited.in_flight == 2
    assert limited.waiting == 4
    release.set()
    await asyncio.gather(*tasks)
    assert admitted == list(range(6))
    assert limited.max_in_flight == 2
    assert limited.in_flight == limited.waiting == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    limited = ProviderBudget("test", max_concurrency=1)
    held = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        async with limited.call():
            held.set()
            await release.wait()

    first = asyncio.create_task(holder())
    await held.wait()
    waiter = asyncio.create_task(limited.call().__aenter__())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    await first
    async with limited.call():  # the slot is free again: a cancelled waiter did not keep it
        assert limited.in_flight == 1


def test_limits_are_checked_and_tokens_estimated() -> None:
    with pytest.raises(ValueError, match="unlimited"):
        ProviderBudget("test", rpm=-1)
    assert estimate_tokens(0) == 1
    assert estimate_tokens(4000) == 1000


async def test_a_provider_that_keeps_failing_is_held_back_then_probed() -> None:
    time = FakeTime()
    limited = budget(time)
    for _ in range(OPEN_AFTER):
        async with limited.call():
            limited.breaker.failed()
    with pytest.raises(ProviderDown):  # open: no call goes out
        async with limited.call():
            pass
    time.now += 1.0  # the first cooldown
    async with limited.call():  # the probe
        with pytest.raises(ProviderDown):  # while it runs, the others still fail fast
            async with limited.call():
                pass
        limited.breaker.failed()
    time.now += 1.0
    with pytest.raises(ProviderDown):  # the failed probe doubled the cooldown
        async with limited.call():
            pass
    time.now += 1.0
    async with limited.call():
        limited.breaker.succeeded()
    for _ in range(3):
        async with limited.call():  # closed again: calls go
            pass
    assert not limited.breaker.open


async def test_answers_between_failures_keep_the_breaker_closed() -> None:
    limited = ProviderBudget("test")
    for _ in range(3 * OPEN_AFTER):
        async with limited.call():
            limited.breaker.failed()
        async with limited.call():
            limited.breaker.succeeded()
    assert not limited.breaker.open


async def test_a_process_keeps_its_share_of_the_rpm_and_tpm() -> None:
    time = FakeTime()
    limited = budget(time, rpm=60, tpm=100)
    limited.share_among(2)  # two processes on the database: each spaces at 30 RPM, counts 50 TPM
    starts = []
    for _ in range(3):
        async with limited.call(10):
            starts.append(time.now)
    assert starts == [0.0, 2.0, 4.0]
    async with limited.call(30):
        assert time.now == 60.0  # 30 + 30 > 50: waits for the first calls to leave the minute
    limited.share_among(1)  # the other process left: the whole budget again
    async with limited.call(10):
        assert time.now == 62.0  # the slot reserved under the old share stands
    async with limited.call(10):
        assert time.now == 63.0  # then one a second


async def test_a_process_keeps_its_share_of_the_calls_in_flight_and_at_least_one() -> None:
    limited = ProviderBudget("test", max_concurrency=4)
    limited.share_among(2)
    release = asyncio.Event()
    entered = asyncio.Queue[int]()

    async def call(number: int) -> None:
        async with limited.call():
            entered.put_nowait(number)
            await release.wait()

    tasks = [asyncio.create_task(call(n)) for n in range(4)]
    assert [await entered.get(), await entered.get()] == [0, 1]
    await asyncio.sleep(0)  # the third waits for a slot, not for a turn of the loop
    assert (limited.in_flight, limited.waiting) == (2, 2)
    limited.share_among(1)  # a larger share lets the waiters in at once
    assert [await entered.get(), await entered.get()] == [2, 3]
    limited.share_among(10)  # more processes than slots: each keeps one
    release.set()
    await asyncio.gather(*tasks)
    assert limited.max_in_flight == 4
    async with limited.call():
        assert limited.in_flight == 1
    assert "processes=10" in repr(limited)
    assert limited.limited
    assert not ProviderBudget("unlimited").limited
