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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plugtrain import sample
from plugtrain.checkpoint.dcp_io import read_metadata
from plugtrain.checkpoint.layout import CHECKPOINTS, CONFIG, STEP_DIR
from plugtrain.checkpoint.object_store import MARKER, open_checkpoints
from plugtrain.checkpoint.records import read_chat_template
from plugtrain.checkpoint.storage import CheckpointStorage
from plugtrain.config import ModelConfig, build_section
from plugtrain.data import ChatTemplate, Tokenizer
from plugtrain.errors import CheckpointError, UserError, one_line
from plugtrain.model import ModelSpec, model_spec

__all__ = [
    "WEIGHTS",
    "CheckpointFolder",
    "SavedCheckpoint",
    "locate_checkpoint",
    "open_checkpoint",
]

WEIGHTS = {"model": "model.", "ema": "plugins.ema.average."}
"""The weight sets a checkpoint may hold, by the DCP key prefix of their tensors: the model's,
or the average of the ``ema`` plugin (its ``state_dict``, read by name: the core imports no
plugin)."""


@dataclass(frozen=True)
class CheckpointFolder:
    """One complete checkpoint, on the local disk or in an object store: its store and step,
    through which it is read whatever the medium."""

    storage: CheckpointStorage
    step: int

    @property
    def location(self) -> Path | str:
        """Its folder, or the URL of its prefix (for messages and records)."""
        return self.storage.where(self.step)

    def reader(self) -> StorageReader:
        """A fresh safe DCP reader of it (``dcp_io.SafeMetadata``)."""
        return self.storage.reader(self.step)

    def read_file(self, name: str) -> bytes:
        """The bytes of one of its files, by name (its ``config.json``)."""
        return self.storage.read_file(self.step, name)


def _named_store(
    path: str | os.PathLike[str], endpoint_url: str
) -> tuple[CheckpointStorage, int | None]:
    """The checkpoint store ``path`` names, and the step it names (None: its latest): a
    ``step-N`` folder names its parent and N; a ``checkpoints`` folder itself; else a run's
    dump folder, its ``checkpoints`` folder."""
    text = os.fspath(path).rstrip("/")
    head, _, leaf = text.rpartition("/")
    if step_dir := STEP_DIR.fullmatch(leaf):
        return open_checkpoints(head or ".", endpoint_url), int(step_dir[1])
    folder = text if leaf == CHECKPOINTS else f"{text}/{CHECKPOINTS}"
    return open_checkpoints(folder, endpoint_url), None


def locate_checkpoint(path: str | os.PathLike[str], endpoint_url: str = "") -> CheckpointFolder:
    """The complete checkpoint ``path`` names, on the local disk or at a URL (``endpoint_url``:
    an S3-compatible store's, else the AWS chain's): one ``step-N`` folder (an object store's
    ``.../checkpoints/step-N`` prefix), or the latest of the run whose ``job.dump_folder`` (or
    its ``checkpoints`` folder) ``path`` is. One-line :class:`CheckpointError` if there is none."""
    storage, step = _named_store(path, endpoint_url)
    try:
        if step is not None and not storage.exists(step):
            raise CheckpointError(
                f"'{path}' is no complete checkpoint (missing; or being written, or left by a "
                f"crash: on an object store it has no {MARKER} marker): give a complete step-N "
                "folder or the run's dump folder"
            )
        steps = [step] if step is not None else storage.steps()
    except OSError as e:
        raise CheckpointError(f"cannot list '{path}': {one_line(e)}") from e
    if not steps:
        raise CheckpointError(
            f"no checkpoint at '{path}': give a run's dump folder (job.dump_folder, trained with "
            "checkpoint.save_final or checkpoint.enable on) that holds checkpoints/step-N, or "
            "one step-N folder"
        )
    return CheckpointFolder(storage, steps[-1])


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
    chat_template: ChatTemplate | None = None
    """The chat template its run's chat data was rendered with (``checkpoint.records``); None
    for a text run, or one saved before the template was recorded."""

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
    chat_template = read_chat_template(source.storage, source.step)
    return SavedCheckpoint(source, config, spec, args, tokenizer_path, loaded, chat_template)
