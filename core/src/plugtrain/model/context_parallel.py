"""Context parallelism: each rank holds a part of every sequence and attends over all of it.

Under ``[parallelism] cp = C`` the ``C`` ranks of a group read the same rows and each keeps two
of the row's ``2C`` chunks, chunk ``r`` and chunk ``2C - 1 - r`` (:func:`zigzag_indices`: the
first and the last chunks hold the least and the most causal work, so every rank gets as much,
Llama 3's load balancing). Everything but attention is per token, so the model runs on the
rank's tokens as on short rows, given their RoPE positions. Attention, through the model's
attention seam (:class:`ContextParallel`, in place of the variant), needs every token's keys
and values:

* ``allgather``: each rank gathers the keys and values of every rank (an all-gather with
  autograd, whose backward reduce-scatters their gradients) and attends each of its chunks'
  queries over the keys up to that chunk's end only;
* ``ulysses``: an all-to-all gives each rank every token's queries, keys and values for
  ``heads / C`` of the heads; it attends over the whole sequence, and a second all-to-all
  gives each rank its tokens back, for every head.

What either needs of a forward is built once in it (:class:`ContextMask`): with document
masking a boolean mask of same-document, causal pairs (the documents of every rank gathered
once); causal attention needs none (SDPA's causal kernel; a chunk's queries after the keys
before them by two blocks of the CPU flash kernel merged by log-sum-exp, elsewhere by padding).
Written with plain collectives (torch's ``context_parallel`` has no CPU path in torch 2.13), so
the CPU tests prove what a GPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    causal, with no mask: on the CPU by blocks (:class:`_CausalAfterPrefix`), elsewhere by
    padding (:func:`causal_by_padding`)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if k.shape[2] == q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if q.device.type == "cpu":
        return causal_by_blocks(q, k, v)
    return causal_by_padding(q, k, v)


def causal_by_padding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries ``q`` that are the last of keys ``k``: zero queries in
    front put them at the keys' end for SDPA's causal kernel (whose diagonal starts at the
    first key), which then keeps and computes as many queries as there are keys."""
    front = k.shape[2] - q.shape[2]
    q = torch.cat([q.new_zeros(*q.shape[:2], front, q.shape[3]), q], dim=2)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[:, :, front:]


def causal_by_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`causal_by_padding`'s attention on the CPU, at the cost of the queries alone: the
    keys before them, all seen, and their own, causal, by the flash kernel each, merged by
    log-sum-exp (:class:`_CausalAfterPrefix`)."""
    return _CausalAfterPrefix.apply(q, k, v)


class _CausalAfterPrefix(torch.autograd.Function):
    """Two blocks of the CPU flash kernel, merged by their log-sum-exp as ring attention merges
    its steps; the backward runs the kernel's backward on each block with the merged output
    and log-sum-exp, which is each block's share of the whole softmax's gradient."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        front = k.shape[2] - q.shape[2]
        seen, seen_lse = flash(q, k[:, :, :front], v[:, :, :front], 0.0, False)
        own, own_lse = flash(q, k[:, :, front:], v[:, :, front:], 0.0, True)
        lse = torch.logaddexp(seen_lse, own_lse)
        weights = [(part_lse - lse).exp().unsqueeze(-1) for part_lse in (seen_lse, own_lse)]
        merged = torch.promote_types(q.dtype, torch.float32)  # bf16 blocks merge in fp32
        out = (seen.to(merged) * weights[0] + own.to(merged) * weights[1]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        front = k.shape[2] - q.shape[2]
        blocks = ((slice(0, front), False), (slice(front, None), True))
        grads = [
            backward(grad.contiguous(), q, k[:, :, keys], v[:, :, keys], out, lse, 0.0, causal)
            for keys, causal in blocks
        ]
        dq = grads[0][0] + grads[1][0]
        return (
            dq,
            torch.cat([grads[0][1], grads[1][1]], 2),
            torch.cat([grads[0][2], grads[1][2]], 2),
        )


def parallelize_context(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """Give ``model`` (its ``attend``, and each attention's) the :class:`ContextParallel`
    variant over ``group``: its forward then takes each rank's part of the rows."""
    variant: AttentionVariant = ContextParallel(group, method)
    for module in model.modules():
        if hasattr(module, "attend"):
            module.attend = variant
