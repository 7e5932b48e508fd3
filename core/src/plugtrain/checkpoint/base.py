"""The base weights a checkpoint leaves out, re-read from the initial load, checked by hash.

A plugin may freeze parameters with ``ctx.freeze(..., saved=False)`` (lora's base weights:
the conversion's ``unsaved``). A run that starts from ``checkpoint.initial_load_path`` then
leaves them out of its checkpoints, which hold the trained parameters, the optimizer and the
run's state: a LoRA checkpoint of an 8B model is megabytes, not 16 GB. Each such checkpoint
records ``base.sha256``, a SHA-256 over the initial load's files (:func:`source_digest`),
and whatever reads the checkpoint re-reads the left-out weights from that source once its
digest matches: a resume (``CheckpointManager``), ``plugtrain export-hf`` and ``generate``
(:func:`base_loader`). A changed source is refused in one line; nothing is read from it.

Without an initial load the frozen parameters are saved as usual: the run has no other copy.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plugtrain.checkpoint.dcp_io import read_checkpoint
from plugtrain.checkpoint.initial import InitialLoad, open_initial_load
from plugtrain.config import CheckpointConfig, build_section
from plugtrain.errors import CheckpointError
from plugtrain.model import conversion_of

if TYPE_CHECKING:
    from plugtrain.checkpoint.saved import SavedCheckpoint

__all__ = ["DIGEST_KEY", "base_loader", "check_digest", "left_out", "source_digest"]

DIGEST_KEY = "base.sha256"
"""The checkpoint key of the initial load's digest (32 uint8 values)."""
_CHUNK = 2**24


def left_out(model: nn.Module, config: CheckpointConfig) -> set[str]:
    """The parameters of ``model`` that checkpoints of a run with ``config`` leave out: the
    conversion's ``unsaved`` ones, when the run has an initial load to re-read them from."""
    return set(conversion_of(model).unsaved) if config.initial_load_path else set()


def source_digest(source: InitialLoad) -> torch.Tensor:
    """A SHA-256 over the files of initial-load ``source`` that hold its weights, as 32 uint8
    values: a Hugging Face folder's ``config.json`` and safetensors files; a local ``step-N``
    folder's files; a checkpoint at a URL, its ``.metadata`` and ``config.json``."""
    digest = hashlib.sha256()

    def add(name: str, chunks: Iterable[bytes]) -> None:
        digest.update(name.encode() + b"\0")
        for chunk in chunks:
            digest.update(chunk)

    if source.source is None:  # a Hugging Face folder
        assert isinstance(source.path, Path)
        files = [source.path / "config.json", *sorted(set(source.files.values()))]
    elif isinstance(source.source.location, Path):
        files = sorted(f for f in source.source.location.iterdir() if f.is_file())
    else:
        for name in (".metadata", "config.json"):
            add(name, [source.source.read_file(name)])
        files = []
    for file in files:
        with open(file, "rb") as f:
            add(file.name, iter(lambda f=f: f.read(_CHUNK), b""))
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)


def check_digest(
    checkpoint: Path | str, saved: torch.Tensor, source: InitialLoad, digest: torch.Tensor
) -> None:
    """Refuse, in one line, initial-load ``source`` if its ``digest`` is not ``saved``, the
    one checkpoint ``checkpoint`` recorded."""
    if not torch.equal(saved, digest):
        raise CheckpointError(
            f"checkpoint.initial_load_path '{source.path}' is not the base checkpoint "
            f"'{checkpoint}' was trained on (the sha256 of its files differs), and the "
            "checkpoint holds no copy of it: give the folder the run started from"
        )


def base_loader(saved: SavedCheckpoint, names: set[str]) -> Callable[[str], torch.Tensor]:
    """The reader of the full tensors of ``names``, parameters checkpoint ``saved`` left out,
    from the initial load its run started from, once its digest is checked (one process)."""
    config: dict[str, Any] = saved.config.get("checkpoint", {})
    stored = read_checkpoint(saved.folder, DIGEST_KEY, saved.source.reader())
    if not config.get("initial_load_path") or DIGEST_KEY not in stored:
        raise CheckpointError(
            f"checkpoint '{saved.folder}' lacks '{sorted(names)[0]}' and names no base to "
            "re-read it from: use a complete checkpoint of the run"
        )
    source = open_initial_load(build_section(CheckpointConfig, "checkpoint", config))
    check_digest(saved.folder, stored[DIGEST_KEY], source, source_digest(source))

    return functools.partial(source.read_full, args=saved.args)
