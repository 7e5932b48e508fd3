"""The Shakespeare sample shipped inside plugtrain, and the ``sample:NAME`` paths that name it.

The sample (``train.jsonl``, ``validation.jsonl``, their BPE ``tokenizer.json`` and
PROVENANCE.md) lies in this package's folder, wherever plugtrain is installed. The config's
defaults name its files as ``sample:train.jsonl``: the run's records then say the same in every
installation, and :func:`resolve` turns such a name into the file; any other path is the user's,
relative to the current folder.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
"""The folder of the shipped sample."""
PREFIX = "sample:"
"""What starts a path that names a file of the shipped sample."""


def resolve(path: str | os.PathLike[str]) -> Path:
    """``sample:NAME`` as the sample's file ``NAME``; any other path unchanged."""
    text = os.fspath(path)
    if text.startswith(PREFIX):
        return FOLDER / text.removeprefix(PREFIX)
    return Path(text)
