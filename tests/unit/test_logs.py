"""Logging: JSON lines, bound context, and what never reaches the output: secrets, locals, message text,
phone numbers, names, and lines over the bound."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import sys
from typing import Literal

import pytest
import structlog
import structlog.testing
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from structlog.typing import EventDict, WrappedLogger

from gateway.log_safety import MAX_LINE_BYTES
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

    def spy(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
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


# --- what a line may carry, and how long it may be (issue 12, item 7) ---------------------------------

PHONE = "447700900123"
TEXT = "kumquat-zephyr-message-text"
SECRETS = ["wa-app-secret-Hx81Qz", "7700112233:tg-bot-token"]


def failing_handler(update: dict[str, object], phone: str) -> None:
    """Raises with the update and the phone in its locals, as a webhook handler would hold them."""
    note = f"{TEXT} from {phone}"
    raise ValueError(f"cannot handle update {len(update)} ({len(note)} chars)")


def raise_from_handler() -> ValueError:
    try:
        failing_handler({"text": {"body": TEXT}, "from": PHONE}, PHONE)
    except ValueError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_never_show_locals(
    capsys: pytest.CaptureFixture[str], fmt: Literal["json", "console"]
) -> None:
    configure_logging("debug", fmt)
    exc = raise_from_handler()
    structlog.get_logger("t").error("request_failed", exc_info=exc)
    logging.getLogger("uvicorn.error").error("Exception in ASGI application", exc_info=exc)
    err = capsys.readouterr().err
    assert err.count("cannot handle update 2") == 2  # both tracebacks were rendered
    assert "failing_handler" in err  # with their frames
    assert TEXT not in err
    assert PHONE not in err


def test_a_40_mb_990_deep_event_renders_under_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json", secrets=SECRETS)
    log, deep, huge = big_event_parts()
    log.error("huge_event", payload=deep, huge=huge, items=list(range(100_000)), nul="\x00" * 5000)
    logging.getLogger("sqlalchemy.engine").error("%s", huge)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 2
    assert max(len(line.encode()) for line in lines) <= MAX_LINE_BYTES
    event, stdlib = json_lines(err)
    assert event["event"] == "huge_event"
    assert event["truncated"] is True
    assert str(event["huge"]).startswith("start-xxx")
    assert f"[{len(huge)} chars, cut]" in str(event["huge"])
    assert "nested over" in json.dumps(event["payload"])
    assert SECRETS[0] not in err  # the tail of a cut string is redacted too
    assert str(stdlib["event"]).startswith("start-xxx")


def big_event_parts() -> tuple[structlog.stdlib.BoundLogger, object, str]:
    """A logger, a value nested 990 levels deep and a 40 MB string ending with a secret."""
    deep: object = PHONE
    for _ in range(990):
        deep = {"k": deep}
    return structlog.get_logger("t"), deep, "start-" + "x" * (40 * 1024 * 1024) + SECRETS[0]


def test_a_40_mb_990_deep_event_stays_under_the_bound_in_console_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "console", secrets=SECRETS)
    log, deep, huge = big_event_parts()
    log.error("huge_event", payload=deep, huge=huge, items=list(range(100_000)), text=f"é{TEXT}" * 1000)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert len(lines[0].encode()) <= MAX_LINE_BYTES
    assert "huge_event" in lines[0]
    assert "truncated" in lines[0]
    assert SECRETS[0] not in lines[0]
    assert TEXT not in lines[0]


def test_characters_that_json_escapes_count_six_times_against_the_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "json")
    structlog.get_logger("t").warning("escaped", **{f"f{i}": "\x01é" * 500 for i in range(30)})
    (line,) = capsys.readouterr().err.splitlines()
    assert len(line) <= MAX_LINE_BYTES
    event = json.loads(line)
    assert event["truncated"] is True
    assert str(event["f0"]).startswith("\x01é\x01é")  # cut, not dropped


def test_a_line_still_over_the_bound_is_written_in_its_short_form(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    grid = [[1.2345678901234567e-300] * 40 for _ in range(40)]  # numbers are not cut, only counted
    structlog.get_logger("t").warning("numbers", request_id="r-1", grid=grid)
    (line,) = capsys.readouterr().err.splitlines()
    assert len(line) <= MAX_LINE_BYTES
    event = json.loads(line)
    assert (event["event"], event["request_id"]) == ("numbers", "r-1")
    assert "grid" not in event
    assert str(event["truncated"]).startswith("line over 16384 bytes")


def test_a_deep_traceback_keeps_its_first_and_last_frames(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")

    def recurse(n: int) -> None:
        if n == 0:
            raise RuntimeError("bottom")
        recurse(n - 1)

    try:
        recurse(500)
    except RuntimeError:
        structlog.get_logger("t").exception("deep_failure")
    (line,) = capsys.readouterr().err.splitlines()
    assert len(line) <= MAX_LINE_BYTES
    (exception,) = json.loads(line)["exception"]
    names = [frame["name"] for frame in exception["frames"]]
    assert len(names) == 21  # ten, a marker, ten
    assert names[0] == "test_a_deep_traceback_keeps_its_first_and_last_frames"
    assert names[10] == "Skipped frames: 482"  # of 502: this test and recurse(500) to recurse(0)
    assert names[-1] == "recurse"
    assert exception["exc_value"] == "bottom"


def test_by_default_phones_are_masked_and_names_and_texts_never_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "json")
    structlog.get_logger("t").warning(
        f"failed for +{PHONE}",
        session_id=f"whatsapp:106540352242922:{PHONE}",
        chat_id=7301234567,
        user_name="Zebulon Quixmore",
        text=TEXT,
        message_id="wamid.HBgLMTY1MDU1NTAxMDEVAgARGBI5QTNDQTVCM0Q0Q0Q2RTY3RTcA",
        request_id="8d96d46022d9421795e1283a2c09ede1",
        update_id=830000101,
    )
    err = capsys.readouterr().err
    (event,) = json_lines(err)
    assert event["event"] == "failed for ***0123"
    assert event["session_id"] == "whatsapp:***2922:***0123"
    assert event["chat_id"] == "***4567"
    assert event["user_name"] == REDACTED
    assert event["text"] == f"[{len(TEXT)} chars]"
    assert event["message_id"] == "wamid.***Y3RTcA"  # its base64 spells the phone
    assert event["request_id"] == "8d96d46022d9421795e1283a2c09ede1"  # digits inside a word are kept
    assert event["update_id"] == 830000101  # a number in a field that names no user
    for leaked in (PHONE, "Quixmore", TEXT, "MTY1MDU1NTAxMDE"):
        assert leaked not in err


def test_redact_users_writes_a_keyed_hash_the_same_for_one_user_on_every_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "json", secrets=SECRETS, redact_users=True)
    log = structlog.get_logger("t")
    log.info("turn_failed", session_id=f"whatsapp:106540352242922:{PHONE}")
    log.info("lookup", user_id=f"+{PHONE}", user_name="Zebulon Quixmore")
    logging.getLogger("uvicorn.error").warning(f"GET /api/sessions/whatsapp:106540352242922:{PHONE}")
    first = json_lines(capsys.readouterr().err)
    platform, business, user = str(first[0]["session_id"]).split(":")
    assert platform == "whatsapp"
    assert re.fullmatch(r"id_[0-9a-f]{10}", user)
    assert first[1]["user_id"] == user  # the phone, with or without +, in a field or in free text
    assert first[2]["event"] == f"GET /api/sessions/whatsapp:{business}:{user}"
    assert re.fullmatch(r"id_[0-9a-f]{10}", str(first[1]["user_name"]))
    assert user != "id_" + hashlib.sha256(PHONE.encode()).hexdigest()[:10]  # not an unkeyed hash

    configure_logging("info", "json", secrets=SECRETS, redact_users=True)  # a restart: the same key
    structlog.get_logger("t").info("again", user_id=PHONE)
    configure_logging("info", "json", secrets=["another-secret-entirely"], redact_users=True)
    structlog.get_logger("t").info("other_key", user_id=PHONE)
    again, other = json_lines(capsys.readouterr().err)
    assert again["user_id"] == user
    assert other["user_id"] != user


def test_a_record_that_cannot_be_formatted_writes_one_safe_line(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    logging.getLogger("somelib").info("%d items", f"{TEXT} from {PHONE}")  # a broken format string
    err = capsys.readouterr().err
    assert TEXT not in err
    assert PHONE not in err
    (event,) = json_lines(err)
    assert event["event"] == "log_record_failed"
    assert event["error"] == "TypeError"


def test_aiosqlite_debug_lines_with_statement_parameters_are_not_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("debug", "json")
    logging.getLogger("aiosqlite").debug("executing %s", f"INSERT ... ('{TEXT}',)")
    logging.getLogger("aiosqlite").info("exception occurred while closing connection")
    assert [e["event"] for e in json_lines(capsys.readouterr().err)] == [
        "exception occurred while closing connection"
    ]


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
