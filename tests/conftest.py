"""Fixtures of the core's tests; the test kit (plugtrain.testing, a pytest plugin) gives
the rest."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    """The repository's root folder."""
    return REPO


def _readme_command(repo: Path, label: str) -> str:
    text = (repo / "README.md").read_text()
    match = re.search(rf"<!-- {label} -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert match, f"README.md has no '<!-- {label} -->' command block"
    return match.group(1).strip()


@pytest.fixture
def readme_command() -> Callable[[Path, str], str]:
    """``readme_command(repo, label)``: the command in the fenced block that follows README's
    line ``<!-- label -->``."""
    return _readme_command
