"""The layout rules of docs/architecture.md that import-linter cannot see."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "gateway"
STORE = PACKAGE / "store"
# SQL statements and the schema's table names: they belong to the store's modules, one home each.
SQL = re.compile(
    r"\b(SELECT\s.+\sFROM|INSERT\s+(OR\s+\w+\s+)?INTO|DELETE\s+FROM|UPDATE\s+\w+\s+SET|CREATE\s+TABLE)\b"
)
TABLE_NAME = re.compile(r"\bchatflow_\w+")


def _modules_outside_the_store() -> list[Path]:
    return [path for path in PACKAGE.rglob("*.py") if STORE not in path.parents]


def test_sql_and_table_names_live_only_in_the_store() -> None:
    found = []
    for path in _modules_outside_the_store():
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if SQL.search(line) or TABLE_NAME.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_the_rule_sees_sql_where_it_is() -> None:
    """The patterns above find what they look for (so the test above can fail)."""
    assert SQL.search("conn.execute('SELECT id FROM chatflow_inbox')")
    assert SQL.search('"INSERT OR IGNORE INTO chatflow_inbox (id) VALUES (?)"')
    assert SQL.search("UPDATE chatflow_outbox SET status = ?")
    assert TABLE_NAME.search("chatflow_sessions")
    store_hits = [
        p for p in STORE.rglob("*.py") if SQL.search(p.read_text()) or TABLE_NAME.search(p.read_text())
    ]
    assert store_hits  # the store does hold SQL: the scan reads real files


MAX_MODULE_LINES = 400
# Modules allowed to be longer, and why (docs/architecture.md: small rooms, or a written reason).
LONG_MODULES = {
    "gateway/store/sessions.py": "both session tables, every spelling of their statements, for the agents'"
    " store and the operators: one home per table",
    "gateway/platforms/telegram/adapter.py": "the table of every Telegram update kind and how it is read",
    "gateway/platforms/whatsapp/adapter.py": "the table of every WhatsApp message kind and how it is read",
    "gateway/settings.py": "every global setting with its description, the loader and its error messages",
}


def test_modules_are_small_or_say_why() -> None:
    long = {
        str(path.relative_to(REPO_ROOT)): length
        for path in PACKAGE.rglob("*.py")
        if (length := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert set(long) <= set(LONG_MODULES), {k: v for k, v in long.items() if k not in LONG_MODULES}
    # A reason for a module that got small again is stale: drop it.
    assert {name for name in LONG_MODULES if name not in long} == set()
