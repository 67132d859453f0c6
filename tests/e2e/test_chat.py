"""`gateway chat`: a terminal conversation with the configured agent, persisted in the configured database."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import GATEWAY, free_port, gateway_env

pytestmark = pytest.mark.e2e


def chat(cwd: Path, lines: list[str], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAY, "chat", *args],
        cwd=cwd,
        env=gateway_env(GATEWAY_LOG_FORMAT="json", **env),
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chat_with_the_demo_agent_persists_and_resumes(tmp_path: Path) -> None:
    first = chat(tmp_path, ["hello", "order 1001", "I want a refund for order 1002"], "--session", "t1")
    assert first.returncode == 0, first.stderr
    assert "New session t1 with Support" in first.stdout
    assert "Support> Order 1001 is shipped" in first.stdout
    assert "Billing> Refund RF-1002 is open" in first.stdout
    assert (tmp_path / "data" / "gateway.db").is_file()

    second = chat(tmp_path, ["where is order 1003?", "exit", "never sent"], "--session", "t1")
    assert second.returncode == 0, second.stderr
    assert "Resuming session t1 (12 messages) with Billing" in second.stdout
    assert "Support> Order 1003 is delivered" in second.stdout
    assert "never sent" not in second.stdout


def test_chat_with_a_custom_agent_module(tmp_path: Path) -> None:
    (tmp_path / "my_bot.py").write_text(
        "from gateway.agents import Agent, Rule, ScriptedModel\n"
        "bot = Agent('Parrot', 'Repeat.', model=ScriptedModel([Rule(r'(?P<w>\\w+)', reply='{w}! {w}!')]))\n"
    )
    result = chat(tmp_path, ["polly"], GATEWAY_AGENT="my_bot:bot", PYTHONPATH=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Parrot> polly! polly!" in result.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module:agent", "cannot import 'no_such_module'"),
        ("gateway.demo:ORDERS", "is dict, not an Agent"),
    ],
)
def test_a_bad_agent_setting_exits_2_with_one_line(tmp_path: Path, spec: str, message: str) -> None:
    result = chat(tmp_path, [], GATEWAY_AGENT=spec)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "GATEWAY_AGENT" in lines[0]
    assert message in lines[0]


@pytest.mark.slow
def test_a_failing_model_does_not_end_the_chat(tmp_path: Path) -> None:
    (tmp_path / "llm_bot.py").write_text(
        "from gateway.agents import Agent\nbot = Agent('Llm', 'Be brief.')\n"
    )
    # Nothing listens on this port: each turn fails with a ModelError once the retries are spent.
    result = chat(
        tmp_path,
        ["hello", "hello again"],
        "--session",
        "f1",
        GATEWAY_AGENT="llm_bot:bot",
        GATEWAY_MODEL="openai:test-model",
        GATEWAY_OPENAI_BASE_URL=f"http://127.0.0.1:{free_port()}/v1",
        PYTHONPATH=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(the model failed:") == 2
    resumed = chat(tmp_path, [], "--session", "f1")
    assert "New session f1" in resumed.stdout  # the failed turns stored nothing


@pytest.mark.parametrize("session", ["s" * 256, "tab\there"])
def test_chat_refuses_a_session_id_no_session_can_have(tmp_path: Path, session: str) -> None:
    """A 256-character id reached the database: PostgreSQL refused it as 'cannot use the database'."""
    result = chat(tmp_path, ["hello"], "--session", session)
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        "argument --session: 1 to 255 characters, none of them a control character"
    )
    assert not (tmp_path / "data").exists(), "nothing may be created when the command is refused"
