"""A mixture-of-experts feed-forward network: the router, the routed experts, a shared expert.

:class:`MoE` routes each token to ``top_k`` of ``num_experts`` SwiGLU experts, dropless (no
capacity: every token reaches every expert it picked), as Qwen3-MoE does:

1. **route** (:class:`Router`): ``gate``, a bias-free ``nn.Linear(dim, num_experts)``, gives
   the router logits; their softmax (fp32) the probabilities; the top ``top_k`` of the
   probabilities plus ``expert_bias`` pick the experts (DeepSeek-V3's auxiliary-loss-free
   balancing: the bias moves the choice, never the weights), and the picked probabilities,
   renormalised over the ``top_k`` when ``norm_topk_prob``, weigh their outputs;
2. **sort**: the token copies are ordered by expert (a stable sort), so that expert ``e``'s
   rows are contiguous, ``counts[e]`` of them;
3. **experts**: ``self.experts(x_sorted, counts)``, called exactly once per forward (expert
   parallelism wraps this call with its dispatch and combine);
4. **combine**: each copy's output, times its weight, goes back to its token's slot and the
   ``top_k`` slots are summed (a permutation and a sum: deterministic, no atomic adds).

In training mode each forward leaves its :class:`RouterStats` on :attr:`MoE.stats` (the input
of the load-balancing and z losses, ``model.moe.balance``) and adds its tokens per expert to
the ``tokens_per_expert`` buffer, on the device, for the bias update and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plugtrain.model.llama.transformer import FeedForward
from plugtrain.model.moe.experts import GroupedExperts

__all__ = ["MoE", "Router", "RouterStats"]


@dataclass(frozen=True)
class RouterStats:
    """What one mixture-of-experts layer's router did in a training forward of ``T`` tokens."""

    logits: torch.Tensor
    """The router logits, ``[T, num_experts]`` fp32, in the autograd graph (the z-loss's)."""
    probs: torch.Tensor
    """Their softmax, ``[T, num_experts]`` fp32, in the autograd graph (the balance loss's)."""
    counts: torch.Tensor
    """Token copies routed to each expert, ``[num_experts]`` int64 (no gradient), summing to
    ``T * top_k``."""
    top_k: int


class Router(nn.Module):
    """Top-k softmax routing with DeepSeek-V3's selection bias (see the module docstring)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # Not in the state dict (the Hugging Face format has no place for it): the balancing
        # state, which checkpoints keep on their own (model.moe.balance).
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=False)

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, dim]``: the logits and probabilities ``[T, E]`` (fp32), the picked
        experts ``[T, top_k]`` and their weights ``[T, top_k]`` (fp32)."""
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        experts = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, experts, weights


class MoE(nn.Module):
    """The mixture-of-experts feed-forward network of a block: ``router``, ``experts`` (a
    :class:`GroupedExperts`) and ``shared_experts`` (a SwiGLU every token goes through, or
    None)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        hidden: int,
        norm_topk_prob: bool = True,
        shared_hidden: int = 0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared_experts = FeedForward(dim, shared_hidden) if shared_hidden else None
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.stats: RouterStats | None = None
        """The last training forward's router statistics (None after one outside training)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., dim]`` -> the same shape."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, probs, experts, weights = self.router(x)
        flat = experts.flatten()
        # Not bincount: on CUDA it reads the largest index on the host.
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        # Token copy j (of token j // top_k) in expert order; stable, so that within an
        # expert the copies keep their tokens' order.
        order = flat.argsort(stable=True)
        routed = self.experts(x[order // self.top_k], counts)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        copies = torch.empty_like(routed)
        copies[order] = routed
        out = copies.view(-1, self.top_k, shape[-1]).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # Not when activation checkpointing recomputes this forward in the backward: the step's
        # forward counted its tokens already. Compiled, the graph task is not traceable and the
        # recompute is the backward graph's, which leaves these out (the compile plugin).
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:
            self.stats = RouterStats(logits, probs, counts, self.top_k) if self.training else None
            if self.training:
                self.tokens_per_expert += counts
        return out.view(shape)

    def init_buffers(self) -> None:
        """Zero the selection bias and the token counts (after ``to_empty``)."""
        self.router.expert_bias.zero_()
        self.tokens_per_expert.zero_()
