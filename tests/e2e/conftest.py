"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes import FakeOpenAI, FakeTelegram
from tests.helpers import serve_in_thread


@pytest.fixture
def fakes(request: pytest.FixtureRequest) -> Iterator[tuple[FakeOpenAI, str, FakeTelegram, str]]:
    """A fake OpenAI-compatible model and a fake Telegram Bot API (for the test module's BOT_TOKEN), each
    served on loopback: (model, its URL, telegram, its URL)."""
    model, telegram = FakeOpenAI(), FakeTelegram(request.module.BOT_TOKEN)
    with serve_in_thread(model.app) as model_url, serve_in_thread(telegram.app) as telegram_url:
        yield model, model_url, telegram, telegram_url
