"""Errors that mean "the user asked for something wrong", and the helpers that raise them.

Each carries a one-line message naming the culprit and the fix; ``train.py`` and the
``plugtrain`` command print it (no traceback) and exit with status 2 before training starts.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Iterable


class UserError(Exception):
    """Bad input: a config key, a plugin name, a data or tokenizer file, a checkpoint."""


class ConfigError(UserError):
    """An unknown config section or key, a value of the wrong type or out of range."""


class FieldError(ConfigError):
    """A config field's value is out of range; the config loader adds the section's name."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}' {message}")
        self.key, self.message = key, message


class PluginError(UserError):
    """A plugin that cannot be found, imported, registered or configured."""


class DataError(UserError, ValueError):
    """A data set or tokenizer that cannot be used: malformed, empty, too short."""


class MissingFileError(UserError, FileNotFoundError):
    """A data, tokenizer or config file that does not exist."""


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from: missing, damaged, or of another model."""


class DumpFolderError(UserError):
    """A ``job.dump_folder`` that is not a folder, cannot be written, or is in use by a run."""


def check_field(condition: bool, key: str, message: str) -> None:
    """Raise a :class:`FieldError` for field ``key`` unless ``condition`` holds.

    For config dataclasses' ``__post_init__``: ``check_field(self.max_norm > 0, "max_norm",
    f"must be > 0, got {self.max_norm}")``. The config loader knows the section (for a plugin:
    its entry point name) and reports ``config key 'grad_clip.max_norm' must be > 0, got 0``.
    """
    if not condition:
        raise FieldError(key, message)


def require_extra(module: str, extra: str, option: str) -> None:
    """Raise a one-line :class:`ConfigError` if optional package ``module`` is not installed.

    Checked when the config is built, so every rank stops before training starts.
    """
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{option} needs the '{module}' package, which is not installed: "
            f"pip install 'plugtrain[{extra}]'"
        )


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest candidate, or ``""`` when none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def one_line(e: BaseException) -> str:
    """``e`` as ``Type: message`` on one line; a DCP CheckpointException as its first cause."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
