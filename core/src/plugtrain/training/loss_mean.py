"""The training loss of a microbatch, normalised so that the step's loss is a mean over tokens.

Data without a loss mask (text) keeps the loss it always had: each microbatch's mean
cross-entropy divided by the number of microbatches, and FSDP2 averages the gradients over
ranks. With a loss mask (chat data: only the assistant's tokens count), microbatches and ranks
hold different numbers of counted tokens, and that average of means would weight a token of a
microbatch with few of them more than one of a microbatch with many (the gradient-accumulation
bug of transformers PR #34191, torchtune PR #1875). So each microbatch's loss is instead its
*sum* over counted tokens times ``world_size / N``, where ``N`` is the count over every
microbatch of the step on every rank: one all-reduce of a scalar per step, on the device, with
no read by the host. FSDP2's average over ranks then makes the gradient that of the mean over
the step's ``N`` tokens, and the logged loss (the microbatches' sum, averaged over ranks) that
mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from plugtrain.data import IGNORE_INDEX, MicroBatch
from plugtrain.errors import ConfigError


class StepLoss:
    """Each microbatch's share of its step's loss; see the module doc."""

    def __init__(self, *, masked: bool, world_size: int) -> None:
        self.masked, self.world_size = masked, world_size
        self._weight: torch.Tensor | None = None

    def start(self, batch: Sequence[MicroBatch]) -> None:
        """Count the step's tokens that count, over its microbatches and every rank."""
        if not self.masked:
            return
        counts = [(microbatch.targets != IGNORE_INDEX).sum() for microbatch in batch]
        count = torch.stack(counts).sum().float()
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        # A step with no counted token at all trains on nothing: weight 1 keeps its loss 0.
        self._weight = self.world_size / count.clamp(min=1)

    def __call__(self, loss: torch.Tensor, num_microbatches: int) -> torch.Tensor:
        """This microbatch's share of the step's loss, of its cross-entropy ``loss``: the mean
        over its tokens, or with ``masked`` the sum over its counted ones."""
        if not self.masked:
            return loss / num_microbatches
        assert self._weight is not None, "start() the step first"
        return loss * self._weight


def check_masked_loss_parallelism(tp: int, source: str) -> None:
    """Refuse, in one line, chat data's assistant-only loss (``source``, a config key and path)
    under tensor parallelism: its summed loss over vocabulary-sharded logits and its count of
    the step's tokens over every rank (each batch counted ``tp`` times) are not written for it
    yet."""
    if tp > 1:
        raise ConfigError(
            f"{source} is chat data, whose assistant-only loss does not run under tensor "
            f"parallelism yet (parallelism.tp = {tp}): set parallelism.tp = 1 (FSDP or HSDP "
            "alone)"
        )
