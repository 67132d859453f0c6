"""Every payload of the corpus from the wild (tests/payloads/corpus, see its SOURCES.md), posted signed to
one running `gateway serve`, stored as its expected file says; then each again with the wire's
variations, which must change nothing the agent or the conversation sees.

Expected files (tests/payloads/corpus/expected/<platform>/<source>/<name>.json) hold, per payload, the
webhook's answer, the dedup keys it stored (messages, statuses, membership changes) and each stored
message's kind, conversation, the text the agent reads and whether it starts a turn. After a deliberate
change of behaviour, `GATEWAY_CORPUS_WRITE=1 pytest tests/e2e/test_corpus.py` rewrites them; review the diff.

One gateway serves the whole corpus (an SQLite file, the demo agent), with Telegram and WhatsApp
pointed at fakes on loopback; payloads are posted one after the other, so the rows and keys that are
new after a post are that post's.
"""

from __future__ import annotations

import copy
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.platforms.telegram.adapter import SECRET_HEADER
from gateway.platforms.whatsapp.adapter import SIGNATURE_HEADER, WhatsAppAdapter
from gateway.store.tables import InboxRow, ProcessedMessageRow
from tests.fakes import FakeTelegram, FakeWhatsApp
from tests.helpers import serve_in_thread
from tests.serve_process import ServeProcess, serve_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CORPUS = Path(__file__).resolve().parents[1] / "payloads" / "corpus"
EXPECTED = CORPUS / "expected"
WRITE = os.environ.get("GATEWAY_CORPUS_WRITE") == "1"
MIN_PAYLOADS = 150
APP_SECRET = "corpus-app-secret"
TG_SECRET = "corpus-secret-token"
BOT_TOKEN = "807:corpus-bot-token"  # nutgram's fixtures name their bot 807, username foo_bot
BOT_USERNAME = "foo_bot"


@dataclass(frozen=True)
class Case:
    platform: str
    name: str  # <platform>/<source>/<file stem>
    path: Path

    @property
    def expected_path(self) -> Path:
        return EXPECTED / f"{self.name}.json"

    def payload(self) -> Any:
        return json.loads(self.path.read_bytes())


def corpus() -> list[Case]:
    cases = []
    for platform in ("telegram", "whatsapp"):
        for path in sorted((CORPUS / platform).rglob("*.json")):
            name = path.relative_to(CORPUS).with_suffix("").as_posix()
            cases.append(Case(platform, name, path))
    return cases


CASES = corpus()


# --- the gateway under test, and what one post stored --------------------------------------------------


class Corpus:
    """Posts to the gateway and reads back what each post stored."""

    def __init__(self, served: ServeProcess, db: Path) -> None:
        self.served = served
        self.http = httpx.Client(base_url=served.base, timeout=60)
        self.db = sqlite3.connect(db)
        self.last_row = 0
        self.keys: set[str] = set()

    def post(self, platform: str, body: bytes) -> dict[str, Any]:
        headers = {"content-type": "application/json"}
        if platform == "whatsapp":
            headers[SIGNATURE_HEADER] = WhatsAppAdapter.sign(APP_SECRET, body)
        else:
            headers[SECRET_HEADER] = TG_SECRET
        response = self.http.post(f"/webhooks/{platform}", content=body, headers=headers)
        try:
            answer: Any = response.json()
        except ValueError:
            answer = response.text
        return {"status_code": response.status_code, "answer": answer, **self._stored()}

    def _stored(self) -> dict[str, Any]:
        keys = {
            key for (key,) in self.db.execute(f"SELECT message_key FROM {ProcessedMessageRow.__tablename__}")
        }
        new_keys, self.keys = sorted(keys - self.keys), keys
        table = InboxRow.__tablename__
        query = f"SELECT id, kind, session_id, text, status FROM {table} WHERE id > ? ORDER BY id"
        rows = self.db.execute(query, (self.last_row,)).fetchall()
        if rows:
            self.last_row = rows[-1][0]
        messages = [
            {"kind": kind, "session": session, "text": text, "turn": status != "recorded"}
            for _, kind, session, text, status in rows
        ]
        return {"keys": new_keys, "messages": messages}

    def close(self) -> None:
        self.http.close()
        self.db.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    cwd = tmp_path_factory.mktemp("corpus")
    telegram, whatsapp = FakeTelegram(BOT_TOKEN, username=BOT_USERNAME), FakeWhatsApp()
    with serve_in_thread(telegram.app) as telegram_url, serve_in_thread(whatsapp.app) as whatsapp_url:
        settings = {
            "GATEWAY_DATABASE_URL": f"sqlite+aiosqlite:///{cwd / 'gateway.db'}",
            "GATEWAY_WHATSAPP_APP_SECRET": APP_SECRET,
            "GATEWAY_WHATSAPP_ACCESS_TOKEN": "corpus-access-token",
            "GATEWAY_WHATSAPP_API_BASE": whatsapp_url,
            "GATEWAY_WHATSAPP_GLOBAL_PER_SECOND": "0",
            "GATEWAY_TELEGRAM_SECRET_TOKEN": TG_SECRET,
            "GATEWAY_TELEGRAM_BOT_TOKEN": BOT_TOKEN,
            "GATEWAY_TELEGRAM_BOT_USERNAME": BOT_USERNAME,
            "GATEWAY_TELEGRAM_API_BASE": telegram_url,
            "GATEWAY_TELEGRAM_CHAT_PER_SECOND": "0",
            "GATEWAY_TELEGRAM_GROUP_PER_MINUTE": "0",
            "GATEWAY_TELEGRAM_GLOBAL_PER_SECOND": "0",
            "GATEWAY_LOCAL_KEY_FILE": "",
            "GATEWAY_LOG_LEVEL": "warning",
        }
        with serve_process(cwd, **settings) as served:  # type: ignore[arg-type]
            posted = Corpus(served, cwd / "gateway.db")
            try:
                yield posted
            finally:
                posted.close()


# --- the corpus as it came -------------------------------------------------------------------------------


def test_the_corpus_is_big_enough_and_every_payload_has_its_sources_entry() -> None:
    assert len(CASES) >= MIN_PAYLOADS
    assert {case.platform for case in CASES} == {"telegram", "whatsapp"}
    sources = (CORPUS / "SOURCES.md").read_text(encoding="utf-8")
    missing = [case.name for case in CASES if f"`{case.name}.json`" not in sources]
    assert not missing, f"{len(missing)} payloads are not in SOURCES.md: {missing[:5]}"


def test_every_payload_is_stored_as_expected(gateway: Corpus) -> None:
    mismatches = []
    for number, case in enumerate(CASES):
        body = json.dumps(fresh_ids(case.platform, case.payload(), number), ensure_ascii=False)
        observed = gateway.post(case.platform, body.encode())
        assert observed["status_code"] < 500, (case.name, observed)
        if WRITE:
            case.expected_path.parent.mkdir(parents=True, exist_ok=True)
            case.expected_path.write_text(json.dumps(observed, indent=2, ensure_ascii=False) + "\n")
            continue
        expected = json.loads(case.expected_path.read_text(encoding="utf-8"))
        if observed != expected:
            mismatches.append((case.name, expected, observed))
    assert not mismatches, f"{len(mismatches)} payloads stored otherwise than expected, e.g. {mismatches[:2]}"
    names = {case.name for case in CASES}
    stale = [
        p for p in EXPECTED.rglob("*.json") if p.relative_to(EXPECTED).with_suffix("").as_posix() not in names
    ]
    assert not stale, f"expected files without a payload: {stale}"


# --- the wire's variations -------------------------------------------------------------------------------

Variant = Callable[[Any], bytes]
EXTRA_FIELD = "x_corpus_extra"
# Fields the platforms document as optional that change nothing the agent reads when absent.
OPTIONAL_FIELDS = {
    "telegram": {"username", "language_code", "is_premium", "file_size", "link_preview_options"},
    "whatsapp": {
        "profile",
        "display_phone_number",
        "sha256",
        "mime_type",
        "referral",
        "conversation",
        "pricing",
        "biz_opaque_callback_data",
    },
}


def _walk(
    value: Any, on_dict: Callable[[dict[str, Any]], dict[str, Any]], on_leaf: Callable[[Any], Any]
) -> Any:
    if isinstance(value, dict):
        return on_dict({key: _walk(item, on_dict, on_leaf) for key, item in value.items()})
    if isinstance(value, list):
        return [_walk(item, on_dict, on_leaf) for item in value]
    return on_leaf(value)


def numbers_as_strings(payload: Any) -> bytes:
    def leaf(value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    return json.dumps(_walk(payload, lambda d: d, leaf)).encode()


def unknown_fields(payload: Any) -> bytes:
    """An unknown field first in every object (a newer API version, a proxy's annotation)."""
    return json.dumps(
        _walk(payload, lambda d: {EXTRA_FIELD: {"added": [1, "two", None]}, **d}, lambda v: v)
    ).encode()


def unicode_escapes(payload: Any) -> bytes:
    """Every non-ASCII character as \\uXXXX and "/" as "\\/", as Meta writes its bodies."""
    return json.dumps(payload, ensure_ascii=True, separators=(",", ":")).replace("/", "\\/").encode()


def without_optional(platform: str) -> Variant:
    drop = OPTIONAL_FIELDS[platform]

    def variant(payload: Any) -> bytes:
        return json.dumps(
            _walk(payload, lambda d: {k: v for k, v in d.items() if k not in drop}, lambda v: v)
        ).encode()

    return variant


def fresh_ids(platform: str, payload: Any, case: int, variant: int = 0) -> Any:
    """The payload as an update of its own: the corpus's sources reuse ids (update_id 1, "wamid.ID"), and
    a variant must not be a duplicate of its original. A new update_id, or a suffix to each wamid."""
    payload = copy.deepcopy(payload)
    if platform == "telegram":
        if isinstance(payload, dict) and "update_id" in payload:
            payload["update_id"] = 1_000_000_000 + 10 * case + variant
        return payload
    for entry in payload.get("entry", []) if isinstance(payload, dict) else []:
        for change in entry.get("changes", []):
            value = change.get("value")
            items = (
                [*value.get("messages", []), *value.get("statuses", [])] if isinstance(value, dict) else []
            )
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("id"), str):
                    item["id"] += f"~{case}.{variant}"
    return payload


def variants(platform: str) -> dict[str, Variant]:
    return {
        "numbers_as_strings": numbers_as_strings,
        "unknown_fields": unknown_fields,
        "without_optional_fields": without_optional(platform),
        "unicode_escapes": unicode_escapes,
    }


def test_the_wires_variations_change_nothing_the_agent_sees(gateway: Corpus) -> None:
    if WRITE:
        pytest.skip(reason="GATEWAY_CORPUS_WRITE=1 rewrites the expected files; variants compare with them")
    differences = []
    for number, case in enumerate(CASES):
        expected = json.loads(case.expected_path.read_text(encoding="utf-8"))
        for n, (name, variant) in enumerate(variants(case.platform).items(), start=1):
            payload = fresh_ids(case.platform, case.payload(), number, n)
            observed = gateway.post(case.platform, variant(payload))
            assert observed["status_code"] < 500, (case.name, name, observed)
            same = (
                observed["status_code"] == expected["status_code"]
                and len(observed["keys"]) == len(expected["keys"])
                and observed["messages"] == expected["messages"]
            )
            if not same:
                differences.append((case.name, name, expected, observed))
    assert not differences, f"{len(differences)} variants changed what is stored, e.g. {differences[:3]}"
