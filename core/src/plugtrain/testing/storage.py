"""Checkpoint stores in tests: a small checkpoint written to a ``CheckpointStorage`` as saves do.

:func:`save_small_checkpoint` stages, writes (DCP, this one process) and commits a checkpoint of
a few tensors, the same on the local disk (``LocalStorage``) and an object store
(``FsspecStorage``): the storage tests of each medium share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint import CheckpointStorage
from plugtrain.data import ChatTemplate

__all__ = ["SMALL_RUN_CONFIG", "SMALL_TEMPLATE", "save_small_checkpoint"]

SMALL_RUN_CONFIG = {"training": {"steps": 8}, "optimizer": {"lr": 0.003}}
"""The run config :func:`save_small_checkpoint` stages by default."""
SMALL_TEMPLATE = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", "tests")
"""A chat template whose record (``checkpoint.records``) the storage tests save and read back."""


def save_small_checkpoint(
    storage: CheckpointStorage,
    step: int,
    commit: bool = True,
    run_config: Mapping[str, Any] = SMALL_RUN_CONFIG,
    files: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """Stage (with ``files``, the run's other records) and write a checkpoint of ``step``
    (``w``: three ``step``s, ``train.step``), and commit it unless ``commit`` is False (what a
    kill before the commit leaves); returns the state written."""
    state = {"w": torch.full((3,), float(step)), "train": {"step": torch.tensor(step)}}
    storage.stage(step, run_config, files)
    dcp.save(state, storage_writer=storage.writer(step), no_dist=True)
    if commit:
        storage.commit(step)
    return state
