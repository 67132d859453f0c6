"""structlog set-up, done once by whoever starts the process (the CLI or a test), never at import.

Standard-library loggers (uvicorn, alembic, sqlalchemy) go through the same processors, so json
mode really is one JSON object per line whatever wrote it. A redactor replaces every configured
secret, wherever it appears in an event, and any field whose name says it holds one.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, Literal, TextIO

import structlog
from structlog.types import EventDict, Processor

REDACTED = "***"
_SECRET_KEY = re.compile(r"(token|secret|password|passwd|signature|authorization|api_key|apikey)", re.I)


class SecretRedactor:
    """Scrubs known secret values and secret-named fields from every event."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self._secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {k: REDACTED if _is_secret_key(k) else self._scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._scrub(v) for v in value]
        return value

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> EventDict:
        for key, value in list(event_dict.items()):
            event_dict[key] = REDACTED if _is_secret_key(key) else self._scrub(value)
        return event_dict


def _is_secret_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_SECRET_KEY.search(key))


# The level of each logging method of structlog's stdlib BoundLogger ("exception" logs at error).
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


class LevelFilteringBoundLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib BoundLogger that drops an event below the level before building it.

    `filter_by_level`, first in the chain, would drop it as well, but only after the event dict is
    built and by raising DropEvent: microseconds on every request for events nobody sees
    (request_finished, webhook_accepted at the default warning level of a busy service). The early
    check is that same check, and only made while `filter_by_level` leads the chain, so a chain
    without it (structlog.testing.capture_logs) still sees every event.
    """

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: str, **event_kw: Any
    ) -> Any:
        processors = self._processors
        if isinstance(processors, list) and processors and processors[0] is structlog.stdlib.filter_by_level:
            level = _METHOD_LEVELS.get(method_name)
            logger = self._logger
            if level is not None and (logger.disabled or level < logger.getEffectiveLevel()):
                return None
        return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)


def will_log(logger: logging.Logger, level: int) -> bool:
    """Whether an event at `level` on the stdlib `logger` of that name would be logged.

    A test of a fraction of a microsecond, for hot paths to skip building an event nobody will see
    (even dropped early, a structlog call costs microseconds: the lazy logger is bound anew each
    time). True whenever the chain does not start with `filter_by_level`, as under
    structlog.testing.capture_logs, which sees every event.
    """
    if logger.isEnabledFor(level):
        return True
    processors = structlog.get_config()["processors"]
    return not (processors and processors[0] is structlog.stdlib.filter_by_level)


def _drop_color_message(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> EventDict:
    # uvicorn duplicates its message with ANSI colours in this extra field.
    event_dict.pop("color_message", None)
    return dict(event_dict)


def configure_logging(
    level: str = "info", fmt: Literal["json", "console"] = "json", secrets: Iterable[str] = ()
) -> None:
    """Route structlog and standard logging through one chain of processors to stderr."""
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _drop_color_message,
    ]
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.dict_tracebacks)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    shared.append(SecretRedactor(secrets))  # last, so tracebacks rendered above are scrubbed too

    structlog.configure(
        # Drop events below the level before any processor runs (each costs microseconds per request).
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=LevelFilteringBoundLogger,
        cache_logger_on_first_use=False,  # tests reconfigure; a cached logger would keep old settings
    )
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's own access log is replaced by the gateway's request_finished event.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    # httpx logs every platform and model call at info ("HTTP Request: POST …"): one line per reply,
    # saying less than the gateway's own events. Its warnings still come through.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
    # Alembic narrates every step at INFO; the gateway logs its own database_migrated event instead.
    logging.getLogger("alembic").setLevel(max(root.level, logging.WARNING))


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a line is logged, not when logging was set up: a
    replaced stream (a test's capture, then closed) must not take later lines down with it."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        """StreamHandler.__init__ assigns one; ignored."""
