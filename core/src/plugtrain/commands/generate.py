"""``plugtrain generate``: load a saved model for inference, then print what it writes.

Each kind of input has a loader that returns ``(ModelSpec, args, state_dict, Tokenizer)``: the
model's family, its shape, and the state dict keyed by the model's own parameter names
(``layers.0.attention.wq.weight``):

* :func:`from_checkpoint`: a run's dump folder (its latest complete checkpoint) or a
  ``step-N/`` folder, local or at an ``s3://`` URL. Only the model's tensors are read from DCP
  (or, with ``weights="ema"``, the ema plugin's average of them, by key, without importing the
  plugin); the family and shape are the run config's, with the tokenizer's vocabulary, as the
  trainer builds them. Parameters a plugin added (LoRA's adapters) are merged into the base
  weights by the plugin's export rules, as ``export-hf`` merges them. A moe run's experts'
  selection bias (its ``moe`` state) is set on the model built, so it routes as it trained.
* :func:`from_hf_folder`: a Hugging Face folder (``plugtrain export-hf``'s, or any whose
  ``config.json`` a family can express, found by its ``model_type``): its safetensors files
  through the family's adapter (Llama's puts the q/k rows back into plugtrain's RoPE layout),
  and its ``tokenizer.json``.

:func:`load` picks the loader for a path and builds the model on a device. The decoding itself
is :func:`plugtrain.model.decoding.complete`, shared with plugins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from plugtrain import sample
from plugtrain.checkpoint import (
    WEIGHTS,
    SavedCheckpoint,
    base_loader,
    locate_checkpoint,
    open_checkpoint,
    read_checkpoint,
)
from plugtrain.data import ChatTemplate, Tokenizer
from plugtrain.errors import CheckpointError, ConfigError, MissingFileError, UserError, one_line
from plugtrain.model import ModelSpec, complete, hf_model_spec
from plugtrain.model.moe.balance import Balance
from plugtrain.model.moe.transformer import moe_layers

__all__ = [
    "Loaded",
    "add_model_arguments",
    "add_parser",
    "chat_template_of",
    "from_checkpoint",
    "from_hf_folder",
    "is_hf_folder",
    "load",
    "run",
]

HF_WEIGHTS = "model.safetensors"
"""A Hugging Face folder's weights file (``model.safetensors.index.json`` lists its shards)."""

Loaded = tuple[ModelSpec, Any, dict[str, torch.Tensor], Tokenizer]
"""What a loader returns: the model's family, its shape, its tensors by parameter name, its
tokenizer."""


def from_checkpoint(
    path: str | os.PathLike[str], weights: str = "model", tokenizer_path: str | None = None
) -> Loaded:
    """Load a plugtrain checkpoint (dump folder or ``step-N/``) for inference, on the CPU.

    ``weights`` is ``model`` (the trained parameters) or ``ema`` (the ema plugin's average);
    ``tokenizer_path`` replaces the run config's ``model.tokenizer_path``.
    """
    saved = open_checkpoint(path, tokenizer_path)
    saved.tensors(weights)  # refuses a checkpoint without that weight set
    prefix = WEIGHTS[weights]
    try:
        tensors = read_checkpoint(saved.folder, prefix, saved.source.reader())
    except UserError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # the latter is no Exception
        raise CheckpointError(
            f"checkpoint '{saved.folder}' is damaged: {one_line(e)}; use another step-N folder"
        ) from e
    state_dict = {key.removeprefix(prefix): t for key, t in tensors.items()}
    return saved.spec, saved.args, _merged(saved, weights, state_dict), saved.tokenizer


def _merged(
    saved: SavedCheckpoint, weights: str, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's own parameters of ``state_dict``, with what its run's plugins added (LoRA's
    adapters) merged in by their export rules, as ``export-hf`` merges them; frozen ones a
    weight set lacks (ema's) come from the model's."""
    from plugtrain.training import saved_conversion  # loads the run's plugins: only if needed

    conversion = saved_conversion(saved, weights)
    if conversion is None:
        return state_dict
    if weights != "model":
        model = read_checkpoint(saved.folder, WEIGHTS["model"], saved.source.reader())
        for name in conversion.frozen:
            if WEIGHTS["model"] + name in model:
                state_dict.setdefault(name, model[WEIGHTS["model"] + name])
    names = saved.spec.hf.parameter_shapes(saved.args)
    if missing := {name for name in names if name not in state_dict} & conversion.unsaved:
        # The frozen base weights the checkpoint left out: from the initial load, hash checked.
        read = base_loader(saved, missing)
        state_dict.update({name: read(name) for name in missing})
    load = conversion.exported(state_dict.__getitem__)
    return {name: load(name) for name in names}


def is_hf_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a Hugging Face model folder (safetensors weights and a config): a
    local one, as no URL's ``config.json`` is a local file."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        (path / name).is_file() for name in (HF_WEIGHTS, f"{HF_WEIGHTS}.index.json")
    )


def from_hf_folder(path: Path, tokenizer_path: str | None = None) -> Loaded:
    """Load a Hugging Face folder of a family plugtrain has (by its config.json's
    ``model_type``) for inference, on the CPU (``tokenizer_path`` replaces its
    ``tokenizer.json``)."""
    from safetensors import safe_open  # a dependency of this input kind alone

    try:
        config = json.loads((path / "config.json").read_text())
        spec = hf_model_spec(config)
        args = spec.hf.args_from_hf(config)
        index = path / f"{HF_WEIGHTS}.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else [HF_WEIGHTS]
        )
        state_dict = {}
        for file in files:
            with safe_open(path / file, "pt") as f:
                for key in f.keys():  # noqa: SIM118 (not a dict)
                    name, tensor = spec.hf.from_hf(key, f.get_tensor(key), args)
                    state_dict[name] = tensor
        state_dict = spec.hf.stack(state_dict)  # each expert's tensor into its layer's
    except UserError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"Hugging Face folder '{path}' is damaged: {one_line(e)}; export it again"
        ) from e
    tokenizer = sample.resolve(tokenizer_path or path / "tokenizer.json")
    if not tokenizer.is_file():
        raise CheckpointError(
            f"Hugging Face folder '{path}' has no tokenizer.json: pass --tokenizer FILE"
        )
    return spec, args, state_dict, Tokenizer.from_file(tokenizer)


def _build(loaded: Loaded, source: str | os.PathLike[str]) -> nn.Module:
    """The model a loader gave (family, shape and ``state_dict``), in float32 on the CPU, for
    inference."""
    spec, args, state_dict, _ = loaded
    model = spec.build(args)
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
) -> tuple[nn.Module, Tokenizer]:
    """The model saved at ``path`` (any input kind a loader reads), on ``device``, and its
    tokenizer."""
    if is_hf_folder(path):
        if weights != "model":
            raise ConfigError(
                f"--weights {weights} reads a plugtrain checkpoint, but '{path}' is a Hugging "
                "Face folder: drop --weights, or give a checkpoint of a run with ema"
            )
        loaded = from_hf_folder(Path(path), tokenizer_path)
        return _build(loaded, path).to(device), loaded[3]
    loaded = from_checkpoint(path, weights, tokenizer_path)
    return _with_bias(_build(loaded, path), path).to(device), loaded[3]


def _with_bias(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """``model`` with the experts' selection bias its run saved (the ``moe`` state, not a
    parameter), which moves the choice of experts as in training; a model without is as it was."""
    source = locate_checkpoint(path)
    state = read_checkpoint(source.location, "moe.", source.reader())
    if state:
        layers = dict(enumerate(moe_layers(model)))
        Balance(layers).load_state_dict({"expert_bias": state["moe.expert_bias"]})
    return model


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


def chat_template_of(
    path: str | os.PathLike[str], tokenizer_path: str | None = None
) -> ChatTemplate:
    """The chat template of the model at ``path``: the one its run trained with, as its
    checkpoint records it; else (a text run, or one saved before the template was recorded)
    that of its tokenizer's folder (``tokenizer_path``, else the HF folder's or the run's),
    plugtrain's default when it has none. An HF folder's is its own."""
    if is_hf_folder(path):
        folder_tokenizer = Path(path) / "tokenizer.json"
        return ChatTemplate.for_tokenizer(sample.resolve(tokenizer_path or folder_tokenizer))
    saved = open_checkpoint(path, tokenizer_path)
    return saved.chat_template or ChatTemplate.for_tokenizer(saved.tokenizer_path)


def _chat_template(args: argparse.Namespace) -> ChatTemplate:
    """The template ``generate --chat`` renders with: the model's (:func:`chat_template_of`),
    or ``--chat-template``, said in one line (on stderr) when it differs from the model's."""
    own = chat_template_of(args.path, args.tokenizer)
    if not args.chat_template:
        return own
    path = sample.resolve(args.chat_template)
    if not path.is_file():
        raise MissingFileError(
            f"--chat-template '{args.chat_template}' not found: give a .jinja file, or leave it "
            "out for the template the model trained with"
        )
    given = ChatTemplate(path.read_text(encoding="utf-8"), str(path), own.special_tokens)
    if given.sha256 != own.sha256:
        print(
            f"generate: rendering with --chat-template {path} (sha256 {given.sha256[:12]}), not "
            f"the model's template {own.origin} (sha256 {own.sha256[:12]})",
            file=sys.stderr,
        )
    return given


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a command that loads a saved model with :func:`load` (``generate``,
    ``eval``): its ``PATH``, ``--weights`` and ``--tokenizer``."""
    parser.add_argument(
        "path",
        metavar="PATH",
        help="a run's dump folder or step-N folder (or its s3:// URL), or a Hugging Face folder",
    )
    parser.add_argument(
        "--weights", choices=("model", "ema"), default="model", help="ema: the ema plugin's average"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json, or sample:NAME (default: the run's)"
    )


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain generate``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "generate",
        help=summary,
        description="Load the model of a run's dump folder (its latest checkpoint), of a "
        "checkpoints/step-N folder or of an exported Hugging Face folder and print the text it "
        "writes after --prompt, up to its end-of-text token. Greedy by default; --temperature "
        "> 0 samples.",
    )
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the model's chat template",
    )
    parser.add_argument(
        "--chat-template",
        default="",
        help="with --chat: a .jinja template to render with instead of the one the model "
        "trained with (default: that one, as its checkpoint records it; else its tokenizer's)",
    )
    parser.add_argument(
        "--echo", action="store_true", help="print the prompt (as rendered) before the text"
    )
    parser.add_argument("--max-new-tokens", type=int, default=100, help="at most this many tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest (0: all)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N (default: a GPU if any)"
    )


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
    if args.chat_template and not args.chat:
        raise ConfigError("--chat-template renders a chat prompt: add --chat")
    model, tokenizer = load(args.path, _device(args.device), args.weights, args.tokenizer)
    prompt_ids = stop_id = None
    shown = args.prompt
    if args.chat:  # the prompt is a user's message, rendered with the model's chat template
        template = _chat_template(args)
        messages = [{"role": "user", "content": args.prompt}]
        shown = template.render(messages, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(shown)
        stop_id = (tokenizer.encode(template.reply_end()) or [tokenizer.eos_id])[0]
    text = complete(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        prompt_ids=prompt_ids,
        stop_id=stop_id,
    )
    print(shown + text if args.echo else text)
    return 0
