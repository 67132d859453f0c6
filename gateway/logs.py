"""structlog set-up, done once by whoever starts the process (the CLI or a test), never at import.

Standard-library loggers (uvicorn, alembic, sqlalchemy) go through the same processors, so json
mode really is one JSON object per line whatever wrote it. Last before rendering, every event is
redacted and bounded (gateway/log_safety.py): no secret, message text or phone number, and no line over
MAX_LINE_BYTES. Tracebacks never show local variables, which hold payloads, phone numbers and message
text; a traceback keeps its first and last frames.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Iterable, MutableMapping
from typing import Any, Literal, TextIO

import structlog
import structlog.tracebacks
from structlog.typing import EventDict, ExceptionTransformer, ExcInfo, Processor

from gateway.log_safety import MAX_LINE_BYTES, REDACTED, BoundedRenderer, Sanitizer, UserIds

__all__ = ["MAX_LINE_BYTES", "REDACTED", "configure_logging", "will_log"]
MAX_FRAMES = 20  # traceback frames per exception (the first and last ten)


def _plain_traceback(exc_info: ExcInfo) -> str:
    return "".join(traceback.format_exception(*exc_info))


def _render_exception(formatter: ExceptionTransformer) -> Processor:
    """structlog's ExceptionRenderer, but a traceback that cannot be rendered costs its frames, not the
    event (or, raised in a log call, the caller's work)."""
    render = structlog.processors.ExceptionRenderer(formatter)

    def processor(logger: Any, method: str, event_dict: EventDict) -> EventDict:
        try:
            return render(logger, method, event_dict)
        except Exception as exc:
            event_dict["exception"] = f"<traceback not rendered: {type(exc).__name__}>"
            return event_dict

    return processor


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
    level: str = "info",
    fmt: Literal["json", "console"] = "json",
    secrets: Iterable[str] = (),
    *,
    redact_users: bool = False,
) -> None:
    """Route structlog and standard logging through one chain of processors to stderr.

    `secrets` are never written; with `redact_users`, user ids and names are written as keyed hashes.
    """
    secrets = list(secrets)
    renderer: Processor
    exceptions: ExceptionTransformer
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        exceptions = structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=MAX_FRAMES)
    else:
        # Plain text tracebacks (rich's and better-exceptions' show locals), rendered before the bounds.
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        exceptions = _plain_traceback
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _drop_color_message,
        _render_exception(exceptions),
    ]

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
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                Sanitizer(secrets, UserIds(redact_users, secrets), json=fmt == "json"),
                BoundedRenderer(renderer),
            ],
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
    # aiosqlite's debug lines are the repr of each call: SQL with its parameters (message text, phones).
    logging.getLogger("aiosqlite").setLevel(max(root.level, logging.INFO))


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is when a line is logged, not when logging was set up: a
    replaced stream (a test's capture, then closed) must not take later lines down with it."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:
        """StreamHandler.__init__ assigns one; ignored."""

    def handleError(self, record: logging.LogRecord) -> None:
        """One short line instead of logging's own report, which prints the record's message and
        arguments (payloads, phone numbers) unredacted and unbounded."""
        error = type(sys.exc_info()[1]).__name__
        try:
            sys.stderr.write(
                f'{{"event": "log_record_failed", "error": "{error}", "level": "error", '
                f'"logger": "gateway.logs", "failed_level": "{record.levelname.lower()[:10]}"}}\n'
            )
        except Exception:
            return
