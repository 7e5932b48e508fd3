"""The moe family's model: Llama's decoder with Qwen3's attention and mixture-of-experts blocks.

Everything but the blocks is Llama's ``Transformer`` (``model.llama.transformer``): the
embedding, RoPE, the attention variants, the final norm, the output head, the KV cache and
decoding, the init plan's order. A block (:class:`MoEBlock`) is pre-norm as Llama's, its
attention Llama's with Qwen3's RMSNorm over each head's queries and keys before RoPE
(``q_norm``, ``k_norm``), and its feed-forward network ``moe`` (``model.moe.layer.MoE``:
``moe.router.gate``, ``moe.experts``, ``moe.shared_experts``) or, where the args make the block
dense, Llama's SwiGLU ``feed_forward``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plugtrain.model.init import Fill, init_ones, init_trunc_normal
from plugtrain.model.llama.transformer import (
    Attention,
    FeedForward,
    KVCache,
    RMSNorm,
    Transformer,
)
from plugtrain.model.moe.args import MoEArgs
from plugtrain.model.moe.layer import MoE

__all__ = ["MoEBlock", "MoETransformer", "moe_layers"]


class MoEBlock(nn.Module):
    """One pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, ``ffn`` the
    block's ``moe`` or, in a dense block, its ``feed_forward``."""

    def __init__(self, layer_id: int, args: MoEArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_id, qk_norm=True)  # type: ignore[arg-type]
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if args.is_moe_layer(layer_id):
            self.moe = MoE(
                args.dim,
                args.num_experts,
                args.top_k,
                args.moe_ffn_dim,
                args.norm_topk_prob,
                args.shared_ffn_dim,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, cache=cache, mask=mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None
        return h + ffn(self.ffn_norm(h))

    def init_plan(self) -> list[tuple[nn.Parameter, Fill]]:
        """Llama's block plan (``TransformerBlock.init_plan``: std 0.02, the projections into
        the residual stream shrinking with depth), the head norms ones, the router's gate and
        every expert's matrices drawn as the SwiGLU's are."""
        out_std = 0.02 / math.sqrt(2 * (self.layer_id + 1))
        attn = self.attention
        assert attn.q_norm is not None and attn.k_norm is not None
        plan: list[tuple[nn.Parameter, Fill]] = [
            (self.attention_norm.weight, init_ones),
            (attn.wq.weight, init_trunc_normal(0.02)),
            (attn.wk.weight, init_trunc_normal(0.02)),
            (attn.wv.weight, init_trunc_normal(0.02)),
            (attn.wo.weight, init_trunc_normal(out_std)),
            (attn.q_norm.weight, init_ones),
            (attn.k_norm.weight, init_ones),
            (self.ffn_norm.weight, init_ones),
        ]
        if self.moe is not None:
            experts, shared = self.moe.experts, self.moe.shared_experts
            plan.append((self.moe.router.gate.weight, init_trunc_normal(0.02)))
            plan += _swiglu_plan(experts.w1, experts.w3, experts.w2, out_std)
            if shared is not None:
                plan += _swiglu_plan(shared.w1.weight, shared.w3.weight, shared.w2.weight, out_std)
        else:
            ffn = self.feed_forward
            assert ffn is not None
            plan += _swiglu_plan(ffn.w1.weight, ffn.w3.weight, ffn.w2.weight, out_std)
        return plan


def _swiglu_plan(
    w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter, out_std: float
) -> list[tuple[nn.Parameter, Fill]]:
    """A SwiGLU's (or stacked experts') matrices as Llama draws its feed-forward network's:
    ``w1``, ``w3`` std 0.02, ``w2`` (into the residual stream) ``out_std``."""
    return [
        (w1, init_trunc_normal(0.02)),
        (w3, init_trunc_normal(0.02)),
        (w2, init_trunc_normal(out_std)),
    ]


class MoETransformer(Transformer):
    """Llama's ``Transformer`` with :class:`MoEBlock` blocks, built from :class:`MoEArgs`
    (called, initialised and decoded exactly as it is)."""

    block_type = MoEBlock  # type: ignore[assignment]

    def init_buffers(self) -> None:
        """Llama's RoPE table, and every mixture-of-experts layer's zeroed balancing state."""
        super().init_buffers()
        for moe in moe_layers(self):
            moe.init_buffers()


def moe_layers(model: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers of ``model``, in block order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]
