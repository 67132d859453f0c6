"""Typed settings, read once at start-up: defaults < TOML file < GATEWAY_* environment variables.

The TOML file is flat: each key is a field name below, and its environment variable is
``GATEWAY_`` + the key in upper case. A platform adds a settings group of its own (its spec's
settings model, see gateway.platforms.spec): field ``f`` of platform ``p`` is the key ``p_f`` (or
``f`` in a ``[p]`` table) and the variable ``GATEWAY_P_F``. Fields holding secrets are ``SecretStr``
so they never print; ``Settings.secret_values()`` feeds the log redactor.

This module knows no platform: whoever loads the settings passes the groups to read (the CLI and
the app pass the registry's).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args
from urllib.parse import unquote, urlsplit

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.errors import SettingsError
from gateway.urls import check_base_url

ENV_PREFIX = "GATEWAY_"
CONFIG_FILE_ENV = "GATEWAY_CONFIG_FILE"
DEFAULT_CONFIG_FILE = Path("config/gateway.toml")
# GATEWAY_* variables that are not settings, so they are not reported as unknown.
NON_SETTING_ENV = frozenset({CONFIG_FILE_ENV, "GATEWAY_TEST_POSTGRES_URL"})

# A shorter admin token could be guessed despite the throttle (10 tries a minute per address).
MIN_ADMIN_TOKEN_LENGTH = 16

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
# The documented default of GATEWAY_TURN_KINDS, as in gateway.domain.inbound (a test keeps them equal).
DEFAULT_TURN_KIND_NAMES = (
    "text",
    "image",
    "audio",
    "video",
    "document",
    "location",
    "contacts",
    "interactive_reply",
    "template_button",
    "order",
    "callback_query",
)


MIN_PORT, MAX_PORT = 1, 65535  # GATEWAY_PORT and `gateway serve --port`
MODEL_PROVIDERS = ("openai", "anthropic", "gemini")
MODEL_SPECS = "'scripted', 'openai:<model>', 'anthropic:<model>' or 'gemini:<model>'"


class Settings(BaseSettings):
    """Every setting of the service. Field names are the TOML keys; secrets are SecretStr."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        validate_default=True,
        allow_inf_nan=False,  # an infinite duration is a datetime past the year 9999
    )

    database_url: str = Field(
        default="sqlite+aiosqlite:///./data/gateway.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://user:pw@host/db.",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address `gateway serve` binds.")
    port: int = Field(default=8000, ge=MIN_PORT, le=MAX_PORT, description="Port `gateway serve` binds.")
    log_level: LogLevel = Field(default="info", description="Lowest level that is logged.")
    log_format: Literal["auto", "json", "console"] = Field(
        default="auto", description="json: one object per line; console: for humans; auto: console on a TTY."
    )
    log_redact_users: bool = Field(
        default=False,
        description="Log user ids, session ids, phone numbers and names as keyed hashes (id_3f2a9c1b7e).",
    )

    model: str = Field(
        default="scripted",
        description="Default model of agents that name none: 'scripted' (offline) or 'openai:<model>'.",
    )
    openai_base_url: str = Field(
        default="https://api.openai.com/v1",
        description="Base URL of an OpenAI-compatible Chat Completions server.",
    )
    openai_api_key: SecretStr | None = Field(default=None, description="Bearer key for that server.")
    openai_max_concurrency: int = Field(
        default=0, ge=0, description="Calls to that server in flight at once (0 = unlimited)."
    )
    openai_rpm: int = Field(
        default=0, ge=0, description="Requests per minute to that server, spaced evenly (0 = unlimited)."
    )
    openai_tpm: int = Field(default=0, ge=0, description="Tokens per minute to that server (0 = unlimited).")
    anthropic_base_url: str = Field(
        default="https://api.anthropic.com", description="Base URL of Anthropic's Messages API."
    )
    anthropic_api_key: SecretStr | None = Field(default=None, description="Anthropic API key (x-api-key).")
    anthropic_max_concurrency: int = Field(
        default=0, ge=0, description="Anthropic calls in flight (0 = unlimited)."
    )
    anthropic_rpm: int = Field(default=0, ge=0, description="Anthropic requests per minute (0 = unlimited).")
    anthropic_tpm: int = Field(default=0, ge=0, description="Anthropic tokens per minute (0 = unlimited).")
    gemini_base_url: str = Field(
        default="https://generativelanguage.googleapis.com/v1beta", description="Base URL of the Gemini API."
    )
    gemini_api_key: SecretStr | None = Field(default=None, description="Gemini API key (x-goog-api-key).")
    gemini_max_concurrency: int = Field(
        default=0, ge=0, description="Gemini calls in flight (0 = unlimited)."
    )
    gemini_rpm: int = Field(default=0, ge=0, description="Gemini requests per minute (0 = unlimited).")
    gemini_tpm: int = Field(default=0, ge=0, description="Gemini tokens per minute (0 = unlimited).")
    model_prices: Annotated[dict[str, tuple[float, float]], NoDecode] = Field(
        default_factory=dict,
        description="US dollars per million input and output tokens, by model spec, for the estimated "
        'cost of usage: {"openai:gpt-4o-mini": [0.15, 0.6]} (JSON in the environment).',
    )
    max_turns_in_flight: int = Field(
        default=2000,
        ge=1,
        le=100_000,
        description="Agent turns running at once in one process (each waiting on its model, mostly).",
    )
    max_sends_in_flight: int = Field(
        default=256,
        ge=1,
        le=10_000,
        description="Replies being sent at once in one process, those waiting for their pacing slot "
        "included: replies/s <= this / the platform's answer time.",
    )
    model_retry_s: float = Field(
        default=1800,
        ge=0,
        le=365 * 86400,
        description="How long a turn is retried after transient model failures (timeout, 429, 5xx, "
        "connection) before it is dead; later messages of its conversation wait behind it.",
    )
    holding_reply_after_s: float = Field(
        default=0,
        ge=0,
        le=7 * 86400,
        description="After this many seconds of a model outage, the user gets the holding reply "
        "once per outage (0 = never).",
    )
    holding_reply: str = Field(
        default="We're having trouble answering right now. We'll reply as soon as we can.",
        min_length=1,
        max_length=4096,
        description="The text of the holding reply.",
    )
    coalesce_ms: int = Field(
        default=0,
        ge=0,
        le=30_000,
        description="Pending messages of one conversation that arrive within this many milliseconds of "
        "each other are answered by one turn (0 = off): the worker waits that long after the newest.",
    )
    agent: str = Field(
        default="gateway.demo:agent",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="The starting agent, as module:attribute.",
    )

    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="Largest webhook body accepted (413 above)."
    )
    max_messages_per_webhook: int = Field(
        default=1000,
        ge=1,
        description="Messages, statuses and membership changes one webhook may carry (413 above).",
    )
    header_timeout_seconds: float = Field(
        default=10,
        gt=0,
        le=3600,
        description="Seconds a client has for a request's line and headers (408 and closed after).",
    )
    body_timeout_seconds: float = Field(
        default=30,
        gt=0,
        le=3600,
        description="Seconds a client has for a request's body once its head is in (408 and closed after).",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="Client connections open at once: a new one closes the longest idle one, or gets 503.",
    )
    dedup_ttl_hours: float = Field(
        default=192,
        gt=0,
        le=10 * 8760,
        description="How long message keys are remembered (WhatsApp retries for 7 days).",
    )
    max_turns: int = Field(default=40, ge=1, description="Complete turns kept per conversation.")
    turn_kinds: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_TURN_KIND_NAMES),
        description="Message kinds that start an agent turn; the others are only recorded.",
    )
    typing_indicator: bool = Field(
        default=False,
        description="Show the user the bot is typing while a turn runs (Telegram sendChatAction; "
        "WhatsApp marks the message read and shows typing); only where replies are sent for real.",
    )
    local_key_file: str = Field(
        default="data/local.key",
        description="Key file of the local mode (`gateway simulate` without secrets); '' turns it off.",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token of the session admin API (/api/…), 16 characters or more; 404 without it.",
    )
    database_timeout_seconds: float = Field(
        default=5,
        gt=0,
        le=600,
        description="The longest a webhook waits for its commit (then 503, and the platform retries); "
        "on PostgreSQL also the longest wait for a pooled connection.",
    )
    database_pool_size: int = Field(
        default=20,
        ge=1,
        le=500,
        description="PostgreSQL: the connections each gateway process opens at most, and keeps open "
        "(see docs/deploy.md for sizing against the server's max_connections).",
    )
    max_queued_webhooks: int = Field(
        default=2000,
        ge=1,
        description="Webhooks waiting for a commit at once; more get 503 at once (back-pressure).",
    )
    lease_seconds: float = Field(
        default=30,
        ge=3,
        le=3600,
        description="Lease of a message or reply being worked on, renewed every third of it while it "
        "is: a crashed process's conversations are taken over by another within this time.",
    )
    delivery_retry_hours: float = Field(
        default=24,
        gt=0,
        le=8760,
        description="How long a reply is retried after transient failures (network, 5xx, 429) before "
        "it is dead (listed and retried by operators); permanent refusals fail at once.",
    )

    @field_validator("model_prices", mode="before")
    @classmethod
    def _decode_prices(cls, value: Any) -> Any:
        # The environment gives JSON text (the TOML file a table): decoded here rather than by
        # pydantic-settings, whose failure is a traceback naming the field, not the variable.
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(
                "is not a JSON object of model spec to [input, output] prices, "
                'e.g. {"openai:gpt-4o-mini": [0.15, 0.6]}'
            ) from None

    @field_validator("model_prices")
    @classmethod
    def _check_prices(cls, value: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        for model, pair in value.items():
            if not all(price >= 0 for price in pair):  # finite: allow_inf_nan=False checked that
                raise ValueError(f"the prices of {model!r} must be 0 or more")
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if not _known_shape(value):
            raise ValueError(f"must be {MODEL_SPECS}")
        return value

    def model_problem(self, spec: str) -> str | None:
        """Why a model spec (GATEWAY_MODEL's, or an agent's) cannot answer with these settings, or None:
        a spec of no known shape, or a provider's own endpoint without its key, which refuses every
        call (a server of one's own, at another base URL, may go without)."""
        if not _known_shape(spec):
            return f"is not {MODEL_SPECS}"
        provider = spec.partition(":")[0]
        if provider not in MODEL_PROVIDERS:
            return None
        base_url = getattr(self, f"{provider}_base_url")
        if getattr(self, f"{provider}_api_key") is None and base_url == _default(f"{provider}_base_url"):
            return (
                f"needs {env_name(provider + '_api_key')}: it calls {base_url} (only a server of your own, "
                f"at {env_name(provider + '_base_url')}, may go without)"
            )
        return None

    # The platforms' settings groups (GATEWAY_TELEGRAM_*, ...), loaded with these settings: see `group`.
    _groups: dict[str, BaseSettings] = PrivateAttr(default_factory=dict)

    @field_validator("openai_api_key", "anthropic_api_key", "gemini_api_key", "admin_token", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return value
        if not re.fullmatch(r"[\x21-\x7e]+", value.get_secret_value()):
            raise ValueError("must be visible ASCII characters without spaces (it is sent in an HTTP header)")
        if len(value.get_secret_value()) < MIN_ADMIN_TOKEN_LENGTH:
            raise ValueError(
                f"must be at least {MIN_ADMIN_TOKEN_LENGTH} characters, e.g. from"
                " `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return value

    @field_validator("openai_base_url", "anthropic_base_url", "gemini_base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        return check_base_url(value)

    @field_validator("turn_kinds", mode="before")
    @classmethod
    def _split_kinds(cls, value: Any) -> Any:
        # The environment gives "text,image" (or a JSON list); the TOML file a list.
        if isinstance(value, str):
            stripped = value.strip()
            if stripped.startswith("["):
                try:
                    return json.loads(stripped)
                except ValueError:
                    raise ValueError("is neither a JSON list nor comma-separated kinds") from None
            return [kind.strip() for kind in stripped.split(",") if kind.strip()]
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        driver, separator, _ = value.partition("://")
        if not separator or not re.fullmatch(r"[A-Za-z][\w+.-]*", driver):
            raise ValueError("not a database URL (expected e.g. sqlite+aiosqlite:///./data/gateway.db)")
        if driver not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
            raise ValueError(
                f"unsupported driver {driver!r} (use sqlite+aiosqlite:// or postgresql+asyncpg://)"
            )
        return value

    @property
    def resolved_log_format(self) -> Literal["json", "console"]:
        if self.log_format == "auto":
            return "console" if sys.stderr.isatty() else "json"
        return self.log_format

    def group(self, name: str, model: type[G]) -> G:
        """The settings group `name` (a platform's, e.g. GATEWAY_TELEGRAM_*) as a `model`.

        The one loaded with these settings (`load_settings`, `settings_from`); for settings built
        directly, the group is read from the environment and defaults the first time it is asked for.
        SettingsError naming the variable when a value is bad.
        """
        found = self._groups.get(name)
        if found is None:
            found = _load_group(name, model, {}, None)
            self._groups[name] = found
        if not isinstance(found, model):
            raise TypeError(f"settings group {name!r} is a {type(found).__name__}, not a {model.__name__}")
        return found

    def with_groups(self, groups: Mapping[str, BaseSettings]) -> Settings:
        """A copy holding these settings groups as well (replacing groups of the same name)."""
        copy = self.model_copy()
        copy._groups = {**self._groups, **groups}
        return copy

    def secret_values(self) -> list[str]:
        """Every secret this configuration holds, its groups' too, for the log redactor (a URL's password
        included)."""
        secrets = _secrets_of(self)
        for group in self._groups.values():
            secrets.extend(_secrets_of(group))
        password = urlsplit(self.database_url).password
        if password:
            secrets.extend({password, unquote(password)})  # as written, and as the driver sends it
        return secrets

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init kwargs (from load_settings); the environment wins over them.
        return env_settings, init_settings


G = TypeVar("G", bound=BaseSettings)
# A settings group's model, by group name: what a platform adds to the settings (see gateway.platforms).
Groups = Mapping[str, type[BaseSettings]]


def _is_secret(annotation: Any) -> bool:
    return annotation is SecretStr or SecretStr in get_args(annotation)


def _secrets_of(model: BaseSettings) -> list[str]:
    values = (getattr(model, name) for name in type(model).model_fields)
    return [v.get_secret_value() for v in values if isinstance(v, SecretStr) and v.get_secret_value()]


# Settings whose input is never echoed in an error message (a database URL may hold a password).
SECRET_FIELDS = frozenset(
    {"database_url"} | {name for name, f in Settings.model_fields.items() if _is_secret(f.annotation)}
)


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def group_env_name(model: type[BaseSettings], field: str) -> str:
    """The environment variable of a group's field: the group's prefix (GATEWAY_TELEGRAM_) + the field."""
    return f"{model.model_config.get('env_prefix') or ''}{field}".upper()


def _config_path() -> tuple[Path, bool]:
    """The TOML file to read and whether it was named explicitly (then it must exist)."""
    named = os.environ.get(CONFIG_FILE_ENV)
    if named:
        return Path(named), True
    return DEFAULT_CONFIG_FILE, False


def _read_file(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists() and not required:
        return {}
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"{CONFIG_FILE_ENV}: config file {path} does not exist") from None
    except OSError as exc:
        raise SettingsError(f"{CONFIG_FILE_ENV}: cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: not valid TOML: {exc}") from None


def _describe(
    error: Any,
    path: Path | None,
    keys: Mapping[str, str],
    env: Callable[[str], str],
    secret: Callable[[str], bool],
) -> str:
    """One line naming the setting: its variable when set there, else its key in the file.

    `keys` maps the fields given as values to the key they were given as; `env` names a field's
    variable; `secret` says whether a field's input must not be echoed.
    """
    field = str(error["loc"][0]) if error["loc"] else "?"
    key = keys.get(field, field)
    in_file = f" in config file {path}" if path is not None else ""
    if error["type"] == "extra_forbidden":
        return f"unknown setting {key!r}{in_file}"
    variable = env(field)
    if variable in {name.upper() for name in os.environ}:
        where = f"{variable} (environment)"
    elif field in keys and path is not None:
        where = f"{key} in {path}"
    else:
        where = variable
    message = str(error["msg"]).removeprefix("Value error, ")
    # Secret values are never echoed back; other inputs help spot a typo.
    shown = "" if secret(field) else f" (got {error['input']!r})"
    return f"invalid setting {where}: {message}{shown}"


def _load_group(
    name: str,
    model: type[G],
    values: Mapping[str, Any],
    path: Path | None,
    keys: Mapping[str, str] | None = None,
) -> G:
    """One group from the file's `values` (by field), under the environment; SettingsError naming
    the setting."""
    try:
        return model(**values)
    except ValidationError as exc:
        fields = model.model_fields

        def secret(field: str) -> bool:
            return field in fields and _is_secret(fields[field].annotation)

        given = keys if keys is not None else {field: f"{name}_{field}" for field in values}
        raise SettingsError(
            _describe(exc.errors()[0], path, given, lambda f: group_env_name(model, f), secret)
        ) from None


def _split(
    values: Mapping[str, Any], groups: Groups, path: Path | None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """The global settings' values, each group's values by field, and the key each group field was given as.

    A group's field `f` is the flat key `<group>_f` (the names the settings always had) or `f` in a
    `[<group>]` table; any other key is the global settings' (which refuse the unknown ones).
    """
    own: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {name: {} for name in groups}
    keys: dict[str, dict[str, str]] = {name: {} for name in groups}

    def put(name: str, field: str, value: Any, key: str) -> None:
        if field in grouped[name]:
            where = f" in config file {path}" if path is not None else ""
            raise SettingsError(f"setting {key!r} is given twice{where} (as {keys[name][field]!r} too)")
        grouped[name][field] = value
        keys[name][field] = key

    for key, value in values.items():
        if key in groups and isinstance(value, dict):
            for field, item in value.items():
                put(key, str(field), item, f"{key}.{field}")
            continue
        owner = None if key in Settings.model_fields else _group_of(key, groups)
        if owner is None:
            own[key] = value
        else:
            put(owner, key[len(owner) + 1 :], value, key)
    return own, grouped, keys


def _group_of(key: str, groups: Groups) -> str | None:
    for name, model in groups.items():
        if key.startswith(f"{name}_") and key[len(name) + 1 :] in model.model_fields:
            return name
    return None


def settings_from(
    values: Mapping[str, Any], groups: Groups | None = None, *, path: Path | None = None
) -> Settings:
    """Settings from flat values (a config file's, or a caller's), with their groups.

    Keys of a group (`telegram_bot_token`, or a `[telegram]` table) go to that group; the environment
    wins over every value. Any problem raises SettingsError naming the setting.
    """
    groups = groups or {}
    own, grouped, keys = _split(values, groups, path)
    try:
        settings = Settings(**own)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise SettingsError(
            _describe(error, path, {k: k for k in own}, env_name, SECRET_FIELDS.__contains__)
        ) from None
    _check_model_key(settings)
    loaded = {
        name: _load_group(name, model, grouped[name], path, keys[name]) for name, model in groups.items()
    }
    return settings.with_groups(loaded)


def _check_model_key(settings: Settings) -> None:
    """Stop start-up rather than let every turn fail on a model that cannot answer."""
    if problem := settings.model_problem(settings.model):
        raise SettingsError(f"invalid setting {env_name('model')}: {settings.model!r} {problem}")


def _known_shape(spec: str) -> bool:
    provider, _, name = spec.partition(":")
    return spec == "scripted" or (provider in MODEL_PROVIDERS and bool(name))


def _default(field: str) -> Any:
    return Settings.model_fields[field].default


def load_settings(groups: Groups | None = None) -> Settings:
    """Read the configuration once, with the given settings groups (the platforms'); any problem
    raises SettingsError naming the setting."""
    path, required = _config_path()
    return settings_from(_read_file(path, required), groups, path=path)


def unknown_env_settings(groups: Groups | None = None) -> list[str]:
    """GATEWAY_* variables that name no setting (of the global settings or of a group): most likely typos."""
    known = {env_name(name) for name in Settings.model_fields} | NON_SETTING_ENV
    for model in (groups or {}).values():
        known |= {group_env_name(model, field) for field in model.model_fields}
    return sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
