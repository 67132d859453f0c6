"""Typed settings, read once at start-up: defaults < TOML file < GATEWAY_* environment variables.

The TOML file is flat: each key is a field name below, and its environment variable is
``GATEWAY_`` + the key in upper case. Fields holding secrets are ``SecretStr`` so they never
print; ``Settings.secret_values()`` feeds the log redactor.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from gateway.errors import SettingsError

ENV_PREFIX = "GATEWAY_"
CONFIG_FILE_ENV = "GATEWAY_CONFIG_FILE"
DEFAULT_CONFIG_FILE = Path("config/gateway.toml")
# GATEWAY_* variables that are not settings, so they are not reported as unknown.
NON_SETTING_ENV = frozenset({CONFIG_FILE_ENV, "GATEWAY_TEST_POSTGRES_URL"})

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


class Settings(BaseSettings):
    """Every setting of the service. Field names are the TOML keys; secrets are SecretStr."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        frozen=True,
        case_sensitive=False,
        validate_default=True,
    )

    database_url: str = Field(
        default="sqlite+aiosqlite:///./data/gateway.db",
        description="SQLAlchemy async URL: sqlite+aiosqlite:///path or postgresql+asyncpg://user:pw@host/db.",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address `gateway serve` binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port `gateway serve` binds.")
    log_level: LogLevel = Field(default="info", description="Lowest level that is logged.")
    log_format: Literal["auto", "json", "console"] = Field(
        default="auto", description="json: one object per line; console: for humans; auto: console on a TTY."
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
    agent: str = Field(
        default="gateway.demo:agent",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="The starting agent, as module:attribute.",
    )

    whatsapp_verify_token: SecretStr | None = Field(
        default=None, description="The Verify token entered in Meta's App Dashboard (GET handshake)."
    )
    whatsapp_app_secret: SecretStr | None = Field(
        default=None, description="App secret that signs webhooks; WhatsApp is disabled without it."
    )
    whatsapp_access_token: SecretStr | None = Field(
        default=None, description="Token for sending; without it replies are dry-run (logged, not sent)."
    )
    whatsapp_api_base: str = Field(default="https://graph.facebook.com/v26.0", description="Graph API base.")
    telegram_bot_token: SecretStr | None = Field(
        default=None, description="Bot token from @BotFather; without it replies are dry-run."
    )
    telegram_secret_token: SecretStr | None = Field(
        default=None,
        description="secret_token given to setWebhook; Telegram is disabled without it.",
    )
    telegram_api_base: str = Field(default="https://api.telegram.org", description="Bot API base.")
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="Largest webhook body accepted (413 above)."
    )
    dedup_ttl_hours: float = Field(
        default=192, gt=0, description="How long message keys are remembered (WhatsApp retries for 7 days)."
    )
    max_turns: int = Field(default=40, ge=1, description="Complete turns kept per conversation.")
    turn_kinds: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_TURN_KIND_NAMES),
        description="Message kinds that start an agent turn; the others are only recorded.",
    )
    telegram_chat_per_second: float = Field(default=1, ge=0, description="Sends per private chat per second.")
    telegram_group_per_minute: float = Field(default=20, ge=0, description="Sends per group chat per minute.")
    telegram_global_per_second: float = Field(
        default=30, ge=0, description="Telegram sends per second overall."
    )
    whatsapp_global_per_second: float = Field(
        default=80, ge=0, description="WhatsApp sends per second overall."
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
        description="Bearer token of the session admin API (/api/…); the API answers 404 without it.",
    )

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value == "scripted" or (value.startswith("openai:") and len(value) > len("openai:")):
            return value
        raise ValueError("must be 'scripted' or 'openai:<model>'")

    @field_validator(
        "openai_api_key",
        "whatsapp_verify_token",
        "whatsapp_app_secret",
        "whatsapp_access_token",
        "telegram_bot_token",
        "telegram_secret_token",
        "admin_token",
        mode="before",
    )
    @classmethod
    def _empty_key_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("telegram_secret_token")
    @classmethod
    def _check_telegram_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,256}", value.get_secret_value()):
            raise ValueError("must be 1-256 characters of A-Z, a-z, 0-9, _ and - (Telegram's rule)")
        return value

    @field_validator("telegram_bot_token")
    @classmethod
    def _check_bot_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"\d+:[A-Za-z0-9_-]+", value.get_secret_value()):
            raise ValueError("is not a bot token of the form <digits>:<secret> (see @BotFather)")
        return value

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not re.fullmatch(r"[\x21-\x7e]+", value.get_secret_value()):
            raise ValueError("must be visible ASCII characters without spaces (it is sent in an HTTP header)")
        return value

    @field_validator("openai_base_url", "whatsapp_api_base", "telegram_api_base")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

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
        try:
            url = make_url(value)
        except ArgumentError:
            raise ValueError(
                "not a database URL (expected e.g. sqlite+aiosqlite:///./data/gateway.db)"
            ) from None
        if url.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
            raise ValueError(
                f"unsupported driver {url.drivername!r} (use sqlite+aiosqlite:// or postgresql+asyncpg://)"
            )
        return value

    @property
    def resolved_log_format(self) -> Literal["json", "console"]:
        if self.log_format == "auto":
            return "console" if sys.stderr.isatty() else "json"
        return self.log_format

    def secret_values(self) -> list[str]:
        """Every secret this configuration holds, for the log redactor (a URL's password included)."""
        secrets = []
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr) and value.get_secret_value():
                secrets.append(value.get_secret_value())
        password = make_url(self.database_url).password
        if password:
            secrets.append(password)
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


# Settings whose input is never echoed in an error message (a database URL may hold a password).
SECRET_FIELDS = frozenset(
    {"database_url"}
    | {
        name
        for name, f in Settings.model_fields.items()
        if SecretStr in (f.annotation, *get_args(f.annotation))
    }
)


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


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


def _describe(error: Any, path: Path, file_keys: set[str]) -> str:
    field = str(error["loc"][0]) if error["loc"] else "?"
    if error["type"] == "extra_forbidden":
        return f"unknown setting {field!r} in config file {path}"
    env = env_name(field)
    if env in {key.upper() for key in os.environ}:
        where = f"{env} (environment)"
    elif field in file_keys:
        where = f"{field} in {path}"
    else:
        where = env
    message = str(error["msg"]).removeprefix("Value error, ")
    # Secret values are never echoed back; other inputs help spot a typo.
    shown = "" if field in SECRET_FIELDS else f" (got {error['input']!r})"
    return f"invalid setting {where}: {message}{shown}"


def load_settings() -> Settings:
    """Read the configuration once; any problem raises SettingsError naming the setting."""
    path, required = _config_path()
    file_values = _read_file(path, required)
    try:
        return Settings(**file_values)
    except ValidationError as exc:
        raise SettingsError(_describe(exc.errors()[0], path, set(file_values))) from None


def unknown_env_settings() -> list[str]:
    """GATEWAY_* variables that name no setting: most likely typos, worth a warning."""
    known = {env_name(name) for name in Settings.model_fields} | NON_SETTING_ENV
    return sorted(k for k in os.environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
