"""The admin API's throttle of wrong tokens, on a clock the test moves: lockout, its end, bounded state."""

from __future__ import annotations

from gateway.web.throttle import FailureThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ten_failures_in_a_window_lock_the_address_out_for_the_window() -> None:
    clock = Clock()
    throttle = FailureThrottle(max_failures=10, window=60, clock=clock)
    locked = [throttle.failed("10.0.0.1") for _ in range(10)]
    assert locked == [False] * 9 + [True]  # True once: the moment to log it
    assert throttle.retry_after("10.0.0.1") == 60
    clock.now += 59.5
    assert throttle.retry_after("10.0.0.1") == 0.5
    clock.now += 0.5
    assert throttle.retry_after("10.0.0.1") is None
    assert throttle.failed("10.0.0.1") is False  # a fresh count after the lockout


def test_failures_spread_over_more_than_a_window_never_lock_out() -> None:
    clock = Clock()
    throttle = FailureThrottle(max_failures=10, window=60, clock=clock)
    for _ in range(100):
        assert throttle.failed("10.0.0.2") is False
        clock.now += 7  # 9 failures a minute at most
    assert throttle.retry_after("10.0.0.2") is None


def test_a_success_forgets_the_failures_and_other_addresses_are_untouched() -> None:
    throttle = FailureThrottle(max_failures=3, window=60, clock=Clock())
    throttle.failed("10.0.0.3")
    throttle.failed("10.0.0.3")
    throttle.succeeded("10.0.0.3")
    assert [throttle.failed("10.0.0.3") for _ in range(3)] == [False, False, True]
    assert throttle.retry_after("10.0.0.4") is None


def test_the_state_is_bounded_whatever_the_number_of_addresses() -> None:
    throttle = FailureThrottle(max_failures=10, window=60, max_clients=1000, clock=Clock())
    for n in range(50_000):
        throttle.failed(f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}")
    assert len(throttle) == 1000


def test_an_ipv6_client_is_one_slash_64() -> None:
    """Anyone with one IPv6 address has the whole /64 around it: counting each address apart would
    give them 2**64 fresh starts."""
    throttle = FailureThrottle(max_failures=2, window=60, clock=Clock())
    assert throttle.failed("2001:db8:0:1::1") is False
    assert throttle.failed("2001:db8:0:1:ffff::2") is True
    assert throttle.retry_after("2001:db8:0:1::99") == 60
    assert throttle.retry_after("2001:db8:0:2::1") is None
