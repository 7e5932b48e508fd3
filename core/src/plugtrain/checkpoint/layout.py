"""Where a run's checkpoints live: the folder names that the manager writes and readers find.

Kept apart from the manager so that readers of finished checkpoints (the export) need neither
the manager nor the plugin host it drives.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_RECORD",
    "CHECKPOINTS",
    "CONFIG",
    "STEP_DIR",
    "checkpoint_folder",
    "complete_checkpoints",
]

CHECKPOINTS = "checkpoints"
"""The folder of ``job.dump_folder`` that holds a run's checkpoints."""
CONFIG = "config.json"
"""The file of a checkpoint folder that holds the resolved config of the run that saved it."""
CHAT_TEMPLATE = "chat_template.jinja"
"""The file of a checkpoint folder that holds the chat template the run's chat data was
rendered with (absent for text, and in checkpoints of runs before it was recorded)."""
CHAT_TEMPLATE_RECORD = "chat_template.json"
"""Beside :data:`CHAT_TEMPLATE`: its sha256, where the run read it and its special tokens."""
STEP_DIR = re.compile(r"step-(\d+)")
"""The name of a complete checkpoint folder, ``step-<N>``."""


def checkpoint_folder(dump_folder: str | os.PathLike[str]) -> Path:
    """Where the run writing to ``dump_folder`` keeps its checkpoints."""
    return Path(dump_folder) / CHECKPOINTS


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """The complete checkpoints in ``folder`` by step, oldest first (none if it is missing)."""
    if not folder.is_dir():
        return {}
    found = {
        int(match[1]): path
        for path in folder.iterdir()
        if (match := STEP_DIR.fullmatch(path.name)) and path.is_dir()
    }
    return dict(sorted(found.items()))
