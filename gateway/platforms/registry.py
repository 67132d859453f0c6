"""The platforms the gateway knows, and which of them the settings enable.

A platform is enabled when its webhook secret is configured; its routes answer 404 otherwise.
Adding a platform: one adapter module, one settings group, one entry here.
"""

from __future__ import annotations

from gateway.platforms.base import PlatformAdapter
from gateway.platforms.telegram import TelegramAdapter
from gateway.platforms.whatsapp import WhatsAppAdapter
from gateway.settings import Settings

PLATFORMS = ("whatsapp", "telegram")
# The setting that enables each platform, for the 404 that explains a disabled one.
ENABLING_SETTING = {"whatsapp": "GATEWAY_WHATSAPP_APP_SECRET", "telegram": "GATEWAY_TELEGRAM_SECRET_TOKEN"}
# Without this token a platform's replies are logged instead of sent (dry-run).
SENDING_SETTING = {"whatsapp": "GATEWAY_WHATSAPP_ACCESS_TOKEN", "telegram": "GATEWAY_TELEGRAM_BOT_TOKEN"}


def enabled_adapters(settings: Settings) -> dict[str, PlatformAdapter]:
    adapters: dict[str, PlatformAdapter] = {}
    if settings.whatsapp_app_secret is not None:
        adapters["whatsapp"] = WhatsAppAdapter(settings.whatsapp_app_secret.get_secret_value())
    if settings.telegram_secret_token is not None:
        adapters["telegram"] = TelegramAdapter(
            settings.telegram_secret_token.get_secret_value(), telegram_bot_id(settings)
        )
    return adapters


def local_adapters(settings: Settings, key: str) -> dict[str, PlatformAdapter]:
    """Adapters checking the local mode's key, for each platform whose own secret is not configured."""
    adapters: dict[str, PlatformAdapter] = {}
    if settings.whatsapp_app_secret is None:
        adapters["whatsapp"] = WhatsAppAdapter(key)
    if settings.telegram_secret_token is None:
        adapters["telegram"] = TelegramAdapter(key, telegram_bot_id(settings))
    return adapters


def webhook_secret(settings: Settings, platform: str) -> str | None:
    """The secret a platform signs its webhooks with, when configured."""
    secret = settings.whatsapp_app_secret if platform == "whatsapp" else settings.telegram_secret_token
    return None if secret is None else secret.get_secret_value()


def telegram_bot_id(settings: Settings) -> str:
    """The bot's id, from its token; without a token it is unknown and dedup keys use "0" for it."""
    token = settings.telegram_bot_token
    return TelegramAdapter.bot_id_from_token(token.get_secret_value()) if token else "0"


def sends_for_real(settings: Settings, platform: str) -> bool:
    token = settings.whatsapp_access_token if platform == "whatsapp" else settings.telegram_bot_token
    return token is not None
