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
        token = settings.telegram_bot_token
        adapters["telegram"] = TelegramAdapter(
            settings.telegram_secret_token.get_secret_value(),
            # Without a bot token the bot id is unknown; dedup keys then use "0" for it.
            TelegramAdapter.bot_id_from_token(token.get_secret_value()) if token else "0",
        )
    return adapters


def sends_for_real(settings: Settings, platform: str) -> bool:
    token = settings.whatsapp_access_token if platform == "whatsapp" else settings.telegram_bot_token
    return token is not None
