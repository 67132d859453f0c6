"""Logging: JSON lines, bound context, and secrets that never reach the output."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
import structlog
import structlog.testing
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from gateway.logs import REDACTED, configure_logging
from gateway.store.engine import create_engine


def json_lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_json_mode_writes_one_object_per_line_for_structlog_and_stdlib(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "json")
    structlog.get_logger("t").info("thing_happened", count=3)
    logging.getLogger("uvicorn.error").info("Started server process")
    structlog.get_logger("t").debug("hidden_below_level")
    events = json_lines(capsys.readouterr().err)
    assert [e["event"] for e in events] == ["thing_happened", "Started server process"]
    assert events[0]["count"] == 3
    assert events[0]["level"] == "info"
    assert str(events[0]["timestamp"]).endswith("Z")


def test_exceptions_are_structured_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        structlog.get_logger("t").exception("work_failed")
    (event,) = json_lines(capsys.readouterr().err)
    assert event["event"] == "work_failed"
    assert "kaput" in json.dumps(event["exception"])


def test_secrets_are_redacted_by_value_and_by_field_name(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json", secrets=["tok-123456", "pa55-word"])
    log = structlog.get_logger("t")
    log.info("calling https://api.example/bottok-123456/send", nested={"url": "x://u:pa55-word@h"})
    log.info("header_seen", authorization="Bearer abc", app_secret="zzz", other="kept")
    logging.getLogger("sqlalchemy").warning("connect failed for pa55-word")
    err = capsys.readouterr().err
    assert "tok-123456" not in err
    assert "pa55-word" not in err
    assert "Bearer abc" not in err
    assert "zzz" not in err
    first, second, third = json_lines(err)
    assert first["event"] == f"calling https://api.example/bot{REDACTED}/send"
    assert second["authorization"] == REDACTED
    assert second["other"] == "kept"
    assert third["event"] == f"connect failed for {REDACTED}"


def test_console_mode_is_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "console")
    structlog.get_logger("t").info("thing_happened", count=3)
    err = capsys.readouterr().err
    assert "thing_happened" in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(err.splitlines()[0])


def test_events_below_the_level_are_dropped_before_any_processor(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", "json")
    seen: list[str] = []

    def spy(logger: object, method: str, event_dict: dict[str, object]) -> dict[str, object]:
        seen.append(str(event_dict["event"]))
        return event_dict

    processors = structlog.get_config()["processors"]
    structlog.configure(processors=[processors[0], spy, *processors[1:]])
    try:
        log = structlog.get_logger("t")
        log.info("not_built")
        log.debug("not_built_either")
        log.warning("kept", count=1)
        try:
            raise RuntimeError("kaput")
        except RuntimeError:
            log.exception("failed")  # logs at error, so it passes a warning level
    finally:
        structlog.configure(processors=processors)
    assert seen == ["kept", "failed"]
    assert [e["event"] for e in json_lines(capsys.readouterr().err)] == ["kept", "failed"]


def test_a_chain_without_the_level_filter_still_sees_every_event() -> None:
    configure_logging("warning", "json")
    with structlog.testing.capture_logs() as captured:
        structlog.get_logger("t").debug("debug_event", n=1)
        structlog.get_logger("t").info("info_event")
    assert [(e["event"], e["log_level"]) for e in captured] == [
        ("debug_event", "debug"),
        ("info_event", "info"),
    ]


def test_a_disabled_logger_logs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    logging.getLogger("quiet").disabled = True
    try:
        structlog.get_logger("quiet").error("hidden")
        structlog.get_logger("loud").info("shown")
    finally:
        logging.getLogger("quiet").disabled = False
    assert [e["event"] for e in json_lines(capsys.readouterr().err)] == ["shown"]


@pytest.mark.parametrize(("level", "httpx_level"), [("debug", logging.WARNING), ("error", logging.ERROR)])
def test_httpx_request_lines_are_not_logged_but_its_warnings_are(
    capsys: pytest.CaptureFixture[str], level: str, httpx_level: int
) -> None:
    configure_logging(level, "json")
    logging.getLogger("httpx").info('HTTP Request: POST http://example.test/ "HTTP/1.1 200 OK"')
    logging.getLogger("httpx").log(httpx_level, "kept")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["kept"]


def test_lines_go_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    configure_logging("info", "json")
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)  # as a test's capture (or a daemonizer) does
    structlog.get_logger("t").info("after_the_swap")
    assert json.loads(later.getvalue())["event"] == "after_the_swap"


TEXT = "kumquat-zephyr-message-text"


async def test_database_errors_carry_no_statement_parameters() -> None:
    engine = create_engine("sqlite+aiosqlite:///:memory:")
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT)"))
            await conn.execute(text("INSERT INTO t VALUES (1, 'first')"))
            with pytest.raises(IntegrityError) as caught:
                await conn.execute(text("INSERT INTO t VALUES (1, :body)"), {"body": TEXT})
    finally:
        await engine.dispose()
    assert "UNIQUE constraint failed" in str(caught.value)
    assert TEXT not in str(caught.value)
