"""The gateway's exception tree. Only web/errors.py maps these to HTTP answers."""


class GatewayError(Exception):
    """Base of every error the gateway raises on purpose."""


class SettingsError(GatewayError):
    """A setting is invalid, unknown or unreadable; start-up stops (exit code 2)."""


class DatabaseUnavailableError(GatewayError):
    """The database cannot be reached; start-up stops (exit code 1)."""
