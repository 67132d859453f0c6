"""chatflow-gateway: WhatsApp and Telegram webhooks to agent replies, with durable SQL sessions."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("chatflow-gateway")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0"
