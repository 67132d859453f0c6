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
