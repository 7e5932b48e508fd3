"""A saved checkpoint read back outside training: its folder, its run's config, model and weights.

``plugtrain export-hf``, ``eval``, ``generate`` and ``checkpoint.initial_load_path`` take the
same paths (a run's dump folder, its latest complete checkpoint then, or one ``step-N/``
folder; or the same on an object store, ``s3://bucket/prefix`` or
``s3://bucket/prefix/checkpoints/step-N``), found by :func:`locate_checkpoint` and read through
its :class:`CheckpointFolder` whatever the medium; they rebuild the same model shape (the run's
flavor with its tokenizer's vocabulary, as the trainer builds it) and refuse the same bad
input, each in one line naming the path and the fix.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plugtrain import sample
from plugtrain.checkpoint.dcp_io import SafeFileSystemReader, read_metadata
from plugtrain.checkpoint.layout import (
    CHECKPOINTS,
    CONFIG,
    STEP_DIR,
    checkpoint_folder,
    complete_checkpoints,
)
from plugtrain.checkpoint.object_store import MARKER, FsspecStorage
from plugtrain.config import ModelConfig, build_section, check_url, is_url
from plugtrain.data import Tokenizer
from plugtrain.errors import CheckpointError, UserError, one_line
from plugtrain.model import ModelSpec, model_spec

__all__ = [
    "WEIGHTS",
    "CheckpointFolder",
    "SavedCheckpoint",
    "find_checkpoint",
    "locate_checkpoint",
    "open_checkpoint",
]

WEIGHTS = {"model": "model.", "ema": "plugins.ema.average."}
"""The weight sets a checkpoint may hold, by the DCP key prefix of their tensors: the model's,
or the average of the ``ema`` plugin (its ``state_dict``, read by name: the core imports no
plugin)."""


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` names: itself (a ``step-N/`` folder), or the latest
    complete checkpoint of the run whose dump folder (or ``checkpoints/`` folder) it is."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"'{path}' does not exist: give a run's dump folder or a step-N folder"
        )
    if (path / ".metadata").is_file() or (STEP_DIR.fullmatch(path.name) and path.is_dir()):
        return path
    found = complete_checkpoints(checkpoint_folder(path)) or complete_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"no checkpoint at '{path}': give a run's dump folder (job.dump_folder, trained with "
            "--checkpoint.enable true) that holds checkpoints/step-N, or one step-N folder"
        )
    return found[max(found)]


@dataclass(frozen=True)
class CheckpointFolder:
    """One checkpoint, on the local disk or in an object store: what reading it takes."""

    location: Path | str
    """Its folder, or the URL of its prefix (for messages and records)."""
    reader: Callable[[], StorageReader]
    """A fresh safe DCP reader of it (``dcp_io.SafeMetadata``)."""
    read_file: Callable[[str], bytes]
    """The bytes of one of its files, by name (its ``config.json``)."""


def locate_checkpoint(path: str | os.PathLike[str], endpoint_url: str = "") -> CheckpointFolder:
    """The checkpoint ``path`` names, as :func:`find_checkpoint` finds it; or, for a URL, a
    complete (marked) ``.../checkpoints/step-N`` prefix, or the latest complete checkpoint of
    the run whose ``job.dump_folder`` the URL is (``endpoint_url``: an S3-compatible store's,
    else the AWS chain's). One-line :class:`CheckpointError` if there is none."""
    if not is_url(path):
        folder = find_checkpoint(path)
        return CheckpointFolder(
            folder,
            functools.partial(SafeFileSystemReader, folder),
            lambda n: (folder / n).read_bytes(),
        )
    url = os.fspath(path).rstrip("/")
    check_url(url, "checkpoint")
    head, _, leaf = url.rpartition("/")
    step_dir = STEP_DIR.fullmatch(leaf) if head.endswith(f"/{CHECKPOINTS}") else None
    storage = FsspecStorage(
        (head if step_dir else url).removesuffix(f"/{CHECKPOINTS}"), endpoint_url
    )
    storage.check()
    try:
        steps = [int(step_dir[1])] if step_dir else storage.steps()
        if step_dir and not storage.exists(steps[0]):
            raise CheckpointError(
                f"'{url}' is no complete checkpoint (it has no {MARKER} marker: being written, "
                "or left by a crash): give a complete step-N prefix or the run's dump folder URL"
            )
    except OSError as e:
        raise CheckpointError(f"cannot list '{url}': {one_line(e)}") from e
    if not steps:
        raise CheckpointError(
            f"no complete checkpoint at '{url}': give a run's dump folder URL (job.dump_folder, "
            "trained with --checkpoint.enable true) or one complete .../checkpoints/step-N prefix"
        )
    step = steps[-1]
    return CheckpointFolder(
        storage.where(step),
        functools.partial(storage.reader, step),
        functools.partial(storage.read_file, step),
    )


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint, with the model shape and tokenizer of the run that saved it."""

    source: CheckpointFolder
    config: dict[str, Any]
    """The resolved config of the run that saved it (its ``config.json``)."""
    spec: ModelSpec
    """The family of its model (its config's ``model.family``; ``llama`` before there was one)."""
    args: Any
    """The shape of its model, an instance of ``spec.args``."""
    tokenizer_path: Path
    tokenizer: Tokenizer

    @property
    def folder(self) -> Path | str:
        """Its folder, or the URL of its prefix."""
        return self.source.location

    def tensors(self, weights: str) -> dict[str, TensorStorageMetadata]:
        """The stored tensors of weight set ``weights`` (see :data:`WEIGHTS`), by parameter
        name, as DCP's metadata describes them (nothing is read)."""
        prefix = WEIGHTS[weights]
        metadata = read_metadata(self.folder, self.source.reader()).state_dict_metadata
        stored = {
            key.removeprefix(prefix): md
            for key, md in metadata.items()
            if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }
        if not stored:
            raise CheckpointError(
                f"checkpoint '{self.folder}' holds no '{weights}' weights (no key '{prefix}*'): "
                + (
                    "train with the ema plugin enabled, or use --weights model"
                    if weights == "ema"
                    else "use a checkpoint written by plugtrain"
                )
            )
        return stored


def open_checkpoint(
    path: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | None = None,
    endpoint_url: str = "",
) -> SavedCheckpoint:
    """The checkpoint ``path`` names (:func:`locate_checkpoint`); ``tokenizer`` replaces the
    tokenizer.json its run's config names (one the run read from elsewhere)."""
    source = locate_checkpoint(path, endpoint_url)
    folder = source.location
    try:
        config = json.loads(source.read_file(CONFIG))
        flavor, seq_len = config["model"]["flavor"], config["training"]["seq_len"]
        named = config["model"]["tokenizer_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"has no {e}" if isinstance(e, KeyError) else f"cannot be read ({one_line(e)})"
        raise CheckpointError(
            f"checkpoint '{folder}' is damaged: its {CONFIG} {what}; use another step-N folder "
            "of the run"
        ) from e
    try:
        spec = model_spec(config["model"].get("family", "llama"))
    except UserError as e:
        raise CheckpointError(
            f"checkpoint '{folder}' names a model this plugtrain cannot build ({one_line(e)}): "
            "use the plugtrain that trained it"
        ) from e
    if flavor not in spec.flavors and flavor != "hf":
        raise CheckpointError(
            f"checkpoint '{folder}' is of model flavor '{flavor}', which this plugtrain does not "
            f"define (it has {', '.join(spec.flavors)}): use the plugtrain that trained it"
        )
    tokenizer_path = sample.resolve(tokenizer or named)
    if not tokenizer_path.is_file():
        raise CheckpointError(
            f"tokenizer '{tokenizer or named}' of checkpoint '{folder}' (its config's "
            "model.tokenizer_path) is not found: pass --tokenizer with the run's tokenizer.json"
        )
    loaded = Tokenizer.from_file(tokenizer_path)
    try:
        model = build_section(ModelConfig, "model", config["model"])
    except UserError as e:
        raise CheckpointError(
            f"checkpoint '{folder}' names a model this plugtrain cannot build ({one_line(e)}): "
            "use the plugtrain that trained it"
        ) from e
    args = model.model_args(loaded.vocab_size, seq_len)
    return SavedCheckpoint(source, config, spec, args, tokenizer_path, loaded)
