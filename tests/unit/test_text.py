"""Long replies are cut into platform-sized messages at natural boundaries, losing nothing; lone
surrogates are replaced."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.domain.text import MAX_MESSAGE_CHARS, split_message, without_lone_surrogates


def test_short_text_is_one_part() -> None:
    assert split_message("  hello  ") == ["hello"]
    assert split_message("   ") == []


def test_paragraphs_come_first() -> None:
    first, second = "a" * 3000, "b" * 3000
    assert split_message(f"{first}\n\n{second}") == [first, second]


def test_then_sentences_then_spaces_then_hard_cuts() -> None:
    sentence = "word " * 10 + "end."
    parts = split_message(" ".join([sentence] * 200), limit=120)
    assert all(p.endswith("end.") for p in parts)
    assert split_message("aaaa bbbb cccc", limit=9) == ["aaaa bbbb", "cccc"]
    assert split_message("x" * 25, limit=10) == ["x" * 10, "x" * 10, "x" * 5]


@settings(max_examples=200, deadline=None, database=None)
@given(st.text(alphabet=st.sampled_from("ab .!?\n"), max_size=600), st.integers(5, 80))
def test_parts_fit_and_keep_every_word(text: str, limit: int) -> None:
    parts = split_message(text, limit)
    assert all(0 < len(p) <= limit for p in parts)
    assert "".join("".join(parts).split()) == "".join(text.split())  # nothing lost but whitespace


def test_default_limit_is_the_platforms() -> None:
    assert MAX_MESSAGE_CHARS == 4096
    assert [len(p) for p in split_message("y" * 5000)] == [4096, 904]


def test_lone_surrogates_become_replacement_characters_and_pairs_stay() -> None:
    parsed = json.loads('{"a\\udc00": ["\\ud83d", {"b": "ok \\ud83d\\ude00 \\udfff end"}], "n": 1}')
    assert without_lone_surrogates(parsed) == {
        "a\ufffd": ["\ufffd", {"b": "ok \U0001f600 \ufffd end"}],
        "n": 1,
    }
