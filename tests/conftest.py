"""Fixtures of the core's tests; the test kit (plugtrain.testing, a pytest plugin) gives
the rest."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Before anything imports torch, which reads it once: the suite's models are tiny, and several
# intra-op threads per op cost more than they share (test_trainer.py: 80 s with torch's default
# of 2 threads at load 5 on 2 cores, 22 s with 1). The plugins' tests, later in the session,
# and every process a test starts inherit it; a value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("check_commit_msg", "new_plugin", "stack_check")
"""The contributor scripts under test: plain modules in scripts/, which import each other."""


def _load_scripts() -> None:
    """Make ``import stack_check`` (and the others) work in tests: each script is loaded from
    its file, in dependency order, into ``sys.modules``, as scripts/ is not a package."""
    for name in SCRIPTS:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


_load_scripts()


@pytest.fixture(scope="session", autouse=True)
def _data_cache(plugtrain_cache: Path) -> None:
    """Every test, a training script or CLI it runs included, prepares data into the
    session's cache, never the user's."""


@pytest.fixture
def repo() -> Path:
    """The repository's root folder."""
    return REPO


@pytest.fixture
def train_py() -> Path:
    """The repository's ``train.py``, the script a user runs."""
    return REPO / "train.py"


def _doc_block(page: Path, label: str) -> str:
    match = re.search(
        rf"<!-- {label} -->\s*```(?:bash|sh|python)?\n(.+?)\n```", page.read_text(), re.S
    )
    assert match, f"{page.name} has no '<!-- {label} -->' command block"
    return match.group(1).strip()


def _readme_command(repo: Path, label: str) -> str:
    return _doc_block(repo / "README.md", label)


@pytest.fixture
def doc_block() -> Callable[[Path, str], str]:
    """``doc_block(page, label)``: the commands in the fenced block that follows ``page``'s
    line ``<!-- label -->``."""
    return _doc_block


@pytest.fixture
def readme_command() -> Callable[[Path, str], str]:
    """``readme_command(repo, label)``: the command in the fenced block that follows README's
    line ``<!-- label -->``."""
    return _readme_command


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist, run the files with the most slow tests first, each file's tests in order.

    xdist hands whole files (``--dist loadfile``) to the workers in this order: a file of
    multi-process launches handed out last would leave one worker running it while the other
    idles, and the light files are better left to even out the end."""
    if not items or not hasattr(items[0].config, "workerinput"):
        return  # not an xdist worker: a serial run keeps the files' order
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])
