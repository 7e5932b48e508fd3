"""The kit's pytest plugin: fixtures for tiny runs, the data cache, an S3 server, one thread.

``plugtrain_run``, ``plugtrain_cache``, ``s3_server`` and ``one_thread``.

Installing plugtrain registers this module with pytest (the ``pytest11`` entry point
``plugtrain``), in every pytest session of the environment, so loading it costs nothing: it
imports no torch and changes no environment variable. It starts and ends the test session's
data cache (:mod:`plugtrain.testing.session`), which is made only when a test first needs it
(a kit run, or a fixture), and removed when the session ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from plugtrain.testing import session
from plugtrain.testing.session import session_cache

if TYPE_CHECKING:
    from plugtrain.testing.runs import RunResult
    from plugtrain.testing.s3 import S3Server


def pytest_configure(config: pytest.Config) -> None:
    """Start the session: the kit's runs may make its data cache (not now)."""
    session.begin()


def pytest_unconfigure(config: pytest.Config) -> None:
    """End the session: remove its data cache, if one was made."""
    session.end()


@pytest.fixture(scope="session")
def plugtrain_cache() -> Path:
    """The session's data cache (``PLUGTRAIN_CACHE``), made now: for tests that run a training
    script or the CLI themselves; the kit's runs make it anyway."""
    cache = session_cache()
    assert cache is not None
    return Path(cache)


@pytest.fixture
def plugtrain_run(tmp_path: Path, plugtrain_cache: Path) -> Callable[..., RunResult]:
    """:func:`~plugtrain.testing.tiny_run` in a fresh folder of ``tmp_path``:
    ``plugtrain_run(*args, plugins=..., steps=..., world_size=...)``; each call trains in a
    folder of its own."""
    from plugtrain.testing.runs import tiny_run

    calls = itertools.count()

    def run(*args: str, **kwargs: Any) -> RunResult:
        return tiny_run(tmp_path / f"run{next(calls)}", *args, **kwargs)

    return run


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server on 127.0.0.1 (:class:`~plugtrain.testing.S3Server`) for the test
    module, its credentials and endpoint set in ``os.environ`` while it runs."""
    from plugtrain.testing.s3 import S3Server

    with S3Server() as server, server.environ():
        yield server


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test, restored after: in-process trainers on a busy 2-core
    machine run far faster so (use it module-wide with ``pytest.mark.usefixtures``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
