"""`gateway sessions list|show|rename|delete`: the admin API's session routes on the command line."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta

import pytest

from gateway.cli import main
from tests.integration.test_admin_api import converse, seed_sessions


def test_cli_sessions(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", database_url)
    assert main(["sessions", "list"]) == 0  # migrates a new database first
    assert capsys.readouterr().out == "no sessions\n"

    asyncio.run(converse(database_url, "telegram:42", "Where is order 1001?", "Thanks"))
    now = datetime.now(UTC) - timedelta(hours=1)
    seed_sessions(
        database_url, [(f"whatsapp:1:{i}", f"Refund {i}", now - timedelta(minutes=i)) for i in range(3)]
    )

    assert main(["sessions", "list", "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "telegram:42" in lines[0]
    assert "Where is order 1001?" in lines[0]
    assert re.search(r"\s6\s", lines[0])  # its message count
    assert "whatsapp:1:0" in lines[1]
    more = re.fullmatch(r"more: gateway sessions list --cursor (\S+)", lines[2])
    assert more is not None
    assert main(["sessions", "list", "--limit", "2", "--cursor", more.group(1)]) == 0
    rest = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in rest] == ["whatsapp:1:1", "whatsapp:1:2"]

    assert main(["sessions", "list", "--platform", "whatsapp", "--query", "REFUND 2"]) == 0
    (only,) = capsys.readouterr().out.splitlines()
    assert "whatsapp:1:2" in only

    assert main(["sessions", "show", "telegram:42"]) == 0
    shown = capsys.readouterr().out
    assert "title     Where is order 1001?" in shown
    assert "platform  telegram" in shown
    assert "user: Where is order 1001?" in shown
    assert '-> check_order({"order_id": 1001})' in shown
    assert "model (Support): Anything else?" in shown

    assert main(["sessions", "rename", "telegram:42", "  VIP customer  "]) == 0
    assert "renamed to 'VIP customer'" in capsys.readouterr().out
    assert main(["sessions", "show", "telegram:42"]) == 0
    assert "title     VIP customer" in capsys.readouterr().out
    assert main(["sessions", "rename", "telegram:42", "   "]) == 2
    assert "title is empty" in capsys.readouterr().err

    assert main(["sessions", "delete", "telegram:42"]) == 0
    assert "session telegram:42 deleted" in capsys.readouterr().out
    for command in (["show", "telegram:42"], ["delete", "telegram:42"], ["rename", "telegram:42", "x"]):
        assert main(["sessions", *command]) == 1
        assert "no session 'telegram:42'" in capsys.readouterr().err
    assert main(["sessions", "list", "--cursor", "nonsense"]) == 2
    assert "invalid --cursor" in capsys.readouterr().err
