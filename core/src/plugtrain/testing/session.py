"""The test session's data cache (``PLUGTRAIN_CACHE``), made when the kit's runs first need it.

The pytest plugin (:mod:`plugtrain.testing.pytest_plugin`) begins and ends the session; the
kit's runs, its process launchers and the ``plugtrain_cache`` fixture ask for the cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile

CACHE_ENV = "PLUGTRAIN_CACHE"


class _Session:
    active = False
    """Whether a pytest session has the kit's plugin configured (in this process)."""
    cache: str | None = None
    """The cache folder the session made, if it made one."""


def session_cache() -> str | None:
    """The data cache of this pytest session, made on first use: ``PLUGTRAIN_CACHE`` unless it
    is set already, so that tests never write to the user's ``~/.cache`` and prepare each data
    file once, child processes included (they inherit it). Outside a pytest session that loaded
    the kit's plugin (a benchmark using the kit), nothing: the user's cache is used."""
    if not _Session.active:
        return None
    if CACHE_ENV not in os.environ:
        # Made once; set again if a test's monkeypatch removed it.
        _Session.cache = _Session.cache or tempfile.mkdtemp(prefix="plugtrain-cache-")
        os.environ[CACHE_ENV] = _Session.cache
    return os.environ[CACHE_ENV]


def begin() -> None:
    """A pytest session with the kit's plugin starts: :func:`session_cache` may make the cache."""
    _Session.active = True


def end() -> None:
    """The session ends: remove the cache :func:`session_cache` made, if it made one."""
    made = _Session.cache
    _Session.active, _Session.cache = False, None
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        if os.environ.get(CACHE_ENV) == made:
            del os.environ[CACHE_ENV]
