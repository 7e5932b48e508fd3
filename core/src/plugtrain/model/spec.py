"""The model-family seam: what a family gives the trainer, :class:`ModelSpec` and its parts.

A family is a kind of model (Llama today): its shapes, how to build and initialise it, how to
split it over tensor-parallel ranks, its Hugging Face format, its FLOPs and its memory. Every
caller reaches the model through its family's :class:`ModelSpec`, found by name or by a
Hugging Face config.json's ``model_type`` (``model.families``). Free of torch at import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugtrain.errors import CheckpointError, one_line

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from plugtrain.model.gemm import Gemm
    from plugtrain.model.init import Fill
    from plugtrain.model.memory import MemoryEstimate

__all__ = ["HFAdapter", "ModelSpec", "read_hf_config"]


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face format: its config.json and its state dict's names, both ways.

    Tensors go one at a time, so that an export streams and an import reads only what it needs.
    The reader side (the initial load, ``generate``, ``eval``) is :attr:`args_from_hf` and
    :attr:`from_hf`; the writer side (``export-hf``) :attr:`hf_config`,
    :attr:`parameter_shapes` and :attr:`to_hf`.
    """

    model_type: str
    """config.json's ``model_type`` for this family (``"llama"``): how a folder finds it."""
    args_from_hf: Callable[[dict[str, Any]], Any]
    """Reader: the family's args of a config.json, or a one-line ``CheckpointError`` naming the
    field it cannot express."""
    from_hf: Callable[..., tuple[str, torch.Tensor]]
    """Reader: ``(hf_name, tensor, args, *, permute=True) -> (name, tensor)``, plugtrain's."""
    hf_config: Callable[..., dict[str, Any]]
    """Writer: ``(args, *, dtype, bos_token_id, eos_token_id) -> config.json``."""
    parameter_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    """Writer: every parameter of the family's model by plugtrain's name, in the model's
    order, from the args alone (the export checks a checkpoint against it)."""
    to_hf: Callable[..., tuple[str, torch.Tensor]]
    """Writer: ``(name, tensor, args, *, permute=True) -> (hf_name, tensor)``, the inverse of
    :attr:`from_hf`; a tensor the format has no place for raises ``CheckpointError``."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer, the estimate, the checkpoints and the commands need of a family.

    ``args`` below is an instance of :attr:`args`. The model :attr:`build` returns is called as
    the trainer and the loss heads call Llama's ``Transformer``: ``model(tokens, cache, *,
    documents, positions, head)`` returning logits ``[B, S, vocab]`` (or ``head(hidden,
    project)``), and has ``args`` (with ``max_seq_len`` and ``vocab_size``), ``layers`` (the
    blocks FSDP2 shards one by one), ``init_buffers()`` (its non-parameter state, after
    ``to_empty``) and ``kv_cache(max_batch, max_seq_len)`` (for decoding).
    """

    name: str
    """The family's name, ``[model] family``'s value."""
    args: type
    """The class of the family's shapes (Llama's ``ModelArgs``)."""
    flavors: Mapping[str, Any]
    """The named shapes (``model.flavor``'s values), instances of :attr:`args`."""
    build: Callable[[Any], nn.Module]
    """``build(args)``: the model, with PyTorch's default initialisation; the trainer calls it
    under the meta device."""
    init_plan: Callable[[nn.Module], list[tuple[nn.Parameter, Fill]]]
    """``init_plan(model)``: every parameter with how to fill it, in a fixed, sharding-free
    order (``model.init.initialize`` draws them the same whatever the sharding)."""
    parallelize: Callable[[nn.Module, DeviceMesh], None]
    """The TP plan: split ``model`` (unsharded, on the meta device) over the ``tp`` mesh in
    place, leaving the logits sharded over the vocabulary (for ``loss_parallel``)."""
    check_parallel: Callable[[Any, int, int], None]
    """``check_parallel(args, tp, seq_len)``: refuse, in one ``ConfigError`` line, a shape
    that ``tp`` ranks cannot split evenly."""
    hf: HFAdapter
    """The Hugging Face format: config.json and the tensors' names, both ways."""
    num_params: Callable[[Any], int]
    """``num_params(args)``: the model's parameter count, from the shape alone."""
    flops_per_token: Callable[[Any, int], int]
    """``flops_per_token(args, seq_len)``: training FLOPs a token, for MFU."""
    gemms: Callable[[Any, int, int], list[Gemm]]
    """``gemms(args, rows, seq_len)``: the matrix products of a step's forward and backward
    of ``rows`` sequences, for the roofline (``observability.limits.matmul_seconds``)."""
    memory: Callable[..., MemoryEstimate]
    """The memory formula: ``memory(args, *, world_size, microbatch, seq_len, param_dtype,
    reduce_dtype, checkpointing, dp_replicate, tp, loss_chunks)``, the bytes a step holds on
    each process (``plugtrain estimate``, the trainer's start-up line)."""
    pipeline_split: Callable[..., Any] | None = None
    """The hook for pipeline parallelism: how the model splits into stages. None: the family
    cannot be pipelined yet (no family can: plugtrain has no pipeline schedule so far)."""


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json at ``path`` (the file, or a folder holding it), as a dict; a one-line
    :class:`CheckpointError` if it is missing or not JSON."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read Hugging Face config '{file}' ({one_line(e)}): give a config.json "
            "or the folder holding it"
        ) from e
    if not isinstance(config, dict):
        raise CheckpointError(
            f"Hugging Face config '{file}' is not a JSON object: give a model's config.json"
        )
    return config
