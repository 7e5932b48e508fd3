"""Tensor parallelism, whatever the family: a model's ``tp`` degree, and its whole logits.

Each family's plan (``ModelSpec.parallelize``) splits its model over the ``tp`` mesh; these
helpers read a split model back, for inference (decoding, scoring).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["tensor_parallel_degree", "whole_logits"]


def tensor_parallel_degree(model: nn.Module) -> int:
    """The ``tp`` of the ranks a family's TP plan (``ModelSpec.parallelize``) split ``model``
    over; 1 if it did not."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    names = () if mesh is None else mesh.mesh_dim_names or ()
    return mesh.size(names.index("tp")) if mesh is not None and "tp" in names else 1


def whole_logits(model: nn.Module, tokens: torch.Tensor, cache: Any = None) -> torch.Tensor:
    """``model(tokens, cache)``'s logits ``[B, S, vocab]``, whole and the same on every rank of
    a ``tp`` group: for inference (decoding, scoring), which reads whole rows of logits.

    Without tensor parallelism it is ``model(tokens, cache)`` itself. With it, every rank of
    the group calls it with the same arguments: the tokens are padded on the right to a
    multiple of ``tp`` (sequence parallelism splits the positions evenly), which changes no
    real position's logits (attention is causal, the padding comes after); the logits are
    gathered over the vocabulary, the padding's dropped, and ``cache`` is moved back to the
    end of the real tokens (their padding's keys are overwritten by the next forward's).
    """
    tp = tensor_parallel_degree(model)
    if tp == 1:
        return model(tokens) if cache is None else model(tokens, cache)
    seq = tokens.shape[1]
    pad = -seq % tp
    logits = model(F.pad(tokens, (0, pad)), cache)
    if cache is not None:
        cache.length -= pad
    return logits.full_tensor()[:, :seq]
