"""WhatsApp Cloud API: adapter (inbound), api (sender), spec (the platform spec)."""
