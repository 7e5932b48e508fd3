"""Context parallelism: each rank holds a part of every sequence and attends over all of it.

Under ``[parallelism] cp = C`` the ``C`` ranks of a group read the same rows and each keeps two
of the row's ``2C`` chunks, chunk ``r`` and chunk ``2C - 1 - r`` (:func:`zigzag_indices`: the
first and the last chunks hold the least and the most causal work, so every rank gets as much,
Llama 3's load balancing). Everything but attention is per token, so the model runs on the
rank's tokens as on short rows, given their RoPE positions. Attention, through the model's
attention seam (:class:`ContextParallel`, in place of the variant), needs every token's keys
and values:

* ``allgather``: each rank gathers the keys and values of every rank (an all-gather with
  autograd, whose backward reduce-scatters their gradients) and attends its own queries over
  them;
* ``ulysses``: an all-to-all gives each rank every token's queries, keys and values for
  ``heads / C`` of the heads; it attends over the whole sequence, and a second all-to-all
  gives each rank its tokens back, for every head.

Either attends under a boolean mask built once per forward from the tokens' places in the row
(causal) and their documents (document masking, the documents of every rank gathered once):
SDPA with a mask, on every device. Written with plain collectives (torch's
``context_parallel`` has no CPU path in torch 2.13), so the CPU tests prove what a GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F
from torch import nn

from plugtrain.model.attention import AttentionVariant

__all__ = ["ContextParallel", "parallelize_context", "zigzag_indices"]


def zigzag_indices(
    seq_len: int, cp: int, rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """The places in a row of ``seq_len`` tokens that rank ``rank`` of ``cp`` holds: chunks
    ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` equal chunks, in that order."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * chunk])


@dataclass(frozen=True)
class ContextMask:
    """What every layer's attention needs of a context-parallel forward, built once in it:
    ``order``, the natural order of the row's tokens as the ranks' parts gather them, and per
    query chunk this rank attends for (``allgather``: its two; ``ulysses``: the whole row) the
    keys it sees (a prefix of the row, the chunk's own tokens its end) and their mask (None:
    causal)."""

    order: torch.Tensor
    chunks: tuple[tuple[slice, int, torch.Tensor | None], ...]
    """(this rank's queries, the number of keys they see, their mask) of each query chunk."""


class ContextParallel:
    """The attention variant of a model whose ranks of ``group`` each hold their part of every
    sequence (:func:`zigzag_indices`), computing attention by ``method`` (see the module doc).
    Its mask is a :class:`ContextMask`; no KV cache (generation runs the whole model on one
    process)."""

    def __init__(self, group: dist.ProcessGroup, method: str) -> None:
        self.group, self.method = group, method
        self.size, self.rank = group.size(), group.rank()

    def _gather(self, t: torch.Tensor, dim: int, autograd: bool = True) -> torch.Tensor:
        """``t`` of every rank of the group, concatenated along ``dim`` in rank order (with
        autograd: its backward gives each rank the gradient of its own part, summed)."""
        gather = fc.all_gather_single_autograd if autograd else fc.all_gather_single
        return fc.wait_tensor(gather(t.contiguous(), dim, self.group))

    def mask(
        self, tokens: torch.Tensor, start: int, documents: torch.Tensor | None = None
    ) -> ContextMask:
        """The forward's :class:`ContextMask`: each query chunk sees the keys up to its own
        end, causally (and within its document, given ``documents``, this rank's part of
        them), the others not at all: ``allgather`` attends each of the rank's two chunks
        over just those keys, so each rank does as much work, half of attending them all."""
        if start:
            raise ValueError(
                "context parallelism takes no KV cache: generate on one process, whole"
            )
        part, device = tokens.shape[1], tokens.device
        seq = part * self.size
        gathered = torch.cat([zigzag_indices(seq, self.size, r, device) for r in range(self.size)])
        order = gathered.argsort()
        every = None if documents is None else self._gather(documents, 1, autograd=False)
        if self.method == "ulysses":  # the whole row, in its natural order
            whole = None
            if every is not None:
                every = every[:, order]
                causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
                whole = ((every[:, :, None] == every[:, None, :]) & causal)[:, None]
            return ContextMask(order, ((slice(0, seq), seq, whole),))
        chunk, chunks = part // 2, []
        for j, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            keys = (index + 1) * chunk  # a prefix of the row: the chunk's own is its last
            rows, mask = slice(j * chunk, (j + 1) * chunk), None
            if every is not None:
                causal = torch.ones(chunk, keys, dtype=torch.bool, device=device)
                mine, seen = documents[:, rows], every[:, order[:keys]]
                mask = causal.tril(keys - chunk) & (mine[:, :, None] == seen[:, None, :])
                mask = mask[:, None]
            chunks.append((rows, keys, mask))
        return ContextMask(order, tuple(chunks))

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask | None
    ) -> torch.Tensor:
        """Attention of this rank's queries ``q`` [B, heads, S/cp, head_dim] over every rank's
        keys and values; returns this rank's [B, heads, S/cp, head_dim]."""
        assert mask is not None, "a context-parallel forward builds its mask"
        if self.method == "allgather":
            k, v = (self._gather(t, 2)[:, :, mask.order] for t in (k, v))
            outs = [
                _sdpa(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], seen)
                for rows, keys, seen in mask.chunks
            ]
            return torch.cat(outs, dim=2)
        q, k, v = (self._to_heads(t)[:, :, mask.order] for t in (q, k, v))
        out = _sdpa(q, k, v, mask.chunks[0][2])
        return self._to_tokens(out[:, :, mask.order.argsort()])

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H, S/cp, D] of this rank's tokens -> [B, H/cp, S, D] of its heads (Ulysses),
        the row in the ranks' order of parts."""
        batch, heads, part, dim = t.shape
        size = self.size
        # Head group j goes to rank j; from each rank its part of the sequence comes back.
        sent = t.view(batch, size, heads // size, part, dim).movedim(1, 0).contiguous()
        got = fc.wait_tensor(fc.all_to_all_single_autograd(sent, None, None, self.group))
        return got.movedim(0, 2).reshape(batch, heads // size, size * part, dim)

    def _to_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """[B, H/cp, S, D] of this rank's heads (the ranks' order of parts) -> [B, H, S/cp, D]
        of its tokens (Ulysses)."""
        batch, heads, seq, dim = t.shape
        size = self.size
        sent = t.view(batch, heads, size, seq // size, dim).movedim(2, 0).contiguous()
        got = fc.wait_tensor(fc.all_to_all_single_autograd(sent, None, None, self.group))
        return got.movedim(0, 1).reshape(batch, heads * size, seq // size, dim)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of queries ``q`` that are the last of keys ``k`` under boolean ``mask``; None:
    causal. Causal attention needs no mask: queries at the front, zeros, put the given ones at
    the keys' end for SDPA's causal kernel (its diagonal starts at the first key), whose work
    and memory are those of the keys, not of a mask of them."""
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    front = k.shape[2] - q.shape[2]
    if front:
        q = torch.cat([q.new_zeros(*q.shape[:2], front, q.shape[3]), q], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out[:, :, front:]


def parallelize_context(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """Give ``model`` (its ``attend``, and each attention's) the :class:`ContextParallel`
    variant over ``group``: its forward then takes each rank's part of the rows."""
    variant: AttentionVariant = ContextParallel(group, method)
    for module in model.modules():
        if hasattr(module, "attend"):
            module.attend = variant
