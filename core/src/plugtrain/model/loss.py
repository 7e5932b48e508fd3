"""Every loss function: cross-entropy (plain, vocab-parallel, chunked) and log-sum-exp.

The cross-entropy comes as a mean or as a sum over the counted targets, of plain logits or of
logits sharded over the vocabulary (tensor parallelism), and in chunks of tokens.

Chunked, the full logits never exist.

At a large vocabulary the logits dominate a step's memory: ``tokens x vocab`` in the compute
dtype, their fp32 copy, log-softmax's fp32 output and, in backward, its gradient (12 bytes a
token and vocabulary entry in fp32). :class:`ChunkedLoss` is a head for
``Transformer.forward``: it takes the final norm's output and the output projection, and
computes the projection and the cross-entropy one chunk of tokens at a time, each under
activation checkpointing, so that backward recomputes the chunk's logits instead of keeping
them. Memory for the loss falls by the number of chunks; the projection runs twice (about
``2 * tokens * dim * vocab`` FLOPs more per step, a third of the output projection's share).
The loss equals the unchunked one up to float32 rounding: the sums are taken in another order.

Under tensor parallelism the final norm's output is split by position and the output
projection by vocabulary. The head gathers the positions once (what the projection's own
input layout does unchunked) and chunks the gathered tokens; each chunk's logits stay a DTensor
sharded over the vocabulary, so ``loss_parallel``'s cross-entropy and :func:`logsumexp`
reduce over the vocabulary with a collective of one value a token. Staying in DTensor, rather
than a hand-written vocab-parallel loss on the local shards, keeps the backward's placements
DTensor's to track: the gradient reaching the gathered tokens is partial over the ``tp``
ranks and is reduce-scattered back to their positions (labelling it replicated instead is the
bug of torchtitan PR #3412); the cross-entropy is the unchunked TP loss's, and each rank
returns the replicated loss and log-sum-exp as plain tensors, as ``parallel_cross_entropy``
does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

__all__ = [
    "ChunkedLoss",
    "cross_entropy",
    "logsumexp",
    "parallel_cross_entropy",
    "parallel_summed_cross_entropy",
    "summed_cross_entropy",
]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token loss summed over the targets that count (``-100``, the ignore index, left
    out), in fp32: 0, not NaN, when none does."""
    flat = targets.flatten(0, 1)
    return F.cross_entropy(logits.flatten(0, 1).float(), flat, reduction="sum")


def parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`cross_entropy` of logits sharded over the vocabulary (a DTensor), as the plain
    loss tensor every rank of the ``tp`` group holds. Call it, and the backward through it,
    inside ``torch.distributed.tensor.parallel.loss_parallel()``."""
    return cross_entropy(logits, targets).to_local()  # replicated: the whole loss, no collective


def parallel_summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`summed_cross_entropy` (chat data's loss over its counted targets) of logits
    sharded over the vocabulary, as :func:`parallel_cross_entropy` returns the mean."""
    return summed_cross_entropy(logits, targets).to_local()


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over the last dimension of ``logits``, in their dtype: ``torch.logsumexp``
    of a plain tensor; of a DTensor sharded over it (tensor-parallel logits), the max and the
    sum of the shards' exponentials each all-reduced, where DTensor's ``torch.logsumexp`` would
    all-gather the whole vocabulary first. The max is a constant to autograd: its gradient
    terms cancel."""
    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits, dim=-1)
    top = logits.detach().amax(dim=-1, keepdim=True)
    return ((logits - top).exp().sum(dim=-1).log() + top.squeeze(-1)).redistribute(
        placements=[Replicate()] * logits.device_mesh.ndim
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as the plain tensor each rank holds; ``t`` if plain."""
    return t.to_local() if isinstance(t, DTensor) else t


class ChunkedLoss:
    """``head(hidden, project) -> (loss, lse)``: the mean next-token cross-entropy of ``targets``
    over ``chunks`` chunks of tokens (with ``summed``, its sum over the targets that are not
    ``-100``, as a loss mask leaves them), and, with ``with_lse``, each token's log-sum-exp of the
    logits (``(batch, seq_len)``, fp32, in the autograd graph) for loss terms such as z-loss;
    ``lse`` is None without it."""

    def __init__(
        self, targets: torch.Tensor, chunks: int, with_lse: bool = False, summed: bool = False
    ) -> None:
        self.targets = targets
        self.chunks = chunks
        self.with_lse = with_lse
        self.summed = summed

    def __call__(
        self, hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq_len = self.targets.shape
        if isinstance(hidden, DTensor):  # tensor parallel: every position, once
            hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        total = torch.zeros((), device=hidden.device)
        lses = []
        for h, t in zip(
            hidden.flatten(0, 1).chunk(self.chunks),
            self.targets.flatten().chunk(self.chunks),
            strict=True,
        ):
            ce, lse = checkpoint(self._chunk, project, h, t, use_reentrant=False)
            total = total + _local(ce)
            lses.append(_local(lse))
        lse = torch.cat(lses).view(batch, seq_len) if self.with_lse else None
        return (total if self.summed else total / self.targets.numel()), lse

    def _chunk(
        self,
        project: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's summed cross-entropy and its tokens' log-sum-exp (empty without
        ``with_lse``: checkpoint needs a tensor)."""
        logits = project(hidden).float()
        ce = F.cross_entropy(logits, targets, reduction="sum")
        lse = logsumexp(logits) if self.with_lse else logits.new_empty(0)
        return ce, lse
