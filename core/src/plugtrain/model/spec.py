"""The model-family seam: what a family gives the trainer, :class:`ModelSpec` and its parts.

A family is a kind of model (Llama today): its shapes, how to build and initialise it, how to
split it over tensor-parallel ranks, its Hugging Face format, its FLOPs and its memory. Every
caller reaches the model through its family's :class:`ModelSpec`, found by name or by a
Hugging Face config.json's ``model_type`` (``model.families``). Free of torch at import.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
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

__all__ = ["HFAdapter", "ModelSpec", "piece", "read_hf_config"]


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face format: its config.json and its state dict's names, both ways.

    Tensors go one at a time, so that an export streams and an import reads only what it needs.
    A parameter the format stores as one tensor per index of its first dimension
    (:attr:`stacked`: a layer's experts, one tensor each in Hugging Face's Qwen3-MoE, stacked in
    plugtrain) goes as its pieces, ``name[i]`` (:func:`piece`), each its own tensor for
    :attr:`to_hf` and :attr:`from_hf`; :meth:`hf_names`, :meth:`pieces_to_hf` and
    :meth:`stack` handle both kinds. The reader side (the initial load, ``generate``,
    ``eval``) is :attr:`args_from_hf` and :attr:`from_hf`; the writer side (``export-hf``)
    :attr:`hf_config`, :attr:`parameter_shapes` and :attr:`to_hf`.
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
    stacked: Callable[[str, Any], bool] = lambda name, args: False
    """``stacked(name, args)``: whether parameter ``name`` is stored as one tensor per index of
    its first dimension (its pieces, :func:`piece`); no parameter of Llama's is."""

    def hf_names(self, name: str, shape: tuple[int, ...], args: Any) -> list[str]:
        """The Hugging Face names parameter ``name`` (of ``shape``) is stored under: one, or
        one per piece."""
        import torch  # here: the module is free of torch at import

        names = [piece(name, i) for i in range(shape[0])] if self.stacked(name, args) else [name]
        return [self.to_hf(n, torch.empty(0), args, permute=False)[0] for n in names]

    def pieces_to_hf(
        self, name: str, tensor: torch.Tensor, args: Any
    ) -> list[tuple[str, torch.Tensor]]:
        """:attr:`to_hf` of parameter ``name``'s full ``tensor``, piece by piece if stacked."""
        if not self.stacked(name, args):
            return [self.to_hf(name, tensor, args)]
        return [self.to_hf(piece(name, i), t, args) for i, t in enumerate(tensor.unbind())]

    @staticmethod
    def stack(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (plugtrain's names, :attr:`from_hf`'s) with each parameter's pieces
        stacked into it, in index order."""
        import torch

        out: dict[str, torch.Tensor] = {}
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in state_dict.items():
            match = _PIECE.fullmatch(name)
            if match is None:
                out[name] = tensor
            else:
                pieces.setdefault(match[1], {})[int(match[2])] = tensor
        for name, parts in pieces.items():
            if sorted(parts) != list(range(len(parts))):
                missing = min(set(range(len(parts) + 1)) - set(parts))
                raise CheckpointError(
                    f"piece {missing} of tensor '{name}' is missing: use a complete model folder"
                )
            out[name] = torch.stack([parts[i] for i in range(len(parts))])
        return out


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer, the estimate, the checkpoints and the commands need of a family.

    ``args`` below is an instance of :attr:`args`. The model :attr:`build` returns is called as
    the trainer and the loss heads call Llama's ``Transformer``: ``model(tokens, cache, *,
    documents, positions, head)`` returning logits ``[B, S, vocab]`` (or ``head(hidden,
    project)``), and has ``args`` (with ``max_seq_len`` and ``vocab_size``), ``layers`` (the
    blocks FSDP2 shards one by one: an ``nn.ModuleDict`` keyed by block index, ``"0"`` ..,
    whose ``values()`` are in order), ``init_buffers()`` (its non-parameter state, after
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
    reduce_dtype, checkpointing, dp_replicate, tp, loss_chunks, pipeline)``, the bytes a step
    holds on each process (``plugtrain estimate``, the trainer's start-up line); ``pipeline``
    (a ``PipelineShare``, given under pipeline parallelism only): that pipeline rank's."""
    pipeline_split: Callable[[nn.Module, int, Sequence[int]], list[nn.Module]] | None = None
    """``pipeline_split(model, stages, indices)``: stages ``indices`` of ``model`` (built,
    unsharded, on the meta device) cut into ``stages``, one module each (a rank of an
    interleaved schedule holds several). A stage keeps the whole model's parameter names, is
    given the same keyword arguments as the whole model, and takes (and returns) the hidden
    states where it has no embedding (no output); run one after another, the stages give the
    whole model's output. An uneven split or tied embeddings over several stages are refused
    in one ``ConfigError`` line. None: the family cannot be pipelined. Llama's and the moe
    family's: ``model.llama.pipeline.pipeline_split`` (plugtrain has no pipeline schedule
    yet)."""


_PIECE = re.compile(r"(.+)\[(\d+)\]")


def piece(name: str, index: int) -> str:
    """The name of piece ``index`` (of its first dimension) of parameter ``name``."""
    return f"{name}[{index}]"


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
