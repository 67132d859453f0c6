"""Pacing with a fake clock: bursts are spread, limits combine, idle keys are forgotten."""

from __future__ import annotations

from typing import cast

import pytest

from gateway.worker.pacing import Pacer, interval


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_to_one_chat_is_spread_one_per_interval() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    waits = [pacer.reserve([("chat:1", 1.0)]) for _ in range(4)]
    assert waits == [0.0, 1.0, 2.0, 3.0]


def test_other_chats_only_share_the_global_limit() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    assert pacer.reserve([("chat:1", 1.0), ("global", 0.1)]) == 0.0
    assert pacer.reserve([("chat:2", 1.0), ("global", 0.1)]) == pytest.approx(0.1)
    assert pacer.reserve([("chat:1", 1.0), ("global", 0.1)]) == pytest.approx(1.0)


def test_time_passing_frees_the_slots() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    pacer.reserve([("chat:1", 3.0)])
    clock.now += 5
    assert pacer.reserve([("chat:1", 3.0)]) == 0.0


def test_zero_means_unlimited_and_rates_become_intervals() -> None:
    pacer = Pacer(Clock())
    assert [pacer.reserve([("k", 0.0)]) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert interval(20, 60) == 3.0
    assert interval(30, 1) == pytest.approx(1 / 30)
    assert interval(0, 1) == 0.0


def test_idle_keys_are_forgotten() -> None:
    clock = Clock()
    pacer = Pacer(clock)
    for n in range(100):
        pacer.reserve([(f"chat:{n}", 1.0)])
    clock.now += 7200
    pacer.reserve([("chat:new", 1.0)])
    assert len(pacer._next_free) == 1


def test_limits_per_platform_and_chat_kind() -> None:
    from gateway.domain.outbound import TelegramTarget, WhatsAppTarget
    from gateway.platforms.telegram.spec import TELEGRAM, TelegramSettings
    from gateway.platforms.whatsapp.spec import WHATSAPP, WhatsAppSettings
    from gateway.worker.pacing import PacingLimits

    limits = PacingLimits(
        {
            "telegram": TELEGRAM.pacing(
                TelegramSettings(chat_per_second=1, group_per_minute=20, global_per_second=30)
            ),
            "whatsapp": WHATSAPP.pacing(WhatsAppSettings(global_per_second=80)),
        }
    )
    assert limits.limits("telegram", TelegramTarget(chat_id="42")) == [
        ("telegram:chat:42", 1.0),
        ("telegram:global", pytest.approx(1 / 30)),
    ]
    assert limits.limits("telegram", TelegramTarget(chat_id="-100123"))[0] == ("telegram:chat:-100123", 3.0)
    assert limits.limits("whatsapp", WhatsAppTarget(chat_id="US.1")) == [
        ("whatsapp:global", cast(object, pytest.approx(1 / 80)))
    ]
    assert limits.limits("elsewhere", WhatsAppTarget(chat_id="US.1")) == []  # no rule: not paced
