"""The training loss of a microbatch, normalised so that the step's loss is a mean over tokens.

Data without a loss mask (text) keeps the loss it always had: each microbatch's mean
cross-entropy divided by the number of microbatches, and FSDP2 averages the gradients over
ranks. With a loss mask (chat data: only the assistant's tokens count), microbatches and ranks
hold different numbers of counted tokens, and that average of means would weight a token of a
microbatch with few of them more than one of a microbatch with many (the gradient-accumulation
bug of transformers PR #34191, torchtune PR #1875). So each microbatch's loss is instead its
*sum* over counted tokens times ``D / N``, where ``N`` is the count over every microbatch of
the step on every one of the ``D`` data-parallel ranks: one all-reduce of a scalar per step, on
the device, with no read by the host. FSDP2's average over those ranks then makes the gradient
that of the mean over the step's ``N`` tokens, and the logged loss (the microbatches' sum,
averaged over ranks) that mean. Under tensor parallelism the ``tp`` ranks of a group read the
same tokens and hold the same (replicated) loss: they are counted once, the count summed over
the data-parallel group only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from plugtrain.data import IGNORE_INDEX, MicroBatch


class StepLoss:
    """Each microbatch's share of its step's loss; see the module doc. ``group``: the
    data-parallel ranks (``plugtrain.plugin.data_parallel_group``), None for one."""

    def __init__(self, *, masked: bool, group: dist.ProcessGroup | None = None) -> None:
        self.masked, self.group = masked, group
        self._weight: torch.Tensor | None = None

    def start(self, batch: Sequence[MicroBatch]) -> None:
        """Count the step's tokens that count, over its microbatches and the data-parallel
        ranks."""
        if not self.masked:
            return
        counts = [(microbatch.targets != IGNORE_INDEX).sum() for microbatch in batch]
        count = torch.stack(counts).sum().float()
        ranks = 1 if self.group is None else self.group.size()
        if ranks > 1:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.group)
        # A step with no counted token at all trains on nothing: weight 1 keeps its loss 0.
        self._weight = ranks / count.clamp(min=1)

    def __call__(self, loss: torch.Tensor, num_microbatches: int) -> torch.Tensor:
        """This microbatch's share of the step's loss, of its cross-entropy ``loss``: the mean
        over its tokens, or with ``masked`` the sum over its counted ones."""
        if not self.masked:
            return loss / num_microbatches
        assert self._weight is not None, "start() the step first"
        return loss * self._weight
