"""The initial load: a new run's weights from a Hugging Face folder or a step-N checkpoint.

In place of ``init_weights``, with AdamW's state too on request.

``checkpoint.initial_load_path`` names either (a checkpoint also as an object store URL,
``s3://bucket/prefix[/checkpoints/step-N]``, read as ``plugtrain.checkpoint.saved`` reads one).
It applies on a fresh start only: a dump folder that holds complete checkpoints resumes from
them instead (:func:`initial_load_ignored` says why), since the run it continues already
started from the load.

Either way the tensors go straight into the sharded model and no process holds the whole
model. A Hugging Face folder (``config.json`` and ``model.safetensors``, or shards listed by
``model.safetensors.index.json``) is read through ``safetensors``' lazy slices: each rank reads
only the block of each tensor it holds, FSDP's rows and tensor parallelism's rows or columns
(for q and k, the rows of the heads they fall in, which RoPE's layout change permutes within;
see the family's ``HFAdapter``, Llama's in ``model/llama/hf.py``), cast to the parameter's
dtype. A ``step-N/`` folder is read by DCP, which reshards any saved world size and layout onto
this one; with
``checkpoint.initial_load_model_only = false`` AdamW's per-parameter state (moments and its own
step count) comes too. Never the trainer's step, LR schedule, data position or plugin states:
those start afresh with the new run's settings.

Every check runs before any tensor is read and before the run writes to its dump folder: a
missing or damaged folder, a model shape that differs (tensor by tensor), missing or unknown
tensors, or a tokenizer whose vocabulary does not match the embedding are refused in one line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim import Optimizer

from plugtrain.checkpoint.dcp_io import TensorOnlyLoadPlanner, flat_keys, read_checkpoint
from plugtrain.checkpoint.layout import CONFIG, STEP_DIR, checkpoint_folder, complete_checkpoints
from plugtrain.checkpoint.object_store import open_storage
from plugtrain.checkpoint.saved import CheckpointFolder, locate_checkpoint
from plugtrain.config import CheckpointConfig
from plugtrain.errors import CheckpointError, one_line
from plugtrain.model import FAMILIES, HFAdapter, check_family, conversion_of, hf_model_spec
from plugtrain.urls import is_url

logger = logging.getLogger("plugtrain")

__all__ = ["InitialLoad", "initial_load_ignored", "open_initial_load"]

HF_INDEX = "model.safetensors.index.json"
HF_WEIGHTS = "model.safetensors"

_KEY = "checkpoint.initial_load_path"
_IGNORED_HF = ("rotary_emb.inv_freq",)
"""Tensors some Hugging Face Llama folders hold that are no weights (the RoPE table)."""
_SETTINGS = ("norm_eps", "rope_theta", "rope_scaling", "tie_embeddings")
"""The model settings a config.json sets that change the numbers but no tensor's shape."""


def initial_load_ignored(config: CheckpointConfig, dump_folder: str | os.PathLike[str]) -> str:
    """Why this run resumes instead of applying the initial load ("" if it applies): the
    checkpoint it resumes from, as the :class:`CheckpointManager` will pick it."""
    if not config.enable or config.load_step == 0:
        return ""
    available = open_storage(dump_folder, config.endpoint_url, config.store_retries).steps()
    if not available:
        return ""
    step = config.load_step if config.load_step > 0 else available[-1]
    return (
        f"resuming from step-{step} ({_KEY} ignored: the dump folder has checkpoints, "
        f"{', '.join(f'step-{s}' for s in available)})"
    )


def _refuse(path: Path | str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{_KEY} '{path}' {why}: give a Hugging Face model folder (config.json and "
        "model.safetensors or model.safetensors.index.json) or a plugtrain step-N checkpoint folder"
    )


@dataclass
class InitialLoad:
    """A checked initial-load source; :meth:`load` puts it into a run's model and optimizer."""

    kind: str
    """``hf`` (a Hugging Face folder) or ``plugtrain`` (a ``step-N/`` checkpoint)."""
    path: Path | str
    """The folder, or a checkpoint's URL."""
    config: dict[str, Any]
    """Its ``config.json``: the Hugging Face model's, or the saving run's resolved config."""
    model_only: bool
    files: dict[str, Path] = field(default_factory=dict)
    """hf: each tensor's safetensors file, by Hugging Face name."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The stored tensors' shapes, by name (Hugging Face's, or the DCP key)."""
    metadata: Metadata | None = None
    """plugtrain: the checkpoint's DCP metadata."""
    source: CheckpointFolder | None = None
    """plugtrain: the checkpoint, to read it."""

    def record(self) -> dict[str, Any]:
        """What the run started from, for ``run.json``."""
        where = self.path if isinstance(self.path, str) else str(self.path.resolve())
        out: dict[str, Any] = {"kind": self.kind, "path": where}
        if self.source is None:
            assert isinstance(self.path, Path)
            out["model"] = self.config.get("_name_or_path") or self.path.resolve().name
            config = (self.path / CONFIG).read_bytes()
        else:
            out["step"] = self.source.step
            config = self.source.read_file(CONFIG)
        out["config_sha256"] = hashlib.sha256(config).hexdigest()
        out["model_only"] = self.model_only
        return out

    # ------------------------------------------------------------------ checks

    def check(self, model: nn.Module, args: Any, tokenizer: str) -> None:
        """Refuse, in one line, a source that does not fit ``model`` (of shape ``args``; its
        vocabulary is tokenizer ``tokenizer``'s): before anything is read."""
        added = conversion_of(model).added
        if added and not self.model_only:
            raise CheckpointError(
                f"{_KEY} '{self.path}' would bring AdamW's state, but plugin "
                f"'{next(iter(added.values())).plugin}' adds parameters it has none for: set "
                "checkpoint.initial_load_model_only = true"
            )
        wanted = {k: tuple(v.shape) for k, v in _base_state(model).items()}
        if self.kind == "hf":
            self._check_hf(args)
            have = self._hf_shapes(wanted, args)
        else:
            have = {k.removeprefix("model."): v for k, v in self.shapes.items()
                    if k.startswith("model.")}  # fmt: skip
            have = {k: v for k, v in have.items() if k not in added}
        embedding = "tok_embeddings.weight"
        if embedding in have and have[embedding][:1] != wanted[embedding][:1]:
            if self.kind == "hf":
                fix = (
                    "use the model's own tokenizer (set model.tokenizer_path to it, or leave it "
                    "unset for the folder's tokenizer.json)"
                )
            else:
                theirs = self.config.get("model", {}).get("tokenizer_path")
                fix = f"use the tokenizer of the run that saved it (its '{theirs}')"
            raise CheckpointError(
                f"tokenizer '{tokenizer}' has {wanted[embedding][0]} tokens, but the embedding of "
                f"{_KEY} '{self.path}' has {have[embedding][0]} rows: {fix}"
            )
        for name, shape in wanted.items():
            if name in have and have[name] != shape:
                raise CheckpointError(
                    f"{_KEY} '{self.path}' holds another model shape: tensor '{name}' is "
                    f"{list(have[name])} there and {list(shape)} in model.flavor's model here; "
                    "pick the model.flavor of its shape"
                )
        if missing := [name for name in wanted if name not in have]:
            raise CheckpointError(
                f"{_KEY} '{self.path}' lacks {len(missing)} tensor(s) of the model: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; use a complete "
                "checkpoint of a model of this shape"
            )
        if extra := [name for name in have if name not in wanted]:
            raise CheckpointError(
                f"{_KEY} '{self.path}' holds tensor(s) the model has no place for: "
                f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; pick the "
                "model.flavor it was trained with"
            )

    @functools.cached_property
    def _hf(self) -> HFAdapter:
        """hf: the Hugging Face format of the folder's model family (config.json's
        ``model_type``)."""
        try:
            return hf_model_spec(self.config).hf
        except CheckpointError as e:
            raise CheckpointError(f"{_KEY} '{self.path}': {e}") from e

    def _hf_shapes(
        self, wanted: dict[str, tuple[int, ...]], args: Any
    ) -> dict[str, tuple[int, ...]]:
        """The folder's tensors' shapes by plugtrain's name, a stacked parameter's (one tensor
        per expert there) as its pieces stacked; a tensor no parameter claims by its own name."""
        have, claimed = {}, set()
        for name, shape in wanted.items():
            hf_names = self._hf.hf_names(name, shape, args)
            claimed.update(hf_names)
            if all(n in self.shapes for n in hf_names):
                first = self.shapes[hf_names[0]]
                stacked = self._hf.stacked(name, args)
                have[name] = (len(hf_names), *first) if stacked else first
        return have | {k: v for k, v in self.shapes.items() if k not in claimed}

    def read_full(self, name: str, args: Any) -> torch.Tensor:
        """Parameter ``name``'s full tensor in plugtrain's layout (Hugging Face's q/k rows
        permuted back), read by this process alone: what a checkpoint left out, for one that
        reads it (``checkpoint/base.py``)."""
        if self.source is not None:
            key = f"model.{name}"
            return read_checkpoint(self.path, key, self.source.reader())[key]
        pieces = []
        for hf_name in self._hf_names(name, args):
            with safe_open(self.files[hf_name], framework="pt") as f:
                pieces.append(self._hf.from_hf(hf_name, f.get_tensor(hf_name), args)[1])
        return torch.stack(pieces) if self._hf.stacked(name, args) else pieces[0]

    def _hf_names(self, name: str, args: Any) -> list[str]:
        """The Hugging Face names of parameter ``name``: one per expert if stacked."""
        return self._hf.hf_names(name, self._hf.parameter_shapes(args)[name], args)

    def _check_hf(self, args: Any) -> None:
        family = next((n for n, load in FAMILIES.items() if isinstance(args, load().args)), None)
        if family is not None:
            check_family(self.config, family, f"{_KEY} '{self.path}'")
        try:
            theirs = self._hf.args_from_hf(self.config)
        except CheckpointError as e:  # what the family's model cannot express
            raise CheckpointError(f"{_KEY} '{self.path}': {e}") from e
        for setting in _SETTINGS:
            if getattr(theirs, setting) != getattr(args, setting):
                raise CheckpointError(
                    f"{_KEY} '{self.path}' has {setting} {getattr(theirs, setting)!r} in its "
                    f"config.json, but model.flavor's model has {getattr(args, setting)!r}: "
                    'set model.flavor = "hf" to take the folder\'s own shape'
                )

    # ------------------------------------------------------------------ loading

    def load(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        args: Any,
        only: set[str] | None = None,
    ) -> None:
        """Put the source's weights (and AdamW's state, unless ``model_only``) into ``model``
        and ``optimizer``; every rank reads only its shards (collective for ``plugtrain``).
        ``only``: these parameters alone (a resume re-reads the base weights its checkpoint
        left out, ``checkpoint.base``), the model's weights only."""
        if optimizer is None and not self.model_only and only is None:
            raise ValueError("loading the optimizer state needs the optimizer")
        start = time.perf_counter()
        if self.kind == "hf":
            self._load_hf(model, args, only)
        else:
            self._load_plugtrain(model, optimizer, only)
        logger.info(
            "initial load from %s (%s%s, %s) in %.2f s",
            self.path,
            "Hugging Face folder" if self.kind == "hf" else "plugtrain checkpoint",
            "" if self.model_only or only is not None else ", with the optimizer state",
            "fresh start" if only is None else f"{len(only)} base weights the checkpoint left out",
            time.perf_counter() - start,
        )

    @torch.no_grad()
    def _load_hf(self, model: nn.Module, args: Any, only: set[str] | None) -> None:
        conversion = conversion_of(model)
        for name, value in _base_state(model, only).items():
            # One held in another form is read whole: it is converted whole, then sharded.
            if isinstance(value, DTensor) and name not in conversion.stored:
                # FSDP's Shard(0), tensor parallelism's Shard(0) or Shard(1), or both: each rank
                # holds one block, contiguous in every dimension.
                shape, offset = compute_local_shape_and_global_offset(
                    value.shape, value.device_mesh, value.placements
                )
                target = value.to_local()
            else:
                shape, offset, target = tuple(value.shape), (0,) * value.ndim, value
            if 0 in shape:
                continue
            if self._hf.stacked(name, args):  # this rank's experts, one tensor each
                hf_names = self._hf.hf_names(name, tuple(value.shape), args)
                rows = hf_names[offset[0] : offset[0] + shape[0]]
                block = torch.stack([self._read(n, offset[1:], shape[1:]) for n in rows])
            else:
                block = self._read_rows(name, args, value.shape[0], offset, shape)
            if name in conversion.stored:
                conversion.load_stored(model, name, block)
            else:
                target.copy_(block.to(target.dtype))

    def _read_rows(
        self, name: str, args: Any, rows: int, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The block ``offset``, ``shape`` of parameter ``name`` (of ``rows`` rows) in
        plugtrain's layout, read from its Hugging Face tensor: the rows through the q/k
        permutation."""
        hf_name = self._hf.to_hf(name, torch.empty(0), args, permute=False)[0]
        # Which stored row each of ours is: the q/k permutation, applied to row numbers.
        order = torch.arange(rows).unsqueeze(1)
        order = self._hf.from_hf(hf_name, order, args)[1].squeeze(1)
        wanted = order[offset[0] : offset[0] + shape[0]]
        low, high = int(wanted.min()), int(wanted.max()) + 1
        block = self._read(hf_name, offset[1:], shape[1:], rows=slice(low, high))
        return block[wanted - low]

    def _read(
        self,
        hf_name: str,
        offset: tuple[int, ...],
        shape: tuple[int, ...],
        rows: slice | None = None,
    ) -> torch.Tensor:
        """Tensor ``hf_name``'s ``rows`` (all if None) and the block ``offset``, ``shape`` of
        its other dimensions, read through safetensors' lazy slices."""
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        try:
            with safe_open(self.files[hf_name], framework="pt") as f:
                return f.get_slice(hf_name)[((rows,) if rows is not None else ()) + index]
        except (SafetensorError, OSError, RuntimeError) as e:
            raise _refuse(self.path, f"cannot be read ({one_line(e)})") from e

    def _load_plugtrain(
        self, model: nn.Module, optimizer: Optimizer | None, only: set[str] | None
    ) -> None:
        assert self.metadata is not None and self.source is not None
        conversion = conversion_of(model)
        if self.model_only or only is not None:
            state: dict[str, Any] = {"model": _base_state(model, only)}
        else:
            assert optimizer is not None
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": {"state": optim_state["state"]}}
            # AdamW's lazily made state must exist in the checkpoint in every entry DCP reads.
            missing = sorted(set(flat_keys(state)) - set(self.metadata.state_dict_metadata))
            if missing:
                raise CheckpointError(
                    f"{_KEY} '{self.path}' lacks optimizer state '{missing[0]}': set "
                    "checkpoint.initial_load_model_only = true to take its weights only"
                )
        # One held in another form is read whole, in float32: it is converted whole, then
        # sharded (model.conversion).
        whole = {
            name: torch.empty(value.shape, dtype=torch.float32)
            for name, value in state["model"].items()
            if name in conversion.stored
        }
        state["model"].update(whole)
        try:
            dcp.load(
                state,
                storage_reader=self.source.reader(),
                planner=TensorOnlyLoadPlanner(),
            )
        except (Exception, dcp.CheckpointException) as e:
            raise _refuse(self.path, f"cannot be read ({one_line(e)})") from e
        for name, full in whole.items():
            conversion.load_stored(model, name, full)
            del state["model"][name]
        if self.model_only or only is not None:
            # Not strict: the parameters a plugin added keep their init.
            set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                # This run's param groups: its learning rate, betas and weight decay.
                optim_state_dict={**optim_state, "state": state["optimizer"]["state"]},
                options=StateDictOptions(strict=not whole),
            )


def _base_state(model: nn.Module, only: set[str] | None = None) -> dict[str, Any]:
    """``model``'s state dict without the parameters a plugin added (``convert_model``): what
    an initial load reads (``only`` those, if given); the added ones keep their init."""
    state = conversion_of(model).base_state(get_model_state_dict(model))
    return state if only is None else {k: v for k, v in state.items() if k in only}


# ---------------------------------------------------------------------- opening a source


def _read_json(read: Callable[[], bytes], name: str, folder: Path | str) -> dict[str, Any]:
    """The JSON object of file ``name`` of ``folder`` (``read`` gives its bytes)."""
    try:
        data = json.loads(read())
    except (OSError, ValueError) as e:
        raise _refuse(folder, f"has a damaged {name} ({one_line(e)})") from e
    if not isinstance(data, dict):
        raise _refuse(folder, f"has a damaged {name} (not a JSON object)")
    return data


def _open_hf(path: Path, config: dict[str, Any], model_only: bool) -> InitialLoad:
    if not model_only:
        raise CheckpointError(
            f"{_KEY} '{path}' is a Hugging Face folder, which holds no optimizer state: set "
            "checkpoint.initial_load_model_only = true, or give a plugtrain step-N folder"
        )
    if (path / HF_INDEX).is_file():
        weight_map = _read_json((path / HF_INDEX).read_bytes, HF_INDEX, path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _refuse(path, f"has a damaged {HF_INDEX} (no weight_map)")
        names = sorted(set(weight_map.values()))
    elif (path / HF_WEIGHTS).is_file():
        names = [HF_WEIGHTS]
    else:
        raise _refuse(path, f"has no {HF_WEIGHTS} nor {HF_INDEX}")
    files: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        try:
            # Opening reads and checks the header only: a truncated file fails here.
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if not key.endswith(_IGNORED_HF):
                        files[key] = path / name
                        shapes[key] = tuple(f.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise _refuse(path, f"has a damaged or missing {name} ({one_line(e)})") from e
    return InitialLoad("hf", path, config, model_only, files=files, shapes=shapes)


def _open_plugtrain(source: CheckpointFolder, model_only: bool) -> InitialLoad:
    path = source.location
    try:
        metadata = source.reader().read_metadata()
    except Exception as e:
        raise _refuse(path, f"has a damaged .metadata ({one_line(e)})") from e
    config = _read_json(lambda: source.read_file(CONFIG), CONFIG, path)
    shapes = {
        key: tuple(md.size)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    if not model_only and not any(k.startswith("optimizer.state.") for k in shapes):
        raise CheckpointError(
            f"{_KEY} '{path}' holds no optimizer state (saved before the optimizer's first "
            "step): set checkpoint.initial_load_model_only = true"
        )
    return InitialLoad(
        "plugtrain", path, config, model_only, shapes=shapes, metadata=metadata, source=source
    )


def _is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face folder to read, rather than a plugtrain checkpoint:
    a local folder that is no ``step-N`` checkpoint, nor a run's dump folder holding them."""
    folder = Path(path)
    return (
        folder.is_dir()
        and not (folder / ".metadata").is_file()
        and not STEP_DIR.fullmatch(folder.name)
        and not complete_checkpoints(checkpoint_folder(folder))
    )


def open_initial_load(config: CheckpointConfig) -> InitialLoad:
    """The checked source ``checkpoint.initial_load_path`` names (headers and metadata only
    are read); a one-line :class:`CheckpointError` for a missing or damaged folder."""
    path, model_only = config.initial_load_path, config.initial_load_model_only
    if not is_url(path) and not Path(path).is_dir():
        raise _refuse(path, "is a file, not a folder" if Path(path).exists() else "does not exist")
    if _is_hf_folder(path):
        folder = Path(path)
        if not (folder / CONFIG).is_file():
            raise _refuse(folder, "has no config.json")
        return _open_hf(
            folder, _read_json((folder / CONFIG).read_bytes, CONFIG, folder), model_only
        )
    try:
        source = locate_checkpoint(path, config.endpoint_url)
    except CheckpointError as e:
        raise CheckpointError(
            f"{_KEY}: {e}; or give a Hugging Face model folder (config.json, model.safetensors)"
        ) from e
    return _open_plugtrain(source, model_only)
