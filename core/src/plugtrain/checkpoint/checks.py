"""The checkpoint manager's refusals and failures, each a one-line error naming the fix.

Which checkpoint a start resumes from (or none) and what it refuses to overwrite; a checkpoint
this run cannot continue from (another model, another plugin version, a changed setting); a
save that failed or would replace a complete checkpoint. Plain data in, a
:class:`CheckpointError` out: the manager decides when to ask.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plugtrain.config import FIXED_ON_RESUME, CheckpointConfig, fixed_on_resume
from plugtrain.errors import CheckpointError, one_line

__all__ = [
    "check_optimizer",
    "check_settings",
    "check_state",
    "choose",
    "exists_error",
    "latest_at_most",
    "save_failed",
]

_NEARLY_FULL = 2**20
"""Free bytes below which a disk counts as full, for a write error that gives no cause."""


# --------------------------------------------------------------------------- which one


def choose(
    config: CheckpointConfig, available: Sequence[int], location: Path | str
) -> tuple[int | None, list[int]]:
    """The step to resume from (None: start afresh) of the complete checkpoints ``available``
    (oldest first) at ``location``, and the later ones, which ``checkpoint.discard_later``
    deletes and a start without it refuses to overwrite. Without ``checkpoint.enable`` (a run
    that saves its last step alone, ``checkpoint.save_final``) every one is later: the run
    neither resumes them nor could tell them from its own."""
    load_step = config.load_step
    if not config.enable:
        if available and not config.discard_later:
            raise CheckpointError(
                f"checkpoint.enable is off (start afresh, save the last step), but {location} "
                f"holds checkpoints of an earlier run (steps {', '.join(map(str, available))}): "
                f"add --checkpoint.enable true to resume from step {available[-1]}, train in "
                "another job.dump_folder, or add --checkpoint.discard_later true to delete them"
            )
        return None, list(available)
    if load_step == 0:
        chosen = None
    elif load_step > 0:
        if load_step not in available:
            steps = ", ".join(map(str, available)) or "none"
            raise CheckpointError(
                f"checkpoint.load_step is {load_step}, but {location} has no complete checkpoint "
                f"step-{load_step} (complete ones: {steps}): pick one of them, or -1 for the "
                "latest"
            )
        chosen = load_step
    else:
        chosen = max(available, default=None)
    later = [s for s in available if chosen is None or s > chosen]
    if not later or config.discard_later:
        return chosen, later
    steps = ", ".join(map(str, later))
    if chosen is None:
        raise CheckpointError(
            f"checkpoint.load_step is 0 (start afresh), but {location} holds checkpoints of an "
            f"earlier run (steps {steps}): train in another job.dump_folder, or add "
            "--checkpoint.discard_later true to delete them"
        )
    raise CheckpointError(
        f"checkpoint.load_step is {chosen}, but {location} holds later checkpoints (steps "
        f"{steps}) that this run would overwrite: resume from the latest with "
        "--checkpoint.load_step -1, or add --checkpoint.discard_later true to delete them"
    )


def latest_at_most(available: Sequence[int], at_most: int, location: Path | str) -> int:
    """The latest of the complete checkpoints ``available`` (oldest first) at step ``at_most``
    or earlier, to rewind to."""
    earlier = [s for s in available if s <= at_most]
    if not earlier:
        steps = ", ".join(map(str, available)) or "none"
        raise CheckpointError(
            f"cannot rewind to step {at_most} or earlier: {location} has no complete "
            f"checkpoint there (complete ones: {steps}); save more often "
            "(checkpoint.interval) or keep more (checkpoint.keep_latest_k)"
        )
    return earlier[-1]


# --------------------------------------------------------------------------- loading


def check_state(
    path: Path | str,
    saved: Mapping[str, Any],
    wanted: Mapping[str, torch.Tensor],
    plugin_states: Mapping[str, Any],
) -> None:
    """Refuse checkpoint ``path``, whose DCP metadata ``saved`` describes, if it cannot fill
    ``wanted`` (this run's state by flattened key; ``plugin_states`` the plugins it loads)."""

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path} was saved from another model: {why}; resume with the "
            "model.flavor and tokenizer it was trained with, or train in another "
            "job.dump_folder"
        )

    model_saved = {k for k in saved if k.startswith("model.")}
    model_wanted = {k for k in wanted if k.startswith("model.")}
    for key in sorted(model_saved & model_wanted):
        if list(saved[key].size) != list(wanted[key].shape):
            raise refuse(
                f"parameter '{key.removeprefix('model.')}' has shape "
                f"{list(saved[key].size)} there and {list(wanted[key].shape)} here"
            )
    if missing := sorted(model_wanted - model_saved):
        raise refuse(f"it has no parameter '{missing[0].removeprefix('model.')}'")
    if extra := sorted(model_saved - model_wanted):
        raise refuse(f"its parameter '{extra[0].removeprefix('model.')}' is not in this model")
    for name in plugin_states:
        prefix = f"plugins.{name}."
        there = {k for k in saved if k.startswith(prefix)}
        here = {k for k in wanted if k.startswith(prefix)}
        if there != here:
            raise CheckpointError(
                f"checkpoint {path} holds state of plugin '{name}' with keys "
                f"{sorted(k.removeprefix(prefix) for k in there)}, but the plugin's state now "
                f"has {sorted(k.removeprefix(prefix) for k in here)}: use the plugin version "
                "that saved it, or disable the plugin"
            )
    for key in wanted:
        if key not in saved:
            if key.startswith("optimizer."):
                continue  # another optimizer's state: check_optimizer says so, after the settings
            raise CheckpointError(
                f"checkpoint {path} lacks '{key}': it was not written by this version of "
                "plugtrain; pick another with --checkpoint.load_step"
            )
        if not isinstance(saved[key], TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {path} stores '{key}' as a pickled object, which plugtrain never "
                "loads: use a checkpoint written by plugtrain"
            )


def check_optimizer(
    path: Path | str,
    saved: Mapping[str, Any],
    wanted: Mapping[str, torch.Tensor],
    saved_config: Mapping[str, Any],
) -> None:
    """Refuse checkpoint ``path`` if its optimizer state (``saved``, DCP metadata) is not the
    one this run's optimizer has (``wanted``): it was built by another optimizer (a plugin's,
    through ``build_optimizer``) or with other param groups. ``saved_config`` is its run's."""
    there = {k for k in saved if k.startswith("optimizer.")}
    here = {k for k in wanted if k.startswith("optimizer.")}
    if there == here:
        return
    key = min(here - there) if here - there else min(there - here)
    enabled = saved_config.get("plugins", {}).get("enabled", [])
    raise CheckpointError(
        f"checkpoint {path} holds the state of another optimizer than this run's ('{key}' is "
        f"in {'this run only' if key in here else 'the checkpoint only'}): resume with the "
        f"plugins and [optimizer] it was saved with (plugins.enabled = {enabled}), or train "
        "in another job.dump_folder"
    )


def check_settings(
    path: Path | str,
    saved_config: Mapping[str, Any],
    run_config: Mapping[str, Any],
    fixed: Mapping[str, tuple[str, ...] | None] = FIXED_ON_RESUME,
) -> None:
    """Refuse a resume from checkpoint ``path`` (saved by a run of ``saved_config``) by a run
    of ``run_config`` that changes a setting the run must keep: the core's
    (``config.FIXED_ON_RESUME``), or those of ``fixed`` (a plugin's, by section)."""
    theirs = fixed_on_resume(saved_config, fixed)
    for key, value in fixed_on_resume(run_config, fixed).items():
        if key in theirs and theirs[key] != value:
            raise CheckpointError(
                f"{key} is {value!r} in this run but {theirs[key]!r} in checkpoint {path}, "
                f"and a resumed run keeps the settings it started with: drop --{key} (or set "
                "it back), or start a new run in another job.dump_folder"
            )


# --------------------------------------------------------------------------- saving


def exists_error(path: Path | str) -> CheckpointError:
    """A save of checkpoint ``path`` that would replace a complete one."""
    # Start-up refuses later checkpoints, so this one was written by another run since.
    return CheckpointError(
        f"cannot save {path}: a complete checkpoint of that step already exists, written by "
        "another run using the same job.dump_folder; give each run its own job.dump_folder"
    )


def save_failed(
    path: Path | str,
    location: Path | str,
    error: BaseException | None,
    free: int | None,
    fix: str = "free space or set job.dump_folder elsewhere",
) -> CheckpointError:
    """A save of checkpoint ``path`` that failed with ``error`` (None: rank 0 could not begin
    it), with ``free`` bytes left at ``location``; ``fix``: what to do (the medium's)."""
    space = "" if free is None else f" ({free / 2**20:.1f} MiB free in {location})"
    return CheckpointError(
        f"cannot save checkpoint {path}: {_write_failure_cause(error, free)}{space}; the "
        f"previous checkpoints are intact: {fix}"
    )


def _write_failure_cause(error: BaseException | None, free: int | None) -> str:
    """Why writing a checkpoint failed, in a few words (``No space left on device``).

    An OSError says it with its strerror. torch's zip writer reports a full disk as a
    RuntimeError ("unexpected pos", "file write failed") without an errno: a disk (nearly)
    full once it failed is taken for the cause then.
    """
    failures = getattr(error, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else error  # DCP: rank -> (error, tb)
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    if free is not None and free < _NEARLY_FULL:
        return os.strerror(errno.ENOSPC)
    return one_line(error) if error is not None else "rank 0 could not create its folder"
