"""Fixtures of the repository's meta-tests: git, in this repository or in a scratch one."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterable
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


def _copy_of_this_repository(target: Path, plugins: Iterable[str] | None = None) -> None:
    """This repository's tracked and unignored files, as they are in the working tree; with
    ``plugins``, only the shipped plugins it names (and their requirements-dev.txt lines): an
    environment of the copy installs each plugin it holds, for seconds each."""
    repo = Path(__file__).resolve().parents[2]
    folders = plugins if plugins is not None else [p.name for p in (repo / "plugins").iterdir()]
    kept = {f"plugins/{name}/" for name in folders}
    files = _git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, files.split("\0")):
        if name.startswith("plugins/") and not any(name.startswith(k) for k in kept):
            continue
        if (repo / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / name, target / name)
    requirements = target / "requirements-dev.txt"
    lines = requirements.read_text().splitlines(keepends=True)
    requirements.write_text(
        "".join(
            line
            for line in lines
            if not line.startswith("-e ./plugins/") or line.strip()[5:] + "/" in kept
        )
    )


@pytest.fixture
def repository_copy() -> Callable[..., None]:
    """``repository_copy(target, plugins=None)``: this repository's files in ``target``; with
    ``plugins``, only the shipped plugins it names."""
    return _copy_of_this_repository


@pytest.fixture
def git() -> Callable[..., str]:
    """``git(cwd, *args)``: git's stripped output; a failure raises."""
    return _git


@pytest.fixture
def scratch_repo(tmp_path) -> ScratchRepo:
    return ScratchRepo(tmp_path / "repo")
