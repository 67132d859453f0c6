"""The admin API's rules for titles, ids and cursors: the Python checks agree with the patterns the
OpenAPI document publishes, and a cursor survives its round trip exactly."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.domain import sessions as session_rules
from gateway.domain.sessions import Cursor

# Text with the characters that matter here well represented: spaces of every kind, controls, others.
EDGY = st.text(
    alphabet=st.one_of(
        st.sampled_from(" \t\n\r\x00\x1f\x7f\x85\x9f\u00a0\u1680\u2000\u200a\u200b\u2028\u202f\u3000\ufeff"),
        st.characters(codec="utf-8"),
    ),
    max_size=210,
)


@given(EDGY)
def test_clean_title_accepts_exactly_what_the_published_pattern_does(title: str) -> None:
    published = len(title) <= session_rules.MAX_TITLE_LENGTH and re.fullmatch(
        session_rules.TITLE_PATTERN, title
    )
    try:
        cleaned = session_rules.clean_title(title)
    except ValueError:
        assert not published
    else:
        assert published
        assert cleaned == cleaned.strip(" \u00a0\u3000\ufeff\u2000")
        assert cleaned
        assert cleaned in title


@given(EDGY)
def test_session_ids_follow_the_published_pattern(session_id: str) -> None:
    published = bool(
        len(session_id) <= session_rules.MAX_SESSION_ID_LENGTH
        and re.fullmatch(session_rules.SESSION_ID_PATTERN, session_id)
    )
    assert session_rules.is_valid_session_id(session_id) == published


def test_rules_by_example() -> None:
    assert session_rules.clean_title("  Refund \u3000") == "Refund"
    for bad in ["", "   ", "\u3000\ufeff", "a\nb", "a\x00", "x" * 201, "\ud800"]:
        with pytest.raises(ValueError, match="title"):
            session_rules.clean_title(bad)
    assert session_rules.is_valid_session_id("whatsapp:1:a/b ü")
    assert not session_rules.is_valid_session_id("a\n")  # `$` would match before a final newline
    assert not session_rules.is_valid_session_id("x" * 256)
    assert not session_rules.is_valid_platform("telegram\n")
    assert session_rules.platform_of("telegram:1:2") == "telegram"
    assert session_rules.platform_of("no-colon") is None
    assert session_rules.platform_of(":x") is None


@given(
    # Hypothesis takes naive bounds and attaches the zone itself.
    st.datetimes(
        min_value=datetime(1970, 1, 1),  # noqa: DTZ001
        max_value=datetime(9000, 1, 1),  # noqa: DTZ001
        timezones=st.just(UTC),
    ),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cc"]), min_size=1, max_size=255),
)
def test_a_cursor_round_trips_exactly(updated_at: datetime, session_id: str) -> None:
    cursor = Cursor(updated_at, session_id)
    token = cursor.encode()
    assert re.fullmatch(r"[A-Za-z0-9_-]+", token)
    assert Cursor.decode(token) == cursor


def test_a_cursor_in_another_zone_is_the_same_instant() -> None:
    instant = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    shifted = Cursor(instant.astimezone(timezone(timedelta(hours=5))), "cli:x")
    assert Cursor.decode(shifted.encode()).updated_at == instant


@given(st.text(max_size=100))
def test_anything_else_is_not_a_cursor_or_decodes_to_a_valid_one(token: str) -> None:
    try:
        cursor = Cursor.decode(token)
    except ValueError:
        return
    assert cursor.updated_at.tzinfo is not None
    assert session_rules.is_valid_session_id(cursor.session_id)


def test_the_admin_token_is_a_secret_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.errors import SettingsError
    from gateway.settings import Settings, load_settings

    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-secret-token-value")
    loaded = load_settings()
    assert loaded.admin_token is not None
    assert "admin-secret-token-value" in loaded.secret_values()  # so the log redactor scrubs it
    assert "admin-secret-token-value" not in repr(loaded)
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "")
    assert load_settings().admin_token is None  # empty: the API stays off
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "has a space")
    with pytest.raises(SettingsError, match="GATEWAY_ADMIN_TOKEN") as caught:
        load_settings()
    assert "has a space" not in str(caught.value)
    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN")
    assert Settings().admin_token is None  # the default: off
