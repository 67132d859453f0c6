"""Model spec strings (scripted, openai:<model>, anthropic:<model>, gemini:<model>) to Model objects."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from gateway.agents.models.base import Model
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.scripted import ScriptedModel

ModelFactory = Callable[[Model | str | None], Model]


@dataclass(frozen=True)
class Endpoint:
    """Where a provider is reached, and its key (sent there only; never shown by repr)."""

    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)


SPECS = "'scripted', 'openai:<model>', 'anthropic:<model>' or 'gemini:<model>'"


def model_from_spec(
    spec: str,
    *,
    openai_base_url: str,
    openai_api_key: str | None,
    http: httpx.AsyncClient | None = None,
    budgets: Mapping[str, ProviderBudget] | None = None,
    endpoints: Mapping[str, Endpoint] | None = None,
) -> Model:
    """The model a spec names; `budgets` holds each provider's budget by provider name (else
    unlimited), `endpoints` the native providers' base URLs and keys (else their defaults, no key)."""
    if spec == "scripted":
        return ScriptedModel()
    provider = spec.partition(":")[0]
    budget = (budgets or {}).get(provider)
    endpoint = (endpoints or {}).get(provider, Endpoint())
    if provider == "openai":
        from gateway.agents.models.openai_compat import openai_model_from_spec

        return openai_model_from_spec(
            spec, base_url=openai_base_url, api_key=openai_api_key, client=http, budget=budget
        )
    if provider == "anthropic":
        from gateway.agents.models.anthropic import anthropic_model_from_spec

        return anthropic_model_from_spec(
            spec, base_url=endpoint.base_url, api_key=endpoint.api_key, client=http, budget=budget
        )
    if provider == "gemini":
        from gateway.agents.models.gemini import gemini_model_from_spec

        return gemini_model_from_spec(
            spec, base_url=endpoint.base_url, api_key=endpoint.api_key, client=http, budget=budget
        )
    raise ValueError(f"unknown model {spec!r}: use {SPECS}")


def model_factory(
    default_model: str,
    *,
    openai_base_url: str,
    openai_api_key: str | None,
    http: httpx.AsyncClient | None = None,
    budgets: Mapping[str, ProviderBudget] | None = None,
    endpoints: Mapping[str, Endpoint] | None = None,
) -> ModelFactory:
    """Resolve specs (None means `default_model`, the setting GATEWAY_MODEL); one Model per spec, shared.

    `http`: the service's client for the providers' calls (its owner closes it); without one, each
    model makes its own. `budgets`: each provider's budget, shared by all its models; `endpoints`:
    the native providers' (anthropic, gemini) base URLs and keys.
    """
    models: dict[str, Model] = {}

    def factory(spec: Model | str | None) -> Model:
        if spec is not None and not isinstance(spec, str):
            return spec
        name = spec or default_model
        if name not in models:
            models[name] = model_from_spec(
                name,
                openai_base_url=openai_base_url,
                openai_api_key=openai_api_key,
                http=http,
                budgets=budgets,
                endpoints=endpoints,
            )
        return models[name]

    return factory
