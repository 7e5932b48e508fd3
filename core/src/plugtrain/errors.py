"""Errors that mean "the user asked for something wrong", as opposed to a bug.

Each carries a one-line message naming the culprit and the fix; ``train.py`` and the
``plugtrain`` command print it (no traceback) and exit with status 2 before training starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input: a config key, a plugin name, a data or tokenizer file."""


class ConfigError(UserError):
    """An unknown config section or key, a value of the wrong type or out of range."""


class PluginError(UserError):
    """A plugin that cannot be found, imported, registered or configured."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest candidate, or ``""`` when none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


class DataError(UserError, ValueError):
    """A data set or tokenizer that cannot be used: malformed, empty, too short."""


class MissingFileError(UserError, FileNotFoundError):
    """A data, tokenizer or config file that does not exist."""
