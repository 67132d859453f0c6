"""Prometheus metrics, one registry per app (no global state, so tests and apps don't share).

The HTTP request metrics are counted in plain Python numbers and turned into Prometheus samples only
when /metrics is scraped: a prometheus_client Counter and Histogram take locks and walk the buckets
on every request, which costs several microseconds on the webhook path at thousands of requests per
second. Only the event loop's thread observes and scrapes them, so they need no lock. The exposition
is the same as those metrics': `gateway_http_requests_total` (with `_created`) and the
`gateway_http_request_duration_seconds` histogram (with `_created`).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    gc_collector,
    generate_latest,
    platform_collector,
    process_collector,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from starlette.requests import Request
from starlette.responses import Response

from gateway.domain.claims import ClaimHealth
from gateway.domain.usage import LATENCY_BUCKETS as MODEL_LATENCY_BUCKETS
from gateway.domain.usage import ModelStats
from gateway.store import outbox, xmin_horizon
from gateway.store.database import FAILURE_ERRORS

SCRAPE_READ_SECONDS = 1.0
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LABELS = ("method", "route", "status")
_BUCKET_NAMES = (*(str(float(bound)) for bound in LATENCY_BUCKETS), "+Inf")  # as prometheus_client


class _Series:
    """One (method, route, status): requests, their total seconds, and how many fell in each bucket."""

    __slots__ = ("count", "created", "in_bucket", "seconds")

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.in_bucket = [0] * (len(LATENCY_BUCKETS) + 1)  # not cumulative; the last is over 10 s
        self.created = time.time()


class BudgetState(Protocol):
    """What /metrics reads of a model provider's budget (gateway/agents/models/budget.py)."""

    @property
    def processes(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class HttpMetrics:
    """Request counts and latency by route template (never the raw path: bounded cardinality)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        process_collector.ProcessCollector(registry=self.registry)
        platform_collector.PlatformCollector(registry=self.registry)
        gc_collector.GCCollector(registry=self.registry)
        self._series: dict[tuple[str, str, int], _Series] = {}
        self._claims: dict[str, ClaimHealth] = {}
        self._waiting: list[outbox.Waiting] = []
        self._horizon: xmin_horizon.Horizon | None = None
        self._models: ModelStats | None = None
        self._budgets: dict[str, BudgetState] = {}
        self.registry.register(self)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        series = self._series.get((method, route, status))
        if series is None:
            series = self._series[(method, route, status)] = _Series()
        series.count += 1
        series.seconds += seconds
        series.in_bucket[bisect_left(LATENCY_BUCKETS, seconds)] += 1  # buckets are "less or equal"

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector interface: the samples as of now."""
        requests = CounterMetricFamily(
            "gateway_http_requests",
            "HTTP requests answered, by method, route template and status.",
            labels=_LABELS,
        )
        latency = HistogramMetricFamily(
            "gateway_http_request_duration_seconds",
            "Time from request start to the end of the response, by method, route and status.",
            labels=_LABELS,
        )
        for (method, route, status), series in list(self._series.items()):
            labels = [method, route, str(status)]
            requests.add_metric(labels, series.count, created=series.created)
            cumulative = 0
            buckets = []
            for name, count in zip(_BUCKET_NAMES, series.in_bucket, strict=True):
                cumulative += count
                buckets.append((name, float(cumulative)))
            latency.add_metric(labels, buckets, series.seconds)
            latency.samples.append(
                Sample(latency.name + "_created", dict(zip(_LABELS, labels, strict=True)), series.created)
            )
        yield requests
        yield latency
        yield from self._work()
        if self._models is not None:
            yield from _model_metrics(self._models)
        if self._budgets:
            yield from _budget_metrics(self._budgets)

    def watch(
        self,
        claims: Mapping[str, ClaimHealth],
        models: ModelStats | None = None,
        budgets: Mapping[str, BudgetState] | None = None,
    ) -> None:
        """Export how the process's claim loops fare, what its turns' models cost and how its providers'
        budgets stand (called once the worker and delivery exist)."""
        self._claims = dict(claims)
        self._models = models
        self._budgets = dict(budgets or {})

    async def endpoint(self, request: Request) -> Response:
        database = getattr(request.state, "database", None)
        if database is not None:
            try:  # reads per scrape: replies waiting on a failing platform, PostgreSQL's xmin horizon
                async with asyncio.timeout(SCRAPE_READ_SECONDS):
                    self._waiting = await outbox.waiting(database)
                    self._horizon = await xmin_horizon.read(database)
            except FAILURE_ERRORS:  # TimeoutError is an OSError
                pass  # the last figures stand; /readyz says the database is away
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def _work(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "gateway_claim_failures",
            "Failed claims and lease renewals of the inbox worker and of delivery, since start.",
            labels=["loop"],
        )
        failing = GaugeMetricFamily(
            "gateway_claims_failing",
            "1 while a loop's claims keep failing (its turns or replies stall); /readyz is 503 then.",
            labels=["loop"],
        )
        for name, loop in self._claims.items():
            failures.add_metric([name], loop.failures)
            failing.add_metric([name], 1.0 if loop.failing else 0.0)
        waiting = GaugeMetricFamily(
            "gateway_outbox_waiting_rows",
            "Replies held back by transient send failures (a platform down or throttling), by platform.",
            labels=["platform"],
        )
        for row in self._waiting:
            waiting.add_metric([row.platform], row.rows)
        yield failures
        yield failing
        yield waiting
        if self._horizon is not None:
            yield GaugeMetricFamily(
                "gateway_postgres_oldest_snapshot_seconds",
                "Age of the oldest open transaction holding a snapshot (another session's or a prepared "
                "one): VACUUM keeps every row version dead since, and queue look-ups slow down. 0: none.",
                value=self._horizon.oldest_snapshot_seconds,
            )
            yield GaugeMetricFamily(
                "gateway_postgres_xmin_horizon_xids",
                "Transactions since the oldest xmin held by a session, a replication slot or a prepared "
                "transaction (age(xmin)).",
                value=self._horizon.xids,
            )


def _model_metrics(stats: ModelStats) -> Iterator[Metric]:
    """The committed turns' model usage since start, per model (a spec string: bounded cardinality)."""
    calls = CounterMetricFamily("gateway_model_calls", "Model calls of committed turns.", labels=["model"])
    tokens = CounterMetricFamily(
        "gateway_model_tokens",
        "Tokens of committed turns' model calls, as the provider counted them, by direction.",
        labels=["model", "direction"],
    )
    latency = HistogramMetricFamily(
        "gateway_model_latency_seconds",
        "Seconds a committed turn spent in its calls to one model (answered calls only).",
        labels=["model"],
    )
    names = (*(str(float(bound)) for bound in MODEL_LATENCY_BUCKETS), "+Inf")
    for model, series in list(stats.models.items()):
        calls.add_metric([model], series.calls, created=series.created)
        tokens.add_metric([model, "input"], series.input_tokens, created=series.created)
        tokens.add_metric([model, "output"], series.output_tokens, created=series.created)
        cumulative = 0
        buckets = []
        for name, count in zip(names, series.in_bucket, strict=True):
            cumulative += count
            buckets.append((name, float(cumulative)))
        latency.add_metric([model], buckets, series.latency_s)
    yield calls
    yield tokens
    yield latency


def _budget_metrics(budgets: Mapping[str, BudgetState]) -> Iterator[Metric]:
    """Each provider's budget in this process: how many processes share it, how many calls wait."""
    processes = GaugeMetricFamily(
        "gateway_model_budget_processes",
        "Processes on the database sharing the provider's budget; this one keeps 1 / this of each limit.",
        labels=["provider"],
    )
    waiting = GaugeMetricFamily(
        "gateway_model_budget_waiting_calls",
        "Calls of this process waiting for room in the provider's budget (its limits, a 429 pause).",
        labels=["provider"],
    )
    for provider, budget in budgets.items():
        processes.add_metric([provider], budget.processes)
        waiting.add_metric([provider], budget.waiting)
    yield processes
    yield waiting
