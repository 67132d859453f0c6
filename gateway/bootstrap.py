"""The composition root: the one place that turns settings into engines, clients and services.

Platforms come from their specs (`platforms`, the registry's by default): nothing here names one.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import structlog
from pydantic import SecretStr

from gateway.agents import Agent, Runner, SQLSessionStore
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.registry import Endpoint, ModelFactory, model_factory
from gateway.agents.runner import reachable_agents
from gateway.domain.inbound import MessageKind
from gateway.domain.usage import Price
from gateway.errors import SettingsError
from gateway.http_client import http_client
from gateway.platforms import local_key
from gateway.platforms.base import PlatformAdapter, Sender
from gateway.platforms.registry import PLATFORMS, by_name
from gateway.platforms.spec import ConfiguredPlatform, PlatformSettings, PlatformSpec
from gateway.settings import MODEL_PROVIDERS, Settings
from gateway.store.database import Database
from gateway.store.ingest import Ingest
from gateway.worker.budget_shares import share_budgets
from gateway.worker.coalesce import Coalescer
from gateway.worker.inbox import InboxWorker
from gateway.worker.maintenance import purge_dedup_keys_periodically
from gateway.worker.outbound import OutboxDelivery
from gateway.worker.pacing import PacingLimits
from gateway.worker.patience import Patience

HTTP_TIMEOUT_SECONDS = 30  # outbound calls to the platforms
MODEL_TIMEOUT_SECONDS = 60  # each attempt of a model call
OTHER_PLATFORM_CALLS = 100  # connections for platform calls besides the sends (typing indicators, getMe)
# The interpreter's GIL switch interval (5 ms by default): each statement of a commit releases the GIL
# on the SQLite writer thread, which then waits for it while the event loop runs, up to a whole
# interval per statement. 1 ms gave ~15% more acks/s.
SWITCH_INTERVAL_SECONDS = 0.001
# Python's defaults are (700, 10, 10). A collection of the middle generation walks every object that
# outlived a young one: with 2,000 turns waiting seconds on a model, their tasks, requests and
# connections, still alive, 60-110 ms a collection. After 100 young collections (20 before) most of them
# have ended: 112 -> 28 ms of collections in a 5 s model run. The oldest generation runs after 10 middle
# ones: every 10 million allocations (4 million before).
GC_THRESHOLDS = (10_000, 100, 10)

log = structlog.get_logger("gateway.bootstrap")


@dataclass(frozen=True)
class Services:
    """Everything long-lived that the app's lifespan owns, starts and closes."""

    settings: Settings
    database: Database
    platforms: dict[str, ConfiguredPlatform]  # each platform's spec, settings and webhook adapters
    ingest: Ingest
    worker: InboxWorker
    delivery: OutboxDelivery
    http: httpx.AsyncClient
    model_http: httpx.AsyncClient  # the model providers' calls: as many connections as turns in flight
    budgets: dict[str, ProviderBudget]  # each provider's, shared with the other processes on the database
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self, *, webhooks: bool = True) -> None:
        """The background tasks; with `webhooks`, also each enabled platform's own (its spec's
        `background`: Telegram's getMe)."""
        if webhooks:
            for name, platform in self.platforms.items():
                if platform.spec.background is not None and platform.adapter is not None:
                    work = platform.spec.background(platform.settings, platform.adapter, self.http)
                    self.tasks.append(asyncio.create_task(work, name=f"{name}-background"))
        self.tasks.append(
            asyncio.create_task(purge_dedup_keys_periodically(self.database), name="dedup-purge")
        )
        self.tasks.append(
            asyncio.create_task(
                share_budgets(self.database, self.budgets.values(), self.worker.owner), name="budget-shares"
            )
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
        await self.model_http.aclose()
        await self.database.aclose()


def build_services(settings: Settings, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS) -> Services:
    """Everything `gateway serve` runs (and `gateway worker`, which leaves the webhooks out)."""
    by_name(platforms)  # ValueError for two platforms of one name, before anything is built
    database = Database.open(
        settings.database_url,
        pool_timeout=settings.database_timeout_seconds,
        pool_size=settings.database_pool_size,
    )
    # Every send in flight may hold a connection; typing indicators and getMe share the client.
    http = http_client(
        HTTP_TIMEOUT_SECONDS, max_connections=settings.max_sends_in_flight + OTHER_PLATFORM_CALLS
    )
    ingest = Ingest(
        database,
        timedelta(hours=settings.dedup_ttl_hours),
        timeout=settings.database_timeout_seconds,
        max_waiting=settings.max_queued_webhooks,
    )
    delivery = build_delivery(settings, database, http, platforms, busy=lambda: ingest.busy)
    model_http = http_client(MODEL_TIMEOUT_SECONDS, max_connections=settings.max_turns_in_flight)
    budgets = build_budgets(settings)
    runner = build_runner(settings, database, model_http, budgets)
    worker = build_worker(settings, database, runner, delivery, busy=lambda: ingest.busy, platforms=platforms)
    return Services(
        settings=settings,
        database=database,
        platforms=build_webhook_platforms(settings, platforms),
        ingest=ingest,
        worker=worker,
        delivery=delivery,
        http=http,
        model_http=model_http,
        budgets=budgets,
    )


def platform_settings(settings: Settings, spec: PlatformSpec[Any]) -> PlatformSettings:
    """The platform's settings group (SettingsError naming the variable when it is bad)."""
    model: type[PlatformSettings] = spec.settings
    return settings.group(spec.name, model)


def build_webhook_platforms(
    settings: Settings, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS
) -> dict[str, ConfiguredPlatform]:
    """Each platform for its webhook route: enabled (an adapter checking its secret) when the secret
    is configured, else disabled, with the local mode's adapter when that is on."""
    local = build_local_adapters(settings, platforms)
    built = {}
    for spec in platforms:
        group = platform_settings(settings, spec)
        secret = spec.webhook_secret(group)
        adapter = None if secret is None else spec.adapter(group, secret)
        built[spec.name] = ConfiguredPlatform(spec, group, adapter, local.get(spec.name))
    return built


def build_local_adapters(
    settings: Settings, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS
) -> dict[str, PlatformAdapter]:
    """The local mode (see `gateway.platforms.local_key`): off when turned off, or when the key
    file cannot be written (a read-only container), since it is only a convenience."""
    disabled = [spec for spec in platforms if spec.webhook_secret(platform_settings(settings, spec)) is None]
    if not settings.local_key_file or not disabled:
        return {}
    path = Path(settings.local_key_file)
    try:
        key = local_key.load_or_create(path)
    except (OSError, ValueError) as exc:
        log.warning("local_mode_off", key_file=str(path), reason=str(exc))
        return {}
    log.info("local_mode_on", platforms=[spec.name for spec in disabled], key_file=str(path))
    return {spec.name: spec.adapter(platform_settings(settings, spec), key) for spec in disabled}


def build_delivery(
    settings: Settings,
    database: Database,
    http: httpx.AsyncClient,
    platforms: Sequence[PlatformSpec[Any]] = PLATFORMS,
    busy: Callable[[], bool] = lambda: False,
) -> OutboxDelivery:
    """Outbox delivery through each platform's sender, paced by each platform's rule; `busy`: the
    webhooks' flood rule, as the worker's (new sends start sparingly while it holds)."""
    return OutboxDelivery(
        database,
        build_senders(settings, http, platforms),
        pacing=build_pacing(settings, platforms),
        platforms=platforms,
        concurrency=settings.max_sends_in_flight,
        busy=busy,
        retry_hours=settings.delivery_retry_hours,
        lease_seconds=settings.lease_seconds,
    )


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
    platforms: Sequence[PlatformSpec[Any]] = PLATFORMS,
) -> InboxWorker:
    """The inbox worker, waking `delivery` after each turn (and starting the typing indicator if set),
    coalescing bursts when GATEWAY_COALESCE_MS is set."""
    worker = InboxWorker(
        database,
        runner,
        on_committed=lambda session_id: delivery.wake((session_id,)),
        busy=busy,
        platforms=platforms,
        lease_seconds=settings.lease_seconds,
        concurrency=settings.max_turns_in_flight,
        patience=Patience(settings.model_retry_s, settings.holding_reply_after_s),
        holding_reply=settings.holding_reply,
        coalescer=Coalescer(settings.coalesce_ms) if settings.coalesce_ms else None,
    )
    if settings.typing_indicator:
        worker.before_turn = delivery.indicate_typing
    return worker


def build_pacing(settings: Settings, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS) -> PacingLimits:
    """Each platform's rate limits, as its spec's pacing rule reads them from its settings."""
    return PacingLimits({spec.name: spec.pacing(platform_settings(settings, spec)) for spec in platforms})


def build_senders(
    settings: Settings, http: httpx.AsyncClient, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS
) -> dict[str, Sender]:
    """A sender per platform that has its sending token; the others are dry-run."""
    senders: dict[str, Sender] = {}
    for spec in platforms:
        sender = spec.sender(platform_settings(settings, spec), http)
        if sender is not None:
            senders[spec.name] = sender
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


def load_agent(settings: Settings) -> Agent:
    """The starting agent named by GATEWAY_AGENT ("module:attribute"); SettingsError when it is not one,
    or when an agent it reaches names a model that cannot answer with these settings (else each turn
    found it out, five attempts before it was dead)."""
    agent = _agent_at(settings.agent)
    try:
        graph = reachable_agents(agent)
    except ValueError as exc:
        raise SettingsError(f"invalid setting GATEWAY_AGENT: {exc}") from None
    for each in graph.values():
        if isinstance(each.model, str) and (problem := settings.model_problem(each.model)):
            raise SettingsError(
                f"invalid setting GATEWAY_AGENT: agent {each.name!r} names model {each.model!r}, "
                f"which {problem}"
            )
    return agent


def _agent_at(spec: str) -> Agent:
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


def build_runner(
    settings: Settings,
    database: Database,
    http: httpx.AsyncClient | None = None,
    budgets: dict[str, ProviderBudget] | None = None,
) -> Runner:
    """The configured agent graph on an SQL session store on the service's database; its models call
    their providers through `http` (the service's client) when given, within `budgets` (default: the
    settings' own, unshared)."""
    store = SQLSessionStore(
        database, default_max_turns=settings.max_turns, dedup_ttl_hours=settings.dedup_ttl_hours
    )
    return Runner(load_agent(settings), store, model_factory=build_models(settings, http, budgets))


def build_models(
    settings: Settings,
    http: httpx.AsyncClient | None = None,
    budgets: dict[str, ProviderBudget] | None = None,
) -> ModelFactory:
    return model_factory(
        settings.model,
        openai_base_url=settings.openai_base_url,
        openai_api_key=_secret(settings.openai_api_key),
        http=http,
        budgets=build_budgets(settings) if budgets is None else budgets,
        endpoints={
            "anthropic": Endpoint(settings.anthropic_base_url, _secret(settings.anthropic_api_key)),
            "gemini": Endpoint(settings.gemini_base_url, _secret(settings.gemini_api_key)),
        },
    )


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None


def model_prices(settings: Settings) -> dict[str, Price]:
    """GATEWAY_MODEL_PRICES as prices by model spec (the settings checked their shape)."""
    return {model: Price(*pair) for model, pair in settings.model_prices.items()}


def build_budgets(settings: Settings) -> dict[str, ProviderBudget]:
    """Each model provider's budget (GATEWAY_<PROVIDER>_MAX_CONCURRENCY, _RPM, _TPM)."""
    return {
        provider: ProviderBudget(
            provider,
            max_concurrency=getattr(settings, f"{provider}_max_concurrency"),
            rpm=getattr(settings, f"{provider}_rpm"),
            tpm=getattr(settings, f"{provider}_tpm"),
        )
        for provider in MODEL_PROVIDERS
    }
