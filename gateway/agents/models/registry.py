"""Model spec strings ("scripted", "openai:<model>") to Model objects."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import httpx

from gateway.agents.models.base import Model
from gateway.agents.models.budget import ProviderBudget
from gateway.agents.models.scripted import ScriptedModel

ModelFactory = Callable[[Model | str | None], Model]


def model_from_spec(
    spec: str,
    *,
    openai_base_url: str,
    openai_api_key: str | None,
    http: httpx.AsyncClient | None = None,
    budgets: Mapping[str, ProviderBudget] | None = None,
) -> Model:
    """The model a spec names; `budgets` holds each provider's budget by provider name (else unlimited)."""
    if spec == "scripted":
        return ScriptedModel()
    if spec.startswith("openai:"):
        from gateway.agents.models.openai_compat import openai_model_from_spec

        return openai_model_from_spec(
            spec,
            base_url=openai_base_url,
            api_key=openai_api_key,
            client=http,
            budget=(budgets or {}).get("openai"),
        )
    raise ValueError(f"unknown model {spec!r}: use 'scripted' or 'openai:<model>'")


def model_factory(
    default_model: str,
    *,
    openai_base_url: str,
    openai_api_key: str | None,
    http: httpx.AsyncClient | None = None,
    budgets: Mapping[str, ProviderBudget] | None = None,
) -> ModelFactory:
    """Resolve specs (None means `default_model`, the setting GATEWAY_MODEL); one Model per spec, shared.

    `http`: the service's client for the providers' calls (its owner closes it); without one, each
    model makes its own. `budgets`: each provider's budget, shared by all its models.
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
            )
        return models[name]

    return factory
