"""Who the bot is, for deciding which group messages are meant for it: its username, from getMe.

A privacy-mode bot still receives `@bot` mentions, replies to it and `/command@bot` in groups, but
only its username tells a mention of it from a mention of someone else. The token gives the bot's id,
never its username, so the gateway asks getMe at start-up, retrying with backoff while the Bot API is
unreachable (GATEWAY_TELEGRAM_BOT_USERNAME names it instead where the API cannot be reached at start).

Refresh on failure: when a group message addresses a bot (`@…bot`, `/cmd@…bot`) by a username that is
not the one known, the username may have changed (collectible usernames can be moved), so getMe is
asked again, at most once per `min_refresh_seconds`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from gateway.platforms.telegram.api import TelegramAPI, TelegramAPIError

log = structlog.get_logger(__name__)

FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 60.0
MIN_REFRESH_SECONDS = 300.0
BOT_SUFFIX = "bot"  # every bot's username ends so (BotFather's rule), whatever the case


class BotIdentity:
    """The bot's username as the adapter compares it (casefolded, no "@"); None until known."""

    def __init__(self, username: str | None = None) -> None:
        self.username = normalized(username)
        self.learned = asyncio.Event()  # set each time getMe answers; cleared by whoever waits for the next
        self._refresh = asyncio.Event()

    def learn(self, username: str) -> bool:
        """Set the username; whether it changed."""
        new = normalized(username)
        changed = new != self.username
        self.username = new
        self.learned.set()
        return changed

    def unrecognized(self, name: str) -> None:
        """A group message addressed `@name`, which is a bot's name but not ours: ask getMe again."""
        if name.casefold().endswith(BOT_SUFFIX) and name.casefold() != self.username:
            self._refresh.set()

    async def refresh_wanted(self) -> None:
        await self._refresh.wait()
        self._refresh.clear()


def normalized(username: str | None) -> str | None:
    return username.removeprefix("@").casefold() or None if username else None


async def keep_identity(
    api: TelegramAPI,
    identity: BotIdentity,
    *,
    first_retry_seconds: float = FIRST_RETRY_SECONDS,
    max_retry_seconds: float = MAX_RETRY_SECONDS,
    min_refresh_seconds: float = MIN_REFRESH_SECONDS,
) -> None:
    """Learn the username from getMe, retrying until it answers; then again whenever it is in doubt.

    Runs until cancelled (the gateway's shutdown). Never raises for the Bot API's failures.
    """
    source = "getMe"
    while True:
        me = await _get_me(api, first_retry_seconds, max_retry_seconds)
        username = me["username"]
        changed = identity.learn(username)
        if changed or source == "getMe":
            log.info(
                "telegram_bot_identity",
                bot_username=username,
                source=source,
                # Privacy mode on: in groups the bot gets mentions, replies and commands only.
                reads_all_group_messages=me.get("can_read_all_group_messages") is True,
            )
        source = "getMe refresh"
        await identity.refresh_wanted()
        if min_refresh_seconds > 0:
            await asyncio.sleep(min_refresh_seconds)  # a rate limit on getMe, not a synchronization


async def _get_me(api: TelegramAPI, first_retry: float, max_retry: float) -> dict[str, Any]:
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(TelegramAPIError),
        wait=wait_exponential(multiplier=first_retry, max=max_retry),
        before_sleep=_log_retry,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return _bot(await api.call("getMe"))
    raise AssertionError("unreachable: tenacity retries until getMe answers")  # pragma: no cover


def _bot(result: Any) -> dict[str, Any]:
    """getMe's User; TelegramAPIError (retried) when it is not a bot with a username."""
    if not isinstance(result, dict) or not isinstance(result.get("username"), str) or not result["username"]:
        raise TelegramAPIError("getMe", None, "the answer names no bot username")
    return result


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    code = error.code if isinstance(error, TelegramAPIError) else None
    description = error.description[:200] if isinstance(error, TelegramAPIError) else type(error).__name__
    log.warning(
        "telegram_get_me_failed",
        attempt=state.attempt_number,
        retry_in_s=round(state.upcoming_sleep, 1),
        code=code,
        error=description,
        consequence="group messages that @mention the bot are recorded, not answered, until it succeeds",
    )
