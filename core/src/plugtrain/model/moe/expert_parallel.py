"""Expert parallelism (``[parallelism] ep``): experts split over ranks, tokens sent to them.

Each rank of an ``ep`` group holds ``1/ep`` of every layer's routed experts, and each token
travels to its expert's rank and back.
As torchtitan's dp2ep, the ``ep`` ranks are carved out of ``dp_shard``
(``distributed.EXPERT_SHARD``): the experts' stacked weights are DTensors sharded over ``ep``
on the expert dimension (``Shard(0)``), then FSDP-sharded over the ``dp_shard / ep`` ranks that
hold the same experts, while the dense parameters are FSDP-sharded over every ``dp_shard``
rank. A checkpoint therefore holds every expert under the same keys as one process's, and
reshards between EP layouts as DCP reshards any DTensor.

The routing itself is the model's: the MoE block sorts its tokens by expert and calls its
:class:`GroupedExperts` once with the global counts. A forward pre-hook dispatches them (one
all-to-all of the counts, one read of the split sizes on the host, one all-to-all of the
tokens, with autograd), the experts run on this rank's experts, and a forward hook combines
(the reverse all-to-all), so that the block sees the rows it sent, in its order.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from plugtrain.errors import ConfigError
from plugtrain.model.moe.experts import GroupedExperts

__all__ = [
    "ExpertParallel",
    "check_expert_parallel",
    "expert_modules",
    "parallelize_experts",
    "shard_experts",
]


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The routed experts of every layer of ``model``, in order (none for a dense model)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


class ExpertParallel:
    """The dispatch and combine of one :class:`GroupedExperts` module over the ``ep`` mesh.

    The layout the hooks pass between them (the split sizes and the permutation) is kept for
    the one call in flight: the block calls its experts once per forward (a recomputing
    backward calls them again, and dispatches again).
    """

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.group = mesh.get_group()
        self.ep = mesh.size()
        self.local = num_experts // self.ep
        """Experts on each rank."""
        self._route: tuple[list[int], list[int], torch.Tensor] | None = None

    def dispatch(
        self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, counts)``, this rank's tokens sorted by global expert and the count of each
        expert, into the tokens of this rank's experts from every rank of the group, sorted by
        local expert, and their counts."""
        x, counts = inputs
        # received[s, e]: the rows rank s sends to this rank's expert e.
        received = torch.empty_like(counts)
        torch.distributed.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.ep, self.local)
        sent = counts.view(self.ep, self.local).sum(1)
        # The one read on the host: the all-to-all's split sizes.
        send_splits, receive_splits = torch.stack([sent, received.sum(1)]).tolist()
        rows = funcol.all_to_all_single_autograd(x, receive_splits, send_splits, self.group)
        rows = funcol.wait_tensor(rows)
        # The rows arrive by source rank, then expert; the experts need them by expert, then
        # source: a stable sort on that key, undone by the combine.
        segment = torch.arange(received.numel(), device=x.device)
        segment = segment.repeat_interleave(received.flatten(), output_size=rows.shape[0])
        order = (segment % self.local * self.ep + segment // self.local).argsort(stable=True)
        self._route = (send_splits, receive_splits, order)
        return rows[order], received.sum(0)

    def combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The experts' output rows back to the ranks and order they came from."""
        assert self._route is not None, "combine without a dispatch"
        send_splits, receive_splits, order = self._route
        self._route = None
        restored = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device)
        )
        back = funcol.all_to_all_single_autograd(
            output[restored], send_splits, receive_splits, self.group
        )
        return funcol.wait_tensor(back)


def _shard_experts_dim(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition: each weight of a :class:`GroupedExperts` split over
    ``mesh`` on its first (expert) dimension."""
    if isinstance(module, GroupedExperts):
        for key, param in list(module.named_parameters(recurse=False)):
            split = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(key, split)


def check_expert_parallel(ep: int, experts: list[int], family: str) -> None:
    """Refuse, in one line, ``ep`` ranks for a model whose layers have ``experts`` routed
    experts each: none (a dense family), or a count ``ep`` does not divide."""
    if not experts:
        raise ConfigError(
            f"parallelism.ep = {ep} but model.family '{family}' has no routed experts to split: "
            f"set model.family = 'moe', or parallelism.ep = 1"
        )
    for count in experts:
        if count % ep:
            raise ConfigError(
                f"parallelism.ep = {ep} does not divide the model's {count} experts: choose an "
                f"ep that divides {count} (or set model.moe_experts to a multiple of {ep})"
            )


def parallelize_experts(model: nn.Module, mesh: DeviceMesh, family: str) -> None:
    """Split every layer's routed experts over the ``ep`` ``mesh`` (``model``, of family
    ``family``, unsharded, on the meta device, changed in place) and route their tokens over
    it.

    A model without routed experts, or whose experts ``ep`` does not divide, is refused in one
    line (:func:`check_expert_parallel`).
    """
    experts = expert_modules(model)
    check_expert_parallel(mesh.size(), [m.num_experts for m in experts], family)
    for module in experts:
        style = ExpertParallel(mesh, module.num_experts)
        distribute_module(module, mesh, _shard_experts_dim, style.dispatch, style.combine)


def shard_experts(
    model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy, ep: int
) -> None:
    """FSDP2 on each layer's experts over ``mesh`` (``distributed.EXPERT_SHARD``), before the
    blocks are sharded.

    A gradient of an expert is the sum of what the tokens of every rank of its ``ep`` group gave
    it, so FSDP2's average over ``mesh`` alone leaves it ``ep`` times too large (pytorch
    #160285): a hook divides the averaged shard by ``ep``, which makes it the average over
    every data-parallel rank, as the dense gradients are. The anchors'
    ``set_gradient_divide_factor`` needs PREMUL_SUM, which gloo lacks; with
    ``set_force_sum_reduction_for_comms`` torch 2.13 divides twice where ``mesh`` has one rank
    (EP over every rank: ``foreach_reduce`` divides in its copy, then again after).
    """
    for module in expert_modules(model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
        sharded: Any = module
        assert isinstance(sharded, FSDPModule)
        sharded.set_all_reduce_hook(functools.partial(torch.Tensor.div_, other=ep))
