"""The HTTP application factory. Nothing is built at import: the lifespan owns every resource."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import structlog
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.bootstrap import (
    Services,
    build_services,
    freeze_startup_objects,
    model_prices,
    tune_interpreter,
    turn_kinds,
)
from gateway.logs import configure_logging
from gateway.platforms.registry import PLATFORMS, settings_groups
from gateway.platforms.spec import PlatformSpec
from gateway.settings import Settings, load_settings
from gateway.store import migrations
from gateway.store.engine import is_memory_sqlite, safe_url
from gateway.web.admin import ADMIN_TOKEN_SETTING, Admin
from gateway.web.admin import routes as admin_routes
from gateway.web.admin_outbox import WAKE_DELIVERY
from gateway.web.admin_outbox import routes as admin_outbox_routes
from gateway.web.admin_usage import routes as admin_usage_routes
from gateway.web.console import routes as console_routes
from gateway.web.errors import EXCEPTION_HANDLERS
from gateway.web.health import healthz, readyz
from gateway.web.metrics import HttpMetrics
from gateway.web.middleware import RequestContextMiddleware
from gateway.web.webhooks import WebhookReceiver, Webhooks, handshake

log = structlog.get_logger("gateway.app")
WEBHOOK_PATH = "/webhooks/{platform}"
_WEBHOOK_PREFIX = "/webhooks/"


def create_app(
    settings: Settings | None = None, *, platforms: Sequence[PlatformSpec[Any]] = PLATFORMS
) -> Starlette:
    """Build the app for `settings`, serving `platforms` (the registry's by default).

    Called without settings it is a process entry point (uvicorn's factory in each worker of
    `gateway serve --workers N`): it reads the settings and sets up logging itself.
    """
    if settings is None:
        settings = load_settings(settings_groups(platforms))
        configure_logging(
            settings.log_level,
            settings.resolved_log_format,
            settings.secret_values(),
            redact_users=settings.log_redact_users,
        )
        tune_interpreter()
    metrics = HttpMetrics()
    schema_head = migrations.head_revision()
    database_url = settings.database_url

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        services = build_services(settings, platforms)
        try:
            if is_memory_sqlite(database_url):
                # Nobody else can see an in-memory database, so the app migrates its own.
                await migrations.upgrade(services.database.engine)
            await services.start()
            freeze_startup_objects()
            _log_platforms(services)
            log.info("gateway_started", database=safe_url(database_url), schema_head=schema_head)
            webhooks = Webhooks(
                platforms=services.platforms,
                ingest=services.ingest,
                max_body_bytes=settings.max_body_bytes,
                max_items=settings.max_messages_per_webhook,
                on_pending=services.worker.wake,
                turn_kinds=turn_kinds(settings),
            )
            admin = Admin(
                token=_secret(settings.admin_token),
                starting_agent=services.worker.runner.starting_agent.name,
                on_pending=services.worker.wake,
                prices=model_prices(settings),
            )
            _log_admin(admin)
            claims = {"worker": services.worker.loop.health, "delivery": services.delivery.loop.health}
            metrics.watch(claims, services.worker.model_stats, services.budgets)
            yield {
                "claims": claims,
                "admin": admin,
                "database": services.database,
                "schema_head": schema_head,
                "settings": settings,
                "webhooks": webhooks,
                WAKE_DELIVERY: services.delivery.wake,  # a reply an operator requeued goes out now
            }
        finally:
            await services.aclose()
            log.info("gateway_stopped")

    webhook_route = Route(WEBHOOK_PATH, WebhookReceiver(), methods=["POST"])
    return GatewayApp(
        webhook_route,
        metrics,
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics.endpoint, methods=["GET"]),
            webhook_route,
            Route(WEBHOOK_PATH, handshake, methods=["GET"]),
            *admin_routes(),
            *admin_outbox_routes(),
            *admin_usage_routes(),
            *console_routes(),
        ],
        middleware=[Middleware(RequestContextMiddleware, metrics=metrics)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )


class GatewayApp(Starlette):
    """Starlette, with webhook POSTs taken straight to their receiver.

    They still pass the request-context middleware (request id, metrics, access log, the JSON 500),
    but skip Starlette's error and exception middleware and its router, which cost about a fifth of
    the time of an acknowledgement. A path the shortcut does not take goes through the router.
    """

    def __init__(self, webhook_route: Route, metrics: HttpMetrics, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._webhook_route = webhook_route
        self._webhooks = RequestContextMiddleware(webhook_route.app, metrics=metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            platform = path[len(_WEBHOOK_PREFIX) :]
            if path.startswith(_WEBHOOK_PREFIX) and platform and "/" not in platform:
                scope["app"] = self
                scope["route"] = self._webhook_route
                scope["path_params"] = {"platform": platform}
                await self._webhooks(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def _log_admin(admin: Admin) -> None:
    if not admin.enabled:
        log.info("admin_disabled", enable_with=ADMIN_TOKEN_SETTING)
        return
    log.info("admin_enabled", routes="/api")


def _log_platforms(services: Services) -> None:
    for name, platform in services.platforms.items():
        spec = platform.spec
        if not platform.enabled:
            log.info(
                "platform_disabled",
                platform=name,
                enable_with=spec.enabling_variable,
                local_mode=platform.local_adapter is not None,
            )
        elif spec.sends_for_real(platform.settings):
            log.info("platform_enabled", platform=name, sending="live")
        else:
            log.info("platform_enabled", platform=name, sending="dry-run", send_with=spec.sending_variable)
