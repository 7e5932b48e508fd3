"""Fixtures of the repository's meta-tests: git, in this repository or in a scratch one."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


class ScratchRepo:
    """An empty git repository on branch main, with a committer identity."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.name", "Test Contributor")
        self.git("config", "user.email", "contributor@example.com")

    def git(self, *args: str) -> str:
        return _git(self.path, *args)

    def commit(self, message: str, files: dict[str, str]) -> str:
        """Write ``files`` (path -> text), commit everything; return the commit's sha."""
        for name, text in files.items():
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            (self.path / name).write_text(text)
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")


@pytest.fixture
def git() -> Callable[..., str]:
    """``git(cwd, *args)``: git's stripped output; a failure raises."""
    return _git


@pytest.fixture
def scratch_repo(tmp_path) -> ScratchRepo:
    return ScratchRepo(tmp_path / "repo")
