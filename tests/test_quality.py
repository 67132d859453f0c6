"""Lint, types and the dependency rule are part of the suite: a violation fails the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "gateway", "migrations", "tests"],
        ["ruff", "format", "--check", "gateway", "migrations", "tests"],
        ["mypy", "gateway", "tests"],
        ["lint-imports"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict", "import-linter"],
)
def test_tool_passes(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
