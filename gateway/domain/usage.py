"""A turn's model usage, per model: what the usage table stores and /metrics and the admin API add up."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.domain.messages import Message, Role

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class TurnUsage:
    """The calls one turn made to one model, added up."""

    model: str
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    tool_calls: int = 0


def turn_usage(messages: Iterable[Message]) -> list[TurnUsage]:
    """The usage of a turn's new messages, per model, in the order the models were first called."""
    by_model: dict[str, TurnUsage] = {}
    for message in messages:
        if message.role is not Role.MODEL or message.usage is None:
            continue
        usage = message.usage
        total = by_model.setdefault(usage.model, TurnUsage(usage.model))
        total.calls += 1
        total.input_tokens += usage.input_tokens
        total.output_tokens += usage.output_tokens
        total.latency_s += usage.latency_s
        total.tool_calls += len(message.tool_calls)
    return list(by_model.values())


@dataclass(frozen=True)
class Price:
    """US dollars per million input and output tokens."""

    input_per_million: float
    output_per_million: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_million + output_tokens * self.output_per_million) / 1e6


def estimated_cost(
    prices: Mapping[str, Price], model: str, input_tokens: int, output_tokens: int
) -> float | None:
    """The cost in US dollars by the price table; None for a model it does not price."""
    price = prices.get(model)
    return None if price is None else round(price.cost(input_tokens, output_tokens), 6)


@dataclass
class ModelSeries:
    calls: int = 0
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    in_bucket: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    created: float = field(default_factory=time.time)


class ModelStats:
    """This process's model usage since start, per model, for /metrics: plain numbers, no locks (only
    the event loop's thread records and scrapes)."""

    def __init__(self) -> None:
        self.models: dict[str, ModelSeries] = {}

    def record(self, usages: Iterable[TurnUsage]) -> None:
        for usage in usages:
            series = self.models.get(usage.model)
            if series is None:
                series = self.models[usage.model] = ModelSeries()
            series.turns += 1
            series.calls += usage.calls
            series.input_tokens += usage.input_tokens
            series.output_tokens += usage.output_tokens
            series.latency_s += usage.latency_s
            series.in_bucket[bisect_left(LATENCY_BUCKETS, usage.latency_s)] += 1
