"""Generate text from a saved model: load it for inference, then ``plugtrain generate``.

Each kind of input has a loader that returns ``(ModelArgs, state_dict, Tokenizer)``, the state
dict keyed by the model's own parameter names (``layers.0.attention.wq.weight``):

* :func:`from_checkpoint`: a run's dump folder (its latest complete checkpoint) or a
  ``step-N/`` folder. Only the model's tensors are read from DCP (or, with ``weights="ema"``,
  the ema plugin's average of them, by key, without importing the plugin); the shape is the
  run config's flavor with the tokenizer's vocabulary, as the trainer builds it.

:func:`load` picks the loader for a path and builds the model on a device. The decoding itself
is :func:`plugtrain.model.decoding.complete`, shared with plugins.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from plugtrain import sample
from plugtrain.checkpoint import (
    CONFIG,
    checkpoint_folder,
    complete_checkpoints,
    read_checkpoint,
    read_metadata,
)
from plugtrain.data import Tokenizer
from plugtrain.errors import CheckpointError, ConfigError, UserError, one_line
from plugtrain.model import FLAVORS, ModelArgs, Transformer, complete, run_model_args

__all__ = ["WEIGHTS", "Loaded", "find_checkpoint", "from_checkpoint", "load", "run"]

Loaded = tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]
"""What a loader returns: the model's shape, its tensors by parameter name, its tokenizer."""

WEIGHTS = {"model": "model.", "ema": "plugins.ema.average."}
"""The weight sets a checkpoint may hold, and the prefix of their DCP keys."""


def find_checkpoint(path: Path) -> Path:
    """The checkpoint folder ``path`` names: itself if it is one (it holds DCP's ``.metadata``),
    else the latest complete checkpoint of the run whose dump folder it is."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a run's dump folder or a step-N folder")
    if (path / ".metadata").is_file():
        return path
    available = complete_checkpoints(checkpoint_folder(path))
    if not available:
        raise CheckpointError(
            f"{path} holds no checkpoint: give a run's dump folder (trained with "
            "--checkpoint.enable true) or one of its checkpoints/step-N folders"
        )
    return available[max(available)]


def _run_config(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: cannot read its {CONFIG} ({one_line(e)}); "
            "use another step-N folder"
        ) from e


def _model_args(
    checkpoint: Path, config: dict[str, Any], tokenizer_path: str | None
) -> tuple[ModelArgs, Tokenizer]:
    """The trained shape and tokenizer, from the run config (``tokenizer_path`` overrides it)."""
    try:
        flavor = config["model"]["flavor"]
        seq_len = config["training"]["seq_len"]
        tokenizer_path = tokenizer_path or config["model"]["tokenizer_path"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {checkpoint}'s {CONFIG} lacks {e}: it was not written by this version "
            "of plugtrain"
        ) from e
    if flavor not in FLAVORS:
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained with model.flavor '{flavor}', which this "
            f"version of plugtrain does not have ({', '.join(FLAVORS)})"
        )
    if not sample.resolve(tokenizer_path).is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained with tokenizer '{tokenizer_path}', which does "
            "not exist here: pass --tokenizer FILE"
        )
    tokenizer = Tokenizer.from_file(sample.resolve(tokenizer_path))
    return run_model_args(flavor, tokenizer.vocab_size, seq_len), tokenizer


def from_checkpoint(
    path: Path, weights: str = "model", tokenizer_path: str | None = None
) -> Loaded:
    """Load a plugtrain checkpoint (dump folder or ``step-N/``) for inference, on the CPU.

    ``weights`` is ``model`` (the trained parameters) or ``ema`` (the ema plugin's average);
    ``tokenizer_path`` replaces the run config's ``model.tokenizer_path``.
    """
    checkpoint = find_checkpoint(path)
    args, tokenizer = _model_args(checkpoint, _run_config(checkpoint), tokenizer_path)
    prefix = WEIGHTS[weights]
    if not any(key.startswith(prefix) for key in read_metadata(checkpoint).state_dict_metadata):
        raise CheckpointError(
            f"checkpoint {checkpoint} holds no '{weights}' weights (no key '{prefix}*'): "
            + ("train with the ema plugin enabled, or " if weights == "ema" else "")
            + "use a checkpoint written by plugtrain"
        )
    try:
        tensors = read_checkpoint(checkpoint, prefix)
    except UserError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # the latter is no Exception
        raise CheckpointError(
            f"checkpoint {checkpoint} is damaged: {one_line(e)}; use another step-N folder"
        ) from e
    return args, {key.removeprefix(prefix): t for key, t in tensors.items()}, tokenizer


def _build(args: ModelArgs, state_dict: dict[str, torch.Tensor], source: Path) -> Transformer:
    """The model of shape ``args`` holding ``state_dict``, in float32 on the CPU, for inference."""
    model = Transformer(args)
    wanted = model.state_dict()
    for key in sorted(wanted.keys() | state_dict.keys()):
        if key not in state_dict or key not in wanted:
            where = "is missing there" if key not in state_dict else "is not in the model"
            raise CheckpointError(
                f"{source} does not fit the model it names: parameter '{key}' {where}"
            )
        if state_dict[key].shape != wanted[key].shape:
            raise CheckpointError(
                f"{source} does not fit the model it names: parameter '{key}' has shape "
                f"{list(state_dict[key].shape)} there and {list(wanted[key].shape)} in the model"
            )
    model.load_state_dict({k: v.float() for k, v in state_dict.items()})
    return model.eval().requires_grad_(False)


def load(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    weights: str = "model",
    tokenizer_path: str | None = None,
) -> tuple[Transformer, Tokenizer]:
    """The model saved at ``path`` (any input kind a loader reads), on ``device``, and its
    tokenizer."""
    path = Path(path)
    args, state_dict, tokenizer = from_checkpoint(path, weights, tokenizer_path)
    return _build(args, state_dict, path).to(device), tokenizer


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asks for a GPU, but none is available: use cpu")
    return device


def run(args: argparse.Namespace) -> int:
    """``plugtrain generate``: print what the model at ``args.path`` writes after the prompt."""
    for value, ok, option, bound in (
        (args.max_new_tokens, args.max_new_tokens >= 1, "--max-new-tokens", ">= 1"),
        (args.temperature, args.temperature >= 0, "--temperature", ">= 0 (0: greedy)"),
        (args.top_k, args.top_k >= 0, "--top-k", ">= 0 (0: no cut)"),
        (args.top_p, 0 < args.top_p <= 1, "--top-p", "in (0, 1]"),
    ):
        if not ok:
            raise ConfigError(f"{option} must be {bound}, got {value}")
    model, tokenizer = load(args.path, _device(args.device), args.weights, args.tokenizer)
    text = complete(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(text)
    return 0
