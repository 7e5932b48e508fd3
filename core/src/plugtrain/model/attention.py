"""The one place where the model computes attention: the variants ``ModelArgs.attention`` names.

A variant does two things: once per forward, outside the layers, it builds the mask the
forward needs (:meth:`AttentionVariant.mask`; building it in every layer would repeat the
work ``n_layers`` times), and in every layer it turns that layer's queries, keys and values
and the mask into the attention's output (``__call__``). The training forward and the
KV-cache forwards of decoding both go through it. The only variant today is ``"sdpa"``,
causal ``F.scaled_dot_product_attention``; another one (document masking, a causal mask per
document of a packed row, through SDPA with a boolean block mask or flex attention with a
``BlockMask``) is a class here and an entry in :data:`VARIANTS`, with the blocks' forwards
left as they are.

A variant reads every size (heads, key/value heads, lengths) from its tensors, never from
``ModelArgs``: under tensor parallelism each rank holds only some of the heads.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["SDPA", "VARIANTS", "AttentionVariant", "attention_variant"]


class AttentionVariant(Protocol):
    """How the model computes attention (see the module's docstring)."""

    def mask(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """The mask of a forward of ``tokens`` [B, S] that follows ``start`` cached positions
        (0 without a cache), or None where the variant needs none; every layer receives it.

        A document-masking variant finds the documents' boundaries here: in the tokens
        themselves (each document starts with its BOS token) or in per-token positions that
        ``Transformer.forward`` would take and hand on.
        """
        ...

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of the queries ``q`` [B, heads, S, head_dim] (after RoPE) over the keys
        and values ``k``, ``v`` [B, kv_heads, L, head_dim], with ``mask`` from :meth:`mask`;
        returns [B, heads, S, head_dim]. ``kv_heads`` divides ``heads`` (grouped-query
        attention); L is S, or with a KV cache the cached positions and this forward's."""
        ...


class SDPA:
    """Causal attention through ``F.scaled_dot_product_attention`` (whichever kernel it picks).

    Each group of ``heads // kv_heads`` query heads shares one key/value head through
    ``enable_gqa``, without materialising repeated copies.
    """

    def mask(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        """None where SDPA's ``is_causal`` is the mask (from position 0) or no mask is needed
        (one query, which sees every key so far); else the causal mask offset by ``start``."""
        seq = tokens.shape[1]
        if start == 0 or seq == 1:
            return None
        # Query i sits at position start + i and sees keys 0 .. start + i; SDPA's is_causal
        # would align the diagonal at the top left, as if start were 0.
        return torch.ones(seq, start + seq, dtype=torch.bool, device=tokens.device).tril(start)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Without a mask: causal where the keys are the queries' own positions (L = S), else
        (one query after the cached ones) every key is seen."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and q.shape[2] == k.shape[2],
            enable_gqa=q.shape[1] != k.shape[1],
        )


VARIANTS: dict[str, type[AttentionVariant]] = {"sdpa": SDPA}
"""``ModelArgs.attention``'s names and their variants."""


def attention_variant(name: str) -> AttentionVariant:
    """The variant ``ModelArgs.attention`` names."""
    if name not in VARIANTS:
        raise ValueError(
            f"ModelArgs.attention={name!r} is not an attention variant; choose one of: "
            + ", ".join(VARIANTS)
        )
    return VARIANTS[name]()
