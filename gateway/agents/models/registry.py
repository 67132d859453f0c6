"""Model spec strings ("scripted", "openai:<model>") to Model objects."""

from __future__ import annotations

from collections.abc import Callable

from gateway.agents.models.base import Model
from gateway.agents.models.scripted import ScriptedModel
from gateway.settings import Settings

ModelFactory = Callable[[Model | str | None], Model]


def model_from_spec(spec: str, settings: Settings) -> Model:
    if spec == "scripted":
        return ScriptedModel()
    if spec.startswith("openai:"):
        from gateway.agents.models.openai_compat import openai_model_from_spec

        key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else None
        return openai_model_from_spec(spec, base_url=settings.openai_base_url, api_key=key)
    raise ValueError(f"unknown model {spec!r}: use 'scripted' or 'openai:<model>'")


def model_factory_from_settings(settings: Settings) -> ModelFactory:
    """Resolve specs with these settings; None means GATEWAY_MODEL. One Model per spec, shared."""
    models: dict[str, Model] = {}

    def factory(spec: Model | str | None) -> Model:
        if spec is not None and not isinstance(spec, str):
            return spec
        name = spec or settings.model
        if name not in models:
            models[name] = model_from_spec(name, settings)
        return models[name]

    return factory
