"""Telegram Bot API: adapter (inbound), api (Bot API client and sender), spec (the platform spec)."""
