"""The one place where the model computes attention: the variants ``ModelArgs.attention`` names.

A variant does two things: once per forward, outside the layers, it builds the mask the
forward needs (:meth:`AttentionVariant.mask`; building it in every layer would repeat the
work ``n_layers`` times), and in every layer it turns that layer's queries, keys and values
and the mask into the attention's output (``__call__``). The training forward and the
KV-cache forwards of decoding both go through it. ``"sdpa"`` is causal
``F.scaled_dot_product_attention`` across a whole row; ``"document"`` (:class:`DocumentMasking`)
is causal within each document of a packed row, from the per-token document ids of
:class:`~plugtrain.data.MicroBatch`: on CUDA through flex attention with a ``BlockMask``, on
other devices through SDPA with a boolean block-diagonal causal mask (flex attention has no
backward on the CPU). A row without document ids is one document: decoding and scoring, whose
rows each hold one text, attend causally under either variant.

A variant reads every size (heads, key/value heads, lengths) from its tensors, never from
``ModelArgs``: under tensor parallelism each rank holds only some of the heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

__all__ = [
    "SDPA",
    "VARIANTS",
    "AttentionVariant",
    "DocumentMasking",
    "attention_variant",
    "document_block_mask",
    "document_mask",
]

Mask = torch.Tensor | BlockMask
"""What a variant's :meth:`AttentionVariant.mask` builds: a boolean tensor, or flex attention's
``BlockMask``."""


class AttentionVariant(Protocol):
    """How the model computes attention (see the module's docstring)."""

    def mask(
        self, tokens: torch.Tensor, start: int, documents: torch.Tensor | None = None
    ) -> Mask | None:
        """The mask of a forward of ``tokens`` [B, S] that follows ``start`` cached positions
        (0 without a cache), or None where the variant needs none; every layer receives it.
        ``documents`` [B, S] is each token's document (``MicroBatch.documents``), or None: a
        row is one document.
        """
        ...

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None
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

    def mask(
        self, tokens: torch.Tensor, start: int, documents: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """None where SDPA's ``is_causal`` is the mask (from position 0) or no mask is needed
        (one query, which sees every key so far); else the causal mask offset by ``start``.
        ``documents`` are not looked at: this variant attends across them."""
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


class DocumentMasking(SDPA):
    """Causal attention within each document of a packed row: a token sees the tokens before
    it in its own document only. Rows without document ids attend as :class:`SDPA` does."""

    def mask(
        self, tokens: torch.Tensor, start: int, documents: torch.Tensor | None = None
    ) -> Mask | None:
        """SDPA's mask without ``documents``; with them, on CUDA flex attention's ``BlockMask``
        (built here, once per forward, by the compiled ``create_block_mask``), elsewhere the
        boolean ``[B, 1, S, S]`` mask of same-document, causal pairs."""
        if documents is None:
            return super().mask(tokens, start)
        if start:
            raise ValueError(
                "document masking takes no KV cache: decode one document per row, without "
                "documents (each row is then one document)"
            )
        return document_block_mask(documents) if documents.is_cuda else document_mask(documents)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None
    ) -> torch.Tensor:
        """Flex attention under a ``BlockMask``, else SDPA's (a boolean mask, or causal)."""
        if isinstance(mask, BlockMask):
            flex = _compiled_flex_attention()
            return flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return super().__call__(q, k, v, mask)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask of same-document, causal pairs for ``documents`` [B, S]: [B, 1, S, S],
    True where the query may see the key."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def document_block_mask(documents: torch.Tensor, *, compiled: bool = True) -> BlockMask:
    """Flex attention's mask of same-document, causal pairs for ``documents`` [B, S]; built by
    the compiled ``create_block_mask`` unless ``compiled`` is False (a test's CPU check)."""

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (q >= kv) & (documents[b, q] == documents[b, kv])

    batch, seq = documents.shape
    return create_block_mask(
        same_document_causal, batch, None, seq, seq, device=documents.device, _compile=compiled
    )


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """Flex attention compiled once per process: uncompiled it materialises every score."""
    return torch.compile(flex_attention)


VARIANTS: dict[str, type[AttentionVariant]] = {"sdpa": SDPA, "document": DocumentMasking}
"""``ModelArgs.attention``'s names and their variants."""


def attention_variant(name: str) -> AttentionVariant:
    """The variant ``ModelArgs.attention`` names."""
    if name not in VARIANTS:
        raise ValueError(
            f"ModelArgs.attention={name!r} is not an attention variant; choose one of: "
            + ", ".join(VARIANTS)
        )
    return VARIANTS[name]()
