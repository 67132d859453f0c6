"""The composition root: the one place that turns settings into engines, clients and services."""

from __future__ import annotations

import asyncio
import gc
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import httpx
import structlog

from gateway.agents import Agent, Runner, SQLSessionStore
from gateway.agents.models.registry import model_factory_from_settings
from gateway.domain.inbound import MessageKind
from gateway.errors import SettingsError
from gateway.http_client import http_client
from gateway.platforms import local_key
from gateway.platforms.base import PlatformAdapter, Sender
from gateway.platforms.registry import PLATFORMS, enabled_adapters, local_adapters, webhook_secret
from gateway.platforms.telegram_api import TelegramAPI, TelegramSender
from gateway.platforms.whatsapp_api import WhatsAppSender
from gateway.settings import Settings
from gateway.store.database import Database
from gateway.store.ingest import Ingest
from gateway.worker.inbox import InboxWorker
from gateway.worker.maintenance import purge_dedup_keys_periodically
from gateway.worker.outbound import OutboxDelivery
from gateway.worker.pacing import PacingLimits

HTTP_TIMEOUT_SECONDS = 30  # outbound calls to the platforms (and the model providers)
# The interpreter's GIL switch interval (5 ms by default): each statement of a commit releases the GIL
# on the SQLite writer thread, which then waits for it while the event loop runs, up to a whole
# interval per statement. 1 ms gave ~15% more acks/s.
SWITCH_INTERVAL_SECONDS = 0.001
GC_THRESHOLDS = (10_000, 20, 20)  # Python's defaults are (700, 10, 10)

log = structlog.get_logger("gateway.bootstrap")


@dataclass(frozen=True)
class Services:
    """Everything long-lived that the app's lifespan owns, starts and closes."""

    settings: Settings
    database: Database
    adapters: dict[str, PlatformAdapter]
    local_adapters: dict[str, PlatformAdapter]  # the local mode's, for platforms without a secret
    ingest: Ingest
    worker: InboxWorker
    delivery: OutboxDelivery
    http: httpx.AsyncClient
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        self.tasks.append(
            asyncio.create_task(purge_dedup_keys_periodically(self.database), name="dedup-purge")
        )
        self.tasks.append(asyncio.create_task(self.worker.run(), name="inbox-worker"))
        self.tasks.append(asyncio.create_task(self.delivery.run(), name="outbox-delivery"))

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        await self.worker.runner.session_store.aclose()
        await self.http.aclose()
        await self.database.aclose()


def build_services(settings: Settings) -> Services:
    """Everything `gateway serve` runs (and `gateway worker`, which leaves the webhooks out)."""
    database = Database.open(settings.database_url)
    http = http_client(HTTP_TIMEOUT_SECONDS)
    delivery = OutboxDelivery(database, build_senders(settings, http), pacing=build_pacing(settings))
    ingest = Ingest(database, timedelta(hours=settings.dedup_ttl_hours))
    runner = build_runner(settings, database)
    worker = build_worker(settings, database, runner, delivery, busy=lambda: ingest.busy)
    return Services(
        settings=settings,
        database=database,
        adapters=enabled_adapters(settings),
        local_adapters=build_local_adapters(settings),
        ingest=ingest,
        worker=worker,
        delivery=delivery,
        http=http,
    )


def build_local_adapters(settings: Settings) -> dict[str, PlatformAdapter]:
    """The local mode (see `gateway.platforms.local_key`): off when turned off, or when the key
    file cannot be written (a read-only container), since it is only a convenience."""
    disabled = [platform for platform in PLATFORMS if webhook_secret(settings, platform) is None]
    if not settings.local_key_file or not disabled:
        return {}
    path = Path(settings.local_key_file)
    try:
        key = local_key.load_or_create(path)
    except (OSError, ValueError) as exc:
        log.warning("local_mode_off", key_file=str(path), reason=str(exc))
        return {}
    log.info("local_mode_on", platforms=disabled, key_file=str(path))
    return local_adapters(settings, key)


def tune_interpreter() -> None:
    """Process-wide settings for a long-running gateway process (`serve`, `worker`), made once."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_SECONDS))


def freeze_startup_objects() -> None:
    """The objects of start-up live as long as the process: keep the collector from rescanning them,
    and let it run less often: each webhook allocates hundreds of short-lived objects, and Python's
    default (a collection every 700) cost about 7% of the acknowledgements per second."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def build_worker(
    settings: Settings,
    database: Database,
    runner: Runner,
    delivery: OutboxDelivery,
    busy: Callable[[], bool] = lambda: False,
) -> InboxWorker:
    """The inbox worker, waking `delivery` after each turn (and starting the typing indicator if set)."""
    worker = InboxWorker(database, runner, on_committed=delivery.wake, busy=busy)
    if settings.typing_indicator:
        worker.before_turn = delivery.indicate_typing
    return worker


def build_pacing(settings: Settings) -> PacingLimits:
    return PacingLimits(
        settings.telegram_chat_per_second,
        settings.telegram_group_per_minute,
        settings.telegram_global_per_second,
        settings.whatsapp_global_per_second,
    )


def build_senders(settings: Settings, http: httpx.AsyncClient) -> dict[str, Sender]:
    """A sender per platform that has its sending token; the others are dry-run."""
    senders: dict[str, Sender] = {}
    if settings.telegram_bot_token is not None:
        api = TelegramAPI(settings.telegram_bot_token.get_secret_value(), settings.telegram_api_base, http)
        senders["telegram"] = TelegramSender(api)
    if settings.whatsapp_access_token is not None:
        token = settings.whatsapp_access_token.get_secret_value()
        senders["whatsapp"] = WhatsAppSender(settings.whatsapp_api_base, token, http)
    return senders


def turn_kinds(settings: Settings) -> frozenset[MessageKind]:
    """GATEWAY_TURN_KINDS as message kinds; SettingsError naming the setting for an unknown one."""
    known = {kind.value for kind in MessageKind}
    unknown = [kind for kind in settings.turn_kinds if kind not in known]
    if unknown:
        names = ", ".join(sorted(known))
        raise SettingsError(
            f"invalid setting GATEWAY_TURN_KINDS: unknown kind {unknown[0]!r} (known: {names})"
        )
    return frozenset(MessageKind(kind) for kind in settings.turn_kinds)


def load_agent(spec: str) -> Agent:
    """The starting agent named by GATEWAY_AGENT ("module:attribute"); SettingsError when it is not one."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(f"invalid setting GATEWAY_AGENT: cannot import {module_name!r}: {exc}") from None
    agent = getattr(module, attribute, None)
    if not isinstance(agent, Agent):
        found = "nothing" if agent is None else type(agent).__name__
        raise SettingsError(f"invalid setting GATEWAY_AGENT: {spec!r} is {found}, not an Agent")
    return agent


def build_runner(settings: Settings, database: Database) -> Runner:
    """The configured agent graph on an SQL session store on the service's database."""
    store = SQLSessionStore(
        database, default_max_turns=settings.max_turns, dedup_ttl_hours=settings.dedup_ttl_hours
    )
    return Runner(load_agent(settings.agent), store, model_factory=model_factory_from_settings(settings))
