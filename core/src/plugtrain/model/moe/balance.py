"""A run's load balancing of its mixture-of-experts layers: the losses, the bias, the metrics.

Three means, each off by default (``[model] moe_*``):

* the **load-balancing loss** (Switch Transformer's, Qwen-MoE's): for each layer, ``E *
  sum_e f_e * P_e``, ``f_e`` the fraction of the token copies routed to expert ``e`` (the
  top-k's counts over ``T * top_k``: 1 in all) and ``P_e`` the mean router probability of
  ``e`` over the ``T`` tokens; 1 when balanced. Averaged over the layers, times
  ``moe_aux_loss_weight``. ``f`` counts the microbatch's tokens on every data-parallel rank
  (one all-reduce a microbatch; ``P`` is this rank's, which the gradients' mean over the ranks
  averages): the loss is the global batch's (Qwen's global-batch balancing), the same on 1
  process as on N, not a mean of each rank's, which would depend on the split;
* the **router z-loss** (ST-MoE's): the mean over the tokens of the squared log-sum-exp of the
  router logits, averaged over the layers, times ``moe_z_loss_weight``;
* DeepSeek-V3's **auxiliary-loss-free bias**: in each optimizer step every layer's
  ``expert_bias`` (added to the probabilities for the top-k choice only) moves by
  ``moe_bias_update_rate`` toward balance, ``bias += rate * sign(mean load - load)``, the loads
  summed over the data-parallel ranks on the device: no host read. A step a plugin vetoes
  leaves it as it was, as it leaves the weights (``training.vetoes``: the optimizer's
  ``found_inf``, on the device).

The losses enter the loss as loss terms (``training.loss_terms``), from the router statistics
each microbatch's forward left (``RouterStats``, also given to plugins' ``loss_terms`` as
``LossContext.router``): each term is the microbatch's share, its value over the step's
microbatches, as the cross-entropy's. The loads of each step (tokens per expert, summed over
ranks) give the metrics of a logging step, ``moe/imbalance.<block>`` (max over mean) and
``moe/max_tokens.<block>``, ``moe/min_tokens.<block>``, and ``moe/imbalance`` (the worst
block's), read with the record's other values; with ``[metrics] moe_tokens_per_expert``
every expert's, ``moe/tokens_per_expert.<block>.<expert>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from plugtrain.model.moe.layer import MoE, RouterStats

__all__ = ["Balance", "load_balancing_loss", "router_z_loss", "update_bias"]


def load_balancing_loss(stats: RouterStats, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` of one layer's routing (see the module docstring), fp32, in the
    autograd graph through ``P`` (the counts ``f`` are not differentiable); ``counts``, the
    tokens per expert ``f`` is taken from (default: ``stats.counts``, this process's)."""
    experts = stats.probs.shape[-1]
    counts = stats.counts if counts is None else counts
    fraction = counts.float() / counts.sum()
    return experts * (fraction * stats.probs.mean(dim=0)).sum()


def router_z_loss(stats: RouterStats) -> torch.Tensor:
    """The mean over the tokens of ``logsumexp(router logits) ** 2``, of one layer."""
    return stats.logits.logsumexp(dim=-1).square().mean()


@torch.no_grad()
def update_bias(
    bias: torch.Tensor, load: torch.Tensor, rate: float, skip: torch.Tensor | None = None
) -> None:
    """DeepSeek-V3's update of one layer's selection ``bias`` in place from its experts'
    ``load`` (tokens per expert): raise the under-loaded experts' bias by ``rate``, lower the
    over-loaded ones'; an expert at the mean load keeps its own. ``skip``, a 0-d device flag
    (nonzero: the step was vetoed), leaves ``bias`` bitwise as it was, with no host read."""
    load = load.float()
    moved = bias + rate * torch.sign(load.mean() - load)
    bias.copy_(moved if skip is None else torch.where(skip.bool(), bias, moved))


class Balance:
    """The balancing of ``model``'s mixture-of-experts layers in a run (see the module
    docstring); the trainer's step calls :meth:`terms` per microbatch (when a loss is on) and
    :meth:`after_backward` once per step, the optimizer's step :meth:`step` (:meth:`attach`);
    the trainer checkpoints :meth:`state_dict`."""

    def __init__(
        self,
        layers: Mapping[int, MoE],
        *,
        aux_loss_weight: float = 0.0,
        z_loss_weight: float = 0.0,
        bias_update_rate: float = 0.0,
        group: dist.ProcessGroup | None = None,
        per_expert: bool = False,
    ) -> None:
        self.blocks = list(layers)
        """The blocks (their indices) whose feed-forward networks are mixtures of experts."""
        self.layers = list(layers.values())
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        self.bias_update_rate, self.per_expert = bias_update_rate, per_expert
        self.group = group
        """The data-parallel ranks the loads are summed over; None: this process's alone."""
        self.load: torch.Tensor | None = None
        """The last step's tokens per expert, ``[layers, experts]``, summed over ranks once
        :meth:`metrics` or the bias update reduced them."""
        self._reduced = False
        self._pending = False  # the loads taken have not moved the bias yet

    @classmethod
    def of(
        cls,
        model: nn.Module,
        config: Any,
        per_expert: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> Balance | None:
        """The balancing of ``model`` with ``[model]`` ``config``'s settings (``per_expert``:
        :meth:`metrics` gives every expert's load), its loads summed over ``group`` (None: one
        process); None for a model without experts."""
        layers = {int(i): b.moe for i, b in model.layers.items() if getattr(b, "moe", None)}
        if not layers:
            return None
        return cls(
            layers,
            aux_loss_weight=config.moe_aux_loss_weight,
            z_loss_weight=config.moe_z_loss_weight,
            bias_update_rate=config.moe_bias_update_rate,
            group=group,
            per_expert=per_expert,
        )

    @property
    def has_losses(self) -> bool:
        """Whether a loss term is on (else :meth:`terms` is never called)."""
        return self.aux_loss_weight > 0 or self.z_loss_weight > 0

    def stats(self) -> list[RouterStats]:
        """Each layer's router statistics of the last training forward, in block order."""
        return [m.stats for m in self.layers if m.stats is not None]

    def terms(self, ctx: Any) -> dict[str, torch.Tensor]:
        """The loss terms of microbatch ``ctx`` (a ``LossContext``): its share of the step's
        weighted losses, averaged over its layers (``ctx.router``)."""
        share = 1.0 / ctx.num_microbatches
        out = {}
        if self.aux_loss_weight > 0:
            counts = torch.stack([s.counts for s in ctx.router])
            if self.group is not None:  # f of the microbatch on every rank: see the docstring
                dist.all_reduce(counts, group=self.group)
            losses = [load_balancing_loss(s, c) for s, c in zip(ctx.router, counts, strict=True)]
            aux = torch.stack(losses).mean()
            out["aux_loss"] = self.aux_loss_weight * share * aux
        if self.z_loss_weight > 0:
            z = torch.stack([router_z_loss(s) for s in ctx.router]).mean()
            out["router_z_loss"] = self.z_loss_weight * share * z
        return out

    def after_backward(self) -> None:
        """Take the step's tokens per expert off the layers (zeroing their counts) and, with a
        rate, sum them over the ranks (on every rank, vetoed step or not) for :meth:`step`."""
        self.load = torch.stack([m.tokens_per_expert for m in self.layers])  # a copy
        self._reduced = False
        for m in self.layers:
            m.tokens_per_expert.zero_()
        if self.bias_update_rate > 0:
            self._global_load()
            self._pending = True

    def step(self, skip: torch.Tensor | None = None) -> None:
        """Move every layer's bias by the loads :meth:`after_backward` took, once, unless
        ``skip`` (a 0-d device flag, nonzero: the step was vetoed), on the device."""
        if not self._pending:
            return
        self._pending = False
        for m, layer_load in zip(self.layers, self._global_load(), strict=True):
            update_bias(m.router.expert_bias, layer_load, self.bias_update_rate, skip)

    def attach(self, optimizer: Optimizer) -> None:
        """Run :meth:`step` in each ``optimizer.step()``, after the update: the bias moves
        with the weights. A step vetoed on the host calls no ``step()``; one vetoed on the
        device gets its flag as ``found_inf`` (``training.vetoes``), which skips this too."""
        if self.bias_update_rate > 0:
            optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self.step(getattr(opt, "found_inf", None))
            )

    def _global_load(self) -> torch.Tensor:
        assert self.load is not None, "after_backward takes the loads first"
        if not self._reduced and self.group is not None:
            dist.all_reduce(self.load, group=self.group)
        self._reduced = True
        return self.load

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's load metrics, on the device (a collective over the ranks, unless the
        bias update already made it): each block's ``imbalance.<i>`` (max over mean tokens
        per expert), ``max_tokens.<i>``, ``min_tokens.<i>``, the worst ``imbalance``, and with
        :attr:`per_expert` every expert's ``tokens_per_expert.<i>.<e>``."""
        if self.load is None:
            return {}
        counts = self._global_load()
        load = counts.float()
        imbalance = load.max(dim=1).values / load.mean(dim=1)
        out = {"imbalance": imbalance.max()}
        for block, row, ratio in zip(self.blocks, counts, imbalance, strict=True):
            out |= {
                f"imbalance.{block}": ratio,
                f"max_tokens.{block}": row.max(),
                f"min_tokens.{block}": row.min(),
            }
            if self.per_expert:
                out |= {f"tokens_per_expert.{block}.{e}": n for e, n in enumerate(row.unbind())}
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every layer's selection bias, ``[layers, experts]`` (the same on every rank)."""
        return {"expert_bias": torch.stack([m.router.expert_bias for m in self.layers])}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for m, bias in zip(self.layers, state_dict["expert_bias"], strict=True):
            m.router.expert_bias.copy_(bias)
