"""Logging: JSON lines, bound context, and secrets that never reach the output."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from gateway.logs import REDACTED, configure_logging


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
