"""A saved checkpoint read back outside training: its folder, its run's config, model and weights.

``plugtrain export-hf`` and ``plugtrain generate`` take the same paths (a run's dump folder, its
latest complete checkpoint then, or one ``step-N/`` folder), rebuild the same model shape (the
run's flavor with its tokenizer's vocabulary, as the trainer builds it) and refuse the same bad
input, each in one line naming the path and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plugtrain import sample
from plugtrain.checkpoint.dcp_io import read_metadata
from plugtrain.checkpoint.layout import CONFIG, STEP_DIR, checkpoint_folder, complete_checkpoints
from plugtrain.config import ModelConfig, build_section
from plugtrain.data import Tokenizer
from plugtrain.errors import CheckpointError, UserError, one_line
from plugtrain.model import FLAVORS, ModelArgs

__all__ = ["WEIGHTS", "SavedCheckpoint", "find_checkpoint", "open_checkpoint"]

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
class SavedCheckpoint:
    """One checkpoint folder, with the model shape and tokenizer of the run that saved it."""

    folder: Path
    config: dict[str, Any]
    """The resolved config of the run that saved it (its ``config.json``)."""
    args: ModelArgs
    tokenizer_path: Path
    tokenizer: Tokenizer

    def tensors(self, weights: str) -> dict[str, TensorStorageMetadata]:
        """The stored tensors of weight set ``weights`` (see :data:`WEIGHTS`), by parameter
        name, as DCP's metadata describes them (nothing is read)."""
        prefix = WEIGHTS[weights]
        stored = {
            key.removeprefix(prefix): md
            for key, md in read_metadata(self.folder).state_dict_metadata.items()
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
    path: str | os.PathLike[str], tokenizer: str | os.PathLike[str] | None = None
) -> SavedCheckpoint:
    """The checkpoint ``path`` names (:func:`find_checkpoint`); ``tokenizer`` replaces the
    tokenizer.json its run's config names (one the run read from elsewhere)."""
    folder = find_checkpoint(path)
    try:
        config = json.loads((folder / CONFIG).read_text())
        flavor, seq_len = config["model"]["flavor"], config["training"]["seq_len"]
        named = config["model"]["tokenizer_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"has no {e}" if isinstance(e, KeyError) else f"cannot be read ({one_line(e)})"
        raise CheckpointError(
            f"checkpoint '{folder}' is damaged: its {CONFIG} {what}; use another step-N folder "
            "of the run"
        ) from e
    if flavor not in FLAVORS and flavor != "hf":
        raise CheckpointError(
            f"checkpoint '{folder}' is of model flavor '{flavor}', which this plugtrain does not "
            f"define (it has {', '.join(FLAVORS)}): use the plugtrain that trained it"
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
    return SavedCheckpoint(folder, config, args, tokenizer_path, loaded)
